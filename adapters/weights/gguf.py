"""GGUF file -> Hugging Face-format folder: float32 safetensors, config, tokenizer.

Tensors are dequantized exactly (no requantization), renamed from llama.cpp's names to
transformers' names, and put back into transformers' layout where llama.cpp changed it.
Linear weights in a quantization infer can run (see gguf_quant) are also written, still
quantized, to quantized.safetensors and listed in quantization.json.
"""

import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType, ReaderField, ReaderTensor
from gguf.quants import dequantize
from safetensors.numpy import save_file
from tqdm import tqdm
from transformers import AutoTokenizer

from adapters.weights.gguf_config import HF_FAMILIES, GGUFMetadata, generation_config, hf_config
from adapters.weights.gguf_quant import DECODERS, QuantizedLinear
from domain.errors import ModelLoadError

# Read separately (tokens) or only by transformers' tokenizer builder.
BULKY_KEYS = {
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
}
TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3 has four norms per layer, so llama.cpp's ffn_norm is the pre-feedforward one.
GEMMA3_LAYER_NAMES = LAYER_NAMES | {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
LAYER_NAMES_BY_ARCH = {"llama": LAYER_NAMES, "qwen3": LAYER_NAMES, "gemma3": GEMMA3_LAYER_NAMES}
# Linear layers' weights: the ones that may stay quantized.
LAYER_LINEARS = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}
QUANTIZATION_FORMAT = "infer-quantized-v1"
# llama.cpp derives it from the rope scaling config: it goes back into config.json instead.
ROPE_FREQS = "rope_freqs.weight"


def convert_gguf(path: Path, out: Path, *, progress: bool) -> None:
    """Write the HF-format folder for the GGUF model at ``path`` into the empty folder ``out``."""
    reader = _open(path)
    meta = _metadata(path, reader)
    bar = tqdm(reader.tensors, desc=f"converting {path.name}", unit="tensor", disable=not progress)
    weights = {tensor.name: _dequantize(path, tensor) for tensor in bar}
    rope_freqs = weights.pop(ROPE_FREQS, None)
    config = hf_config(meta, {name: w.shape for name, w in weights.items()}, rope_freqs)
    tensors = {}
    for name, weight in weights.items():
        hf_name = hf_tensor_name(meta, name)
        tensors[hf_name] = to_hf_layout(meta.arch, hf_name, weight, config)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    _save_quantized(meta, reader.tensors, config, out)
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", generation_config(meta))
    if "tokenizer.ggml.model" in meta.values:
        _save_tokenizer(path, out)


def _open(path: Path) -> GGUFReader:
    try:
        return GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError) as e:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({e})") from e


def _metadata(path: Path, reader: GGUFReader) -> GGUFMetadata:
    values = {key: _decode(field) for key, field in reader.fields.items() if key not in BULKY_KEYS}
    arch = values.get("general.architecture")
    if arch not in HF_FAMILIES:
        supported = ", ".join(sorted(HF_FAMILIES))
        raise ModelLoadError(f"{path}: unsupported GGUF architecture {arch!r} ({supported} are)")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    return GGUFMetadata(path, values, tokens.contents() if tokens else [])


def _decode(field: ReaderField) -> Any:
    value = field.contents()
    if field.types == [GGUFValueType.FLOAT32]:
        # Shortest float32 spelling, as in the published configs: 1e-05, not 9.999999747378752e-06.
        return float(str(np.float32(value)))
    return value


def _dequantize(path: Path, tensor: ReaderTensor) -> np.ndarray:
    try:
        weight = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as e:
        raise ModelLoadError(
            f"{path}: tensor {tensor.name} has type {tensor.tensor_type.name}, "
            "which the gguf package cannot dequantize"
        ) from e
    shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists the innermost dim first
    if weight.shape != shape:
        raise ModelLoadError(f"{path}: tensor {tensor.name} is {weight.shape}, expected {shape}")
    return weight.astype(np.float32, copy=False)


