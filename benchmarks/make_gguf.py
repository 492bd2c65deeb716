"""A 1B-class GGUF for the speed benchmarks (issue 45 item 8): no such weights ship on the
package index, but speed does not depend on their values.

``dummy:<name>``'s published config (``adapters/weights/dummy_configs/``) saved as an HF
folder with seeded random bf16 weights (normal, std 0.02; norms 1), converted by the
llama.cpp converter vendored in llama-cpp-python's sdist (``convert_hf_to_gguf.py``, built
beside ``llama-server`` by ``benchmarks/llama_server.py``) and quantized by its
``llama-quantize`` (Q4_1, and Q4_K_M where asked). The converter needs a tokenizer whose
pre-tokenizer it knows; none of Llama 3's ships offline, so the folder carries SmolLM2's
(the default model's) and the config its vocabulary: 49,152 ids instead of 128,256. Every
layer keeps the real model's shapes (Llama-3.2-1B: 16 layers, hidden 2,048, MLP 8,192, 32
query / 8 KV heads); the tied embedding / LM head is 101 M weights instead of 263 M. The
files are cached under ``${INFER_CACHE_DIR:-~/.cache/infer}/bench-models/``.

    .venv/bin/python benchmarks/make_gguf.py [--dummy Llama-3.2-1B] [--types Q4_1,Q4_K_M]

prints each GGUF's path (stdout), progress on stderr.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from importlib.resources import files
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VOCAB_FROM = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the embedded default model's tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _progress(message: str) -> None:
    print(f"[make_gguf] {message}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    root = os.environ.get("INFER_CACHE_DIR") or Path.home() / ".cache" / "infer"
    return Path(root) / "bench-models"


def _tokenizer_folder() -> tuple[Path, dict[str, object]]:
    """The default model's resolved folder (its tokenizer) and its config."""
    from entrypoints.config import ServerConfig
    from entrypoints.container import create_container

    resolved = create_container(ServerConfig.for_model(None)).backend.resolved_model()
    return resolved.path, json.loads((resolved.path / "config.json").read_text())


def hf_folder(dummy: str, out: Path, seed: int = 0) -> Path:
    """``out``/``dummy``-smollm2-vocab: config, tokenizer and random weights (once)."""
    import torch
    from safetensors.torch import save_file

    folder = out / f"{dummy}-smollm2-vocab"
    if (folder / "model.safetensors").is_file():
        return folder
    config = json.loads(
        files("adapters.weights").joinpath(f"dummy_configs/{dummy}.json").read_text()
    )
    source, source_config = _tokenizer_folder()
    config |= {
        "vocab_size": source_config["vocab_size"],
        "bos_token_id": source_config.get("bos_token_id"),
        "eos_token_id": source_config.get("eos_token_id"),
    }
    scratch = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=out))
    try:
        (scratch / "config.json").write_text(json.dumps(config, indent=2))
        for name in TOKENIZER_FILES:
            shutil.copy2(source / name, scratch / name)
        gen = torch.Generator().manual_seed(seed)
        hidden, inter = config["hidden_size"], config["intermediate_size"]
        head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
        q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim

        def normal(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

        tensors = {"model.embed_tokens.weight": normal(config["vocab_size"], hidden)}
        tensors["model.norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        if not config.get("tie_word_embeddings"):
            tensors["lm_head.weight"] = normal(config["vocab_size"], hidden)
        for i in range(config["num_hidden_layers"]):
            _progress(f"layer {i + 1}/{config['num_hidden_layers']}")
            p = f"model.layers.{i}."
            tensors |= {
                p + "self_attn.q_proj.weight": normal(q, hidden),
                p + "self_attn.k_proj.weight": normal(kv, hidden),
                p + "self_attn.v_proj.weight": normal(kv, hidden),
                p + "self_attn.o_proj.weight": normal(hidden, q),
                p + "mlp.gate_proj.weight": normal(inter, hidden),
                p + "mlp.up_proj.weight": normal(inter, hidden),
                p + "mlp.down_proj.weight": normal(hidden, inter),
                p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
                p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            }
        save_file(tensors, str(scratch / "model.safetensors"), metadata={"format": "pt"})
        scratch.rename(folder)  # whole or not at all: an interrupted run leaves a scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return folder


def gguf(dummy: str, types: list[str]) -> list[Path]:
    """Each quantization's GGUF of ``dummy`` (made once)."""
    from benchmarks.llama_server import build

    out = cache_root()
    out.mkdir(parents=True, exist_ok=True)
    wanted = {t: out / f"{dummy}-smollm2-vocab.{t}.gguf" for t in types}
    if all(p.is_file() for p in wanted.values()):
        return list(wanted.values())
    tools = build()
    folder = hf_folder(dummy, out)
    bf16 = out / f"{dummy}-smollm2-vocab.bf16.gguf"
    if not bf16.is_file():
        _progress(f"converting {folder} (convert_hf_to_gguf.py)")
        partial = bf16.with_suffix(".partial")
        cmd = [sys.executable, str(tools / "convert_hf_to_gguf.py"), str(folder)]
        subprocess.run([*cmd, "--outfile", str(partial), "--outtype", "bf16"], check=True)
        partial.rename(bf16)
    for kind, path in wanted.items():
        if path.is_file():
            continue
        _progress(f"quantizing to {kind} (llama-quantize)")
        started = time.monotonic()
        partial = path.with_suffix(".partial")
        cmd = [str(tools / "bin" / "llama-quantize"), str(bf16), str(partial), kind]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        partial.rename(path)
        took = time.monotonic() - started
        _progress(f"{path.name}: {path.stat().st_size / 2**20:.0f} MiB, {took:.0f} s")
    return list(wanted.values())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dummy", default="Llama-3.2-1B", help="a dummy: model's short name")
    p.add_argument("--types", default="Q4_1", help="llama-quantize types, comma-separated")
    args = p.parse_args()
    for path in gguf(args.dummy, [t for t in args.types.split(",") if t]):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
