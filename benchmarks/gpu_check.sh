#!/usr/bin/env bash
# The CUDA path on a GPU machine, in one command:
#
#     benchmarks/gpu_check.sh [WHEEL_DIR] [OUT_DIR]
#
# Installs the project (editable, no dependencies) and, with WHEEL_DIR (default .whl; made
# on a machine with PyPI by benchmarks/gpu_wheels.sh), the wheels it needs beside the
# machine's own CUDA torch — no network needed. Without WHEEL_DIR it installs '.[dev]' from
# PyPI; WHEEL_DIR "none" installs nothing (done already). Then runs, each step logged to OUT_DIR (default gpu-results):
#   tests    the gpu-marked tests (tests/gpu: parity, engine, LoRA, real weights)
#   e2e      the end-to-end openai-SDK and tinker-SDK tests against `infer serve --device cuda`
#   decode   bench_decode_step.py: TPOT at 1/16/64/256 rows and kernels per step, CUDA
#            graphs (the default) beside --enforce-eager, on dummy:Qwen3-0.6B and
#            dummy:Llama-3.2-1B
#   offline  nano-vllm's offline workload (256 seqs, 100-1,024 in/out; GPU_CHECK_OFFLINE_ARGS
#            adds flags, e.g. "--num-seqs 64 --max-len 256") on dummy:Qwen3-0.6B and
#            dummy:Llama-3.2-1B, graphs and eager
#   serving  bench_serving.py sweep 1/16/64/256 streams on SmolLM2 and dummy:Llama-3.2-1B
#   sft      the Tinker SFT benchmark on the GPU beside transformers + PEFT
# GPU_CHECK_STEPS picks steps (default: all, in that order); GPU_CHECK_STEP_TIMEOUT bounds
# each step (seconds, default 1800). Results: OUT_DIR/summary.txt
# (step, status, seconds), OUT_DIR/<step>.log and the benchmarks' JSON, all also packed
# into OUT_DIR/results.tar.gz.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=${1:-.whl}
OUT=${2:-gpu-results}
PY=${PYTHON:-python3}
STEPS=${GPU_CHECK_STEPS:-tests e2e decode offline serving sft}
STEP_TIMEOUT=${GPU_CHECK_STEP_TIMEOUT:-1800}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TINKER_TELEMETRY=0 HF_HUB_OFFLINE=1

if [ "$WHEELS" = none ]; then
    :
elif [ -d "$WHEELS" ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile "$WHEELS"/*.whl || exit 1
    $PY -m pip install -q --no-index --no-deps --no-build-isolation -e . || NO_EDITABLE=1
else
    $PY -m pip install -q -e ".[dev]" || exit 1
fi
BIN=$(dirname "$($PY -c 'import sys; print(sys.executable)')")
if [ "${NO_EDITABLE:-}" = 1 ] || [ ! -x "$BIN/infer" ]; then  # e.g. an old setuptools: a shim
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    printf '#!/bin/sh\nexec %s -c "from entrypoints.cli import main; main()" "$@"\n' \
        "$BIN/python3" > "$BIN/infer"
    chmod +x "$BIN/infer"
fi
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
    git rev-parse --short HEAD 2>/dev/null || true
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

step() {  # step NAME COMMAND...: run it, log it, record status and seconds
    local name=$1 start status
    shift
    start=$(date +%s)
    echo "== $name: $*"
    timeout "$STEP_TIMEOUT" "$@" > "$OUT/$name.log" 2>&1
    status=$?
    tail -n 25 "$OUT/$name.log"
    echo "$name $([ $status -eq 0 ] && echo PASS || echo "FAIL($status)") $(( $(date +%s) - start ))s" \
        | tee -a "$OUT/summary.txt"
}

for s in $STEPS; do
    case $s in
    tests)
        step tests $PY -m pytest -q -m gpu tests/gpu -p no:cacheprovider
        ;;
    e2e)
        step e2e env INFER_TEST_DEVICE=cuda $PY -m pytest -q tests/e2e -p no:cacheprovider
        ;;
    decode)
        for m in Qwen3-0.6B Llama-3.2-1B; do
            step "decode-$m" $PY benchmarks/bench_decode_step.py --model "dummy:$m" \
                --device cuda --profile --result-json "$OUT/decode-$m.json"
            step "decode-$m-eager" $PY benchmarks/bench_decode_step.py --model "dummy:$m" \
                --device cuda --profile --enforce-eager --result-json "$OUT/decode-$m-eager.json"
        done
        ;;
    offline)
        for m in Qwen3-0.6B Llama-3.2-1B; do
            # shellcheck disable=SC2086  # GPU_CHECK_OFFLINE_ARGS: several flags
            step "offline-$m" $PY benchmarks/bench_offline.py --model "dummy:$m" --device cuda \
                ${GPU_CHECK_OFFLINE_ARGS:-} --result-json "$OUT/offline-$m.json"
            step "offline-$m-eager" $PY benchmarks/bench_offline.py --model "dummy:$m" \
                --device cuda ${GPU_CHECK_OFFLINE_ARGS:-} --enforce-eager \
                --result-json "$OUT/offline-$m-eager.json"
        done
        ;;
    serving)
        for m in smollm2 dummy:Llama-3.2-1B; do
            step "serving-${m#dummy:}" $PY benchmarks/bench_serving.py --model "$m" --device cuda \
                --modes continuous --workloads sweep --concurrency 1,16,64,256 \
                --max-batch-size 256 --no-baseline --result-json "$OUT/serving-${m#dummy:}.json"
        done
        ;;
    sft)
        step sft $PY benchmarks/bench_tinker_sft.py --device cuda --steps 16 \
            --result-json "$OUT/sft.json"
        ;;
    *) echo "unknown step $s" ;;
    esac
done
tar -czf "$OUT/results.tar.gz" -C "$OUT" --exclude results.tar.gz . 2>/dev/null
cat "$OUT/summary.txt"
