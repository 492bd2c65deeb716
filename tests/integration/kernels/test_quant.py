"""Weight-only quantization (adapters/torch/quant.py): the format, the quantizers, fused
concatenation, QuantLinear on both paths, and models loaded quantized."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from adapters.torch.loading.loader import load_model
from adapters.torch.quant import (
    QuantLinear,
    keep_dense_head,
    keep_panels,
    prompt_rows,
    quantize_model,
)
from adapters.torch.quant_format import (
    QuantizedWeight,
    concat_rows,
    dequantize,
    narrow_to_6bit,
    pack_int4,
    pack_int6,
    plain_blocks,
    quantize_int4,
    quantize_int8,
    unpack_int4,
    unpack_int6,
)
from adapters.weights.dummy import resolve_dummy
from domain.errors import ModelLoadError


def _smollm2_config(tmp_path: Path) -> Path:
    return resolve_dummy("SmolLM2-135M", tmp_path).path


def _weight(n: int = 48, k: int = 128, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


def test_int4_packing_is_ggufs_q4_layout() -> None:
    q = torch.arange(64, dtype=torch.uint8).remainder(16).reshape(1, 64)
    packed = pack_int4(q)
    assert packed.shape == (1, 32)
    # byte j of a 32-run: element j low, element j + 16 high
    assert packed[0, 0].item() == q[0, 0].item() | (q[0, 16].item() << 4)
    assert packed[0, 17].item() == q[0, 33].item() | (q[0, 49].item() << 4)
    assert torch.equal(unpack_int4(packed), q)


def test_int6_packing_keeps_low_nibbles_as_q4_and_top_bits_by_block() -> None:
    gen = torch.Generator().manual_seed(6)
    u = torch.randint(0, 64, (3, 256), generator=gen, dtype=torch.uint8)
    packed = pack_int6(u)
    assert packed.shape == (3, 192)
    # the first 64 bytes of each 96-byte run are the run's low nibbles in the 4-bit layout
    assert torch.equal(packed[:, :64], pack_int4(u[:, :128] & 15))
    assert torch.equal(packed[:, 96:160], pack_int4(u[:, 128:] & 15))
    # byte 64 + i: block j's k i top bits at 2j; byte 80 + i: its k 16 + i
    assert packed[0, 64 + 5].item() == sum(int(u[0, 32 * j + 5] >> 4) << (2 * j) for j in range(4))
    assert packed[1, 80 + 3].item() == sum(int(u[1, 32 * j + 19] >> 4) << (2 * j) for j in range(4))
    assert torch.equal(unpack_int6(packed), u)


def test_only_int8_within_6_bits_narrows_to_6_bits() -> None:
    gen = torch.Generator().manual_seed(1)
    scales = torch.rand(4, 16, generator=gen).half()
    values = torch.randint(-32, 32, (4, 256), generator=gen, dtype=torch.int8)
    q6k = QuantizedWeight(values, scales, None, 8, 16)
    narrow = narrow_to_6bit(q6k)
    narrow.check()
    assert narrow.bits == 6 and narrow.nbytes < q6k.nbytes
    assert torch.equal(dequantize(narrow), dequantize(q6k))
    wide_values = QuantizedWeight(q6k.qweight * 2, scales, None, 8, 16)  # -64..62: not 6 bits
    assert narrow_to_6bit(wide_values) is wide_values
    q8_0 = quantize_int8(_weight(4, 256), 32)  # values to +-127: Q8_0, stays int8
    assert narrow_to_6bit(q8_0) is q8_0
    q5_0 = QuantizedWeight(q6k.qweight // 2, scales[:, ::2].contiguous(), None, 8, 32)
    five = narrow_to_6bit(q5_0)  # -16..15 in groups of 32: 6 bits, each scale twice
    assert five.bits == 6 and five.group_size == 16
    assert torch.equal(dequantize(five), dequantize(q5_0))


def test_int8_per_channel_error_within_half_a_step() -> None:
    w = _weight()
    qw = quantize_int8(w)
    assert qw.scales.shape == (48, 1) and qw.mins is None and qw.group_size == 128
    step = qw.scales.float()
    assert ((dequantize(qw) - w).abs() <= step / 2 + 1e-3 * step).all()
    assert qw.qweight.abs().max().item() == 127


def test_int4_error_within_half_a_step_and_groups() -> None:
    w = _weight()
    qw = quantize_int4(w, 32)
    assert qw.scales.shape == (48, 4) and qw.mins is not None
    assert qw.qweight.shape == (48, 64)
    step = qw.scales.float().repeat_interleave(32, dim=1)
    assert ((dequantize(qw) - w).abs() <= step / 2 + 2e-3 * step.max()).all()
    assert qw.nbytes == 48 * 64 + 2 * 48 * 4 * 2


def test_zero_groups_quantize_to_zero() -> None:
    w = torch.zeros(4, 64)
    for qw in (quantize_int8(w), quantize_int4(w)):
        assert torch.equal(dequantize(qw), w)


@pytest.mark.parametrize(
    "parts",
    [
        ("int4", "int4"),
        ("int4", "int8"),
        ("int8/16", "int8"),
        ("int8", "int8/16", "int4"),
        ("int4", "int4", "int6"),  # Q4_K q and k, Q6_K v: a 6-bit wqkv with mins
        ("int6", "int4"),
        ("int6", "int8/16"),
    ],
)
def test_concat_rows_is_exact_across_formats(parts: tuple[str, ...]) -> None:
    makers = {
        "int4": lambda w: quantize_int4(w, 32),
        "int8": lambda w: quantize_int8(w, 32),
        "int8/16": lambda w: quantize_int8(w, 16),
        "int6": lambda w: narrow_to_6bit(_six_bit(w)),
    }
    weights = [makers[p](_weight(16, 128, i)) for i, p in enumerate(parts)]
    fused = concat_rows(weights)
    fused.check()
    want = torch.cat([dequantize(w) for w in weights])
    if "int6" in parts and "int8/16" not in parts:  # 4 bits widen exactly to 6
        assert fused.bits == 6 and fused.group_size == 16
    if "int4" in parts and "int8/16" in parts:  # mins on 16-groups: requantized to int8/32
        assert fused.bits == 8 and fused.group_size == 32
        assert (dequantize(fused) - want).abs().max() < 0.05
    else:
        assert torch.equal(dequantize(fused), want)


def _super_blocks(n: int, k: int, bits: int, seed: int) -> QuantizedWeight:
    """A GGUF K-quant kept whole (random bytes; 6-bit sub-block scales for Q4_K)."""
    gen = torch.Generator().manual_seed(seed)
    per = 144 if bits == 4 else 208
    q = torch.randint(0, 256, (n, k // 256, per), generator=gen, dtype=torch.uint8)
    if bits == 4:
        q[..., 128:] &= 0x3F
    scales = (torch.rand(n, k // 256, generator=gen) * 1e-2).half()
    mins = -(torch.rand(n, k // 256, generator=gen) * 1e-2).half() if bits == 4 else None
    return QuantizedWeight(q.reshape(n, -1), scales, mins, bits, 256)


def test_super_blocks_stack_whole_and_mix_through_the_block_formats() -> None:
    q4k, other, q6k = (_super_blocks(8, 512, b, i) for i, b in enumerate((4, 4, 6)))
    for w in (q4k, q6k):
        w.check()
        assert w.super_blocks and w.shape == (8, 512)
    gate_up = concat_rows([q4k, other])  # Q4_K and Q4_K: the rows as they are
    assert gate_up.super_blocks and torch.equal(
        dequantize(gate_up), torch.cat([dequantize(q4k), dequantize(other)])
    )
    qkv = concat_rows([q4k, other, q6k])  # Q4_K q, k and Q6_K v: 6 bits, scales per 16
    qkv.check()
    assert (qkv.bits, qkv.group_size, qkv.super_blocks) == (6, 16, False)
    want = torch.cat([dequantize(w) for w in (q4k, other, q6k)])
    # the block formats' float16 scales round d * sc: within float16's step
    assert (dequantize(qkv) - want).abs().max() <= 2e-3 * want.abs().max()
    wide = plain_blocks(q6k)
    assert (wide.bits, wide.group_size) == (8, 16)
    assert (dequantize(wide) - dequantize(q6k)).abs().max() <= 2e-3 * dequantize(q6k).abs().max()


def _six_bit(w: torch.Tensor) -> QuantizedWeight:
    """``w`` as Q6_K holds it: int8 values -32..31, one scale per 16."""
    n, k = w.shape
    groups = w.reshape(n, k // 16, 16)
    scales = (groups.abs().amax(-1) / 31).half()
    q = torch.round(groups / scales.float()[..., None]).clamp(-32, 31).to(torch.int8)
    return QuantizedWeight(q.reshape(n, k), scales, None, 8, 16)


def test_check_rejects_a_bad_format() -> None:
    w = quantize_int4(_weight())
    with pytest.raises(ValueError, match="group size"):
        QuantizedWeight(w.qweight, w.scales, w.mins, 4, 48).check()
    with pytest.raises(ValueError, match="float16"):
        QuantizedWeight(w.qweight, w.scales.float(), w.mins, 4, 32).check()
    with pytest.raises(ValueError, match="qweight"):
        QuantizedWeight(w.qweight.to(torch.int8), w.scales, w.mins, 4, 32).check()
    six = narrow_to_6bit(_six_bit(_weight(8, 256)))
    with pytest.raises(ValueError, match="6-bit rows"):
        QuantizedWeight(six.qweight, six.scales[:, ::2].contiguous(), None, 6, 32).check()


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("kernel", [True, False])
def test_quant_linear_matches_the_dequantized_weight(method: str, kernel: bool) -> None:
    w = _weight(96, 256)
    qw = quantize_int8(w) if method == "int8" else quantize_int4(w)
    layer = QuantLinear(qw, bias=torch.ones(96))
    if not kernel:
        layer.kernel = None
    elif layer.kernel is None:
        pytest.skip("the portable CPU kernels are not built on this machine")
    want_w = dequantize(qw)
    for rows in (1, 5, 40):  # int8 dot products and dequantized tiles
        x = torch.randn(2, rows, 256)
        want = F.linear(x, want_w) + 1
        got = layer(x)
        assert got.shape == (2, rows, 96)
        rel = (got - want).norm() / want.norm()
        assert rel < (1e-2 if kernel else 1e-5), (rows, rel)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_model_quantized_stays_close_to_dense(method: str, tmp_path: Path) -> None:
    folder = _smollm2_config(tmp_path)
    dense = load_model(folder, dtype=torch.float32, random_weights=True, prepack=False)
    quant = load_model(folder, dtype=torch.float32, random_weights=True, quantization=method)
    linears = [m for m in quant.modules() if isinstance(m, QuantLinear)]
    assert len(linears) == 4 * len(quant.layers) + 1  # the LM head included
    ids = torch.tensor([[1, 5, 9, 300, 7, 42]])
    a, b = dense(ids)[0, -1], quant(ids)[0, -1]
    cos = F.cosine_similarity(a, b, dim=0).item()
    assert cos > (0.995 if method == "int8" else 0.9), cos  # random weights, 30 layers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_8bit_head_keeps_a_dense_copy_for_many_rows(dtype: torch.dtype, tmp_path: Path) -> None:
    folder = _smollm2_config(tmp_path)
    model = load_model(folder, dtype=dtype, random_weights=True, quantization="int4")
    head = model.lm_head
    assert isinstance(head, QuantLinear) and head.bits == 8  # the head is Q8_0 for int4 too
    if head.kernel is None:
        pytest.skip("the portable CPU kernels are not built on this machine")
    assert head.dense is not None and head.dense.dtype == dtype  # kept by load_model
    assert torch.equal(head.dense, dequantize(head.weight_q, dtype))
    x = torch.randn(head.dense_from_rows + 3, head.in_features).to(dtype)
    with_copy = head(x)
    one = head(x[:1])
    head.dense = None  # the kernel alone: integer rows, dequantized tiles for many
    without = head(x)
    assert torch.equal(one, head(x[:1]))  # one row: the integer path either way
    rel = (with_copy.float() - without.float()).norm() / without.float().norm()
    assert rel < (1e-5 if dtype == torch.float32 else 1e-2), rel  # same weights, other GEMM
    assert keep_dense_head(model, dtype) == head.out_features * head.in_features * dtype.itemsize


def test_no_dense_copy_for_a_4bit_head_or_past_the_cap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = _smollm2_config(tmp_path)
    model = load_model(folder, dtype=torch.float32, random_weights=True, prepack=False)
    weights = {"lm_head": quantize_int4(model.lm_head.weight.detach())}
    model.set_submodule("lm_head", QuantLinear(weights["lm_head"]))
    assert keep_dense_head(model, torch.float32) == 0 and model.lm_head.dense is None
    model.set_submodule("lm_head", QuantLinear(quantize_int8(dequantize(weights["lm_head"]), 32)))
    if model.lm_head.kernel is None:
        pytest.skip("the portable CPU kernels are not built on this machine")
    monkeypatch.setattr("adapters.torch.quant.DENSE_HEAD_MAX_BYTES", 1 << 10)
    assert keep_dense_head(model, torch.float32) == 0 and model.lm_head.dense is None


def test_gguf_quantization_needs_gguf_blocks(tmp_path: Path) -> None:
    folder = _smollm2_config(tmp_path)
    model = load_model(folder, dtype=torch.float32, random_weights=True, prepack=False)
    with pytest.raises(ModelLoadError, match="no GGUF quantized weights"):
        quantize_model(model, "gguf", folder=folder)
    with pytest.raises(ValueError, match="quantization must be one of"):
        quantize_model(model, "int3")


def _panel_kernels_or_skip() -> None:
    from adapters.torch.cpu.kernels import cpu_kernels

    if cpu_kernels() is None:
        pytest.skip("no AVX512-BF16 kernels (their panel GEMM) on this machine")


def test_bf16_panels_take_steps_of_many_rows_not_prompt_scoring(tmp_path: Path) -> None:
    _panel_kernels_or_skip()
    folder = _smollm2_config(tmp_path)
    model = load_model(folder, dtype=torch.bfloat16, random_weights=True, quantization="int4")
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    want = sum(m.out_features * m.in_features * 2 for m in linears)
    head = model.lm_head
    assert isinstance(head, QuantLinear) and head.dense is not None
    assert keep_panels(model, {4: 4, 8: 2}, want) == want
    assert all(m.panels is not None for m in linears)
    assert head.panels_from_rows == 2 and head.dense is None  # the panels take over the copy
    layer = linears[0]
    assert layer.bits == 4 and layer.panels_from_rows == 4
    x = torch.randn(6, layer.in_features, generator=torch.Generator().manual_seed(1)).bfloat16()
    dense = F.linear(x.float(), layer.dequantized(torch.float32))
    panels = layer(x)
    rel = (panels.float() - dense).norm() / dense.norm()
    assert rel < 1e-2, rel  # the same weights, in bf16
    below = layer(x[:3])  # below the switch: the quantized kernel, as without the panels
    kept, layer.panels = layer.panels, None
    assert torch.equal(below, layer(x[:3]))
    layer.panels = kept
    with prompt_rows():  # prompt scoring keeps the tiles, as the trainer's forward does
        scored = layer(x)
        panels_kept, layer.panels = layer.panels, None
        tiles = layer(x)
    assert torch.equal(scored, tiles) and not torch.equal(panels, tiles)
    layer.panels = panels_kept


def test_no_panels_past_the_memory_given_or_for_formats_not_chosen(tmp_path: Path) -> None:
    _panel_kernels_or_skip()
    folder = _smollm2_config(tmp_path)
    model = load_model(folder, dtype=torch.bfloat16, random_weights=True, quantization="int4")
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    want = sum(m.out_features * m.in_features * 2 for m in linears)
    assert keep_panels(model, {4: 4, 8: 2}, want - 1) == 0  # all or none
    assert all(m.panels is None for m in linears)
    assert model.lm_head.dense is not None  # the head keeps its copy
    only_8bit = keep_panels(model, {8: 2}, want)
    assert only_8bit == model.lm_head.out_features * model.lm_head.in_features * 2
    assert [m for m in linears if m.panels is not None] == [model.lm_head]