def _save_quantized(
    meta: GGUFMetadata, tensors: list[ReaderTensor], config: dict[str, Any], out: Path
) -> None:
    """Write quantized.safetensors and quantization.json, if any linear has a decodable type.

    A model with none (F16, or only other quantizations) gets neither file: it is dense.
    """
    arrays: dict[str, np.ndarray] = {}
    entries: dict[str, dict[str, Any]] = {}
    for hf_name, tensor in _linears(meta, tensors):
        decode = DECODERS.get(tensor.tensor_type)
        if decode is None:
            continue
        quantized = _to_hf_layout(meta.arch, hf_name, decode(tensor.data), config)
        base = hf_name.removesuffix(".weight")
        arrays[f"{base}.qweight"] = quantized.qweight
        arrays[f"{base}.scales"] = quantized.scales
        if quantized.mins is not None:
            arrays[f"{base}.mins"] = quantized.mins
        entries[base] = {
            "bits": quantized.bits,
            "group_size": quantized.group_size,
            "gguf_type": tensor.tensor_type.name,
        }
    if not entries:
        return
    save_file(arrays, str(out / "quantized.safetensors"), metadata={"format": QUANTIZATION_FORMAT})
    manifest = {"format": QUANTIZATION_FORMAT, "source": "gguf", "tensors": entries}
    _write_json(out / "quantization.json", manifest)


def _linears(meta: GGUFMetadata, tensors: list[ReaderTensor]) -> list[tuple[str, ReaderTensor]]:
    """(HF name, tensor) of every linear weight; a tied token_embd is also ``lm_head``."""
    names = {tensor.name for tensor in tensors}
    linears = []
    for tensor in tensors:
        base, _, suffix = tensor.name.rpartition(".")
        layer_linear = base.startswith("blk.") and base.rsplit(".", 1)[-1] in LAYER_LINEARS
        if suffix == "weight" and (layer_linear or base == "output"):
            linears.append((hf_tensor_name(meta, tensor.name), tensor))
        elif tensor.name == "token_embd.weight" and "output.weight" not in names:
            linears.append(("lm_head.weight", tensor))
    return linears


def _to_hf_layout(
    arch: str, name: str, quantized: QuantizedLinear, config: dict[str, Any]
) -> QuantizedLinear:
    """The dense layout fix on each per-row array: rows are quantized independently."""
    return quantized._replace(
        qweight=to_hf_layout(arch, name, quantized.qweight, config),
        scales=to_hf_layout(arch, name, quantized.scales, config),
        mins=None if quantized.mins is None else to_hf_layout(arch, name, quantized.mins, config),
    )


def hf_tensor_name(meta: GGUFMetadata, gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    base, _, suffix = gguf_name.rpartition(".")
    parts = base.split(".")
    layer_names = LAYER_NAMES_BY_ARCH[meta.arch]
    if base in TOP_LEVEL_NAMES:
        return f"{TOP_LEVEL_NAMES[base]}.{suffix}"
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{suffix}"
    raise ModelLoadError(f"{meta.path}: unexpected tensor {gguf_name} for a {meta.arch} model")


def to_hf_layout(arch: str, name: str, weight: np.ndarray, config: dict[str, Any]) -> np.ndarray:
    """Undo llama.cpp's changes: permuted llama q/k rows, Gemma norms stored as 1 + w."""
    if arch == "llama" and name.endswith("self_attn.q_proj.weight"):
        return unpermute(weight, config["num_attention_heads"])
    if arch == "llama" and name.endswith("self_attn.k_proj.weight"):
        return unpermute(weight, config["num_key_value_heads"])
    if arch == "gemma3" and name.endswith("norm.weight"):
        return weight - 1
    return weight


def unpermute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """[rows, cols] with each head's rotary halves interleaved (llama.cpp) -> split (HF)."""
    rows, cols = weight.shape
    halves = weight.reshape(n_heads, rows // n_heads // 2, 2, cols)
    return halves.swapaxes(1, 2).reshape(rows, cols)


def _save_tokenizer(path: Path, out: Path) -> None:
    with tempfile.TemporaryDirectory() as alone:
        # transformers also reads tokenizer files lying beside the GGUF: show it none.
        (Path(alone) / path.name).symlink_to(path.resolve())
        try:
            tokenizer = AutoTokenizer.from_pretrained(alone, gguf_file=path.name)
        except (ValueError, OSError, KeyError) as e:
            raise ModelLoadError(f"{path}: cannot build a tokenizer from its metadata ({e})") from e
    tokenizer.save_pretrained(str(out))


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")
