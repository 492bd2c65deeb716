"""The portable quantized-linear kernels (``quant_linear``, ``quant_dequantize``) against a
pure-torch dequantizer written from the format's spec (infer-quantized-v1): int8, 4-bit
packed (GGUF Q4_0's nibble order) or 6-bit (96 bytes per 128 k's, quant_six.h) weights,
float16 scales and optional mins per group."""

import pytest
import torch
from torch import Tensor

from adapters.torch.cpu.portable import portable_kernels

portable = portable_kernels()
pytestmark = pytest.mark.skipif(portable is None, reason="no C++ toolchain")
DENSE_NEVER = 1 << 30  # dense_from_rows no batch reaches: always the integer path


def reference_dequantize(
    qweight: Tensor, scales: Tensor, mins: Tensor | None, bits: int, group: int
) -> Tensor:
    """W[n, k] = q[n, k] * scales[n, k // g] (+ mins[n, k // g]), float32, from the spec."""
    if bits == 4:  # chunk c of 32 k's: byte j's low nibble is k = 32c + j, high is 32c + 16 + j
        n = qweight.shape[0]
        chunks = qweight.view(n, -1, 16).to(torch.int32)
        q = torch.cat([chunks & 0x0F, chunks >> 4], dim=2).reshape(n, -1)
    elif bits == 6:
        q = six_bit_values(qweight) - 32
    else:
        q = qweight.to(torch.int32)
    w = q.float() * scales.float().repeat_interleave(group, dim=1)
    if mins is not None:
        w = w + mins.float().repeat_interleave(group, dim=1)
    return w


def six_bit_values(qweight: Tensor) -> Tensor:
    """The 6-bit format's values u (0..63), element by element from its spec: in run r of
    128 k's (96 bytes), k = 128 r + 32 j + i takes its low bits from byte 16 j + i % 16
    (low nibble for i < 16, high for i >= 16) and its top two from bits 2 j of byte
    64 + 16 (i // 16) + i % 16."""
    n, cols = qweight.shape
    k = cols // 96 * 128
    out = torch.empty(n, k, dtype=torch.int32)
    q = qweight.to(torch.int32)
    for e in range(k):
        r, j, i = e // 128, (e % 128) // 32, e % 32
        byte = q[:, 96 * r + 16 * j + i % 16]
        low = byte & 0x0F if i < 16 else byte >> 4
        top = (q[:, 96 * r + 64 + 16 * (i // 16) + i % 16] >> (2 * j)) & 0x03
        out[:, e] = low | (top << 4)
    return out


def random_weight(
    n: int, k: int, bits: int, group: int, with_mins: bool, seed: int = 0
) -> tuple[Tensor, Tensor, Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    if bits == 4:
        qweight = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    elif bits == 6:
        qweight = torch.randint(0, 256, (n, k * 3 // 4), generator=gen, dtype=torch.uint8)
    else:
        low = -128 if with_mins else -127
        qweight = torch.randint(low, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = (torch.rand(n, k // group, generator=gen) * 0.02 + 0.001).half()
    mins = (torch.randn(n, k // group, generator=gen) * 0.05).half() if with_mins else None
    return qweight, scales, mins


# (bits, group_size or 0 for per-channel, mins)
FORMATS = [
    pytest.param(4, 32, True, id="int4-g32-mins"),
    pytest.param(4, 64, True, id="int4-g64-mins"),
    pytest.param(4, 128, True, id="int4-g128-mins"),
    pytest.param(4, 32, False, id="int4-g32"),
    pytest.param(8, 0, False, id="int8-per-channel"),
    pytest.param(8, 16, False, id="int8-g16"),
    pytest.param(8, 32, True, id="int8-g32-mins"),
    pytest.param(6, 16, False, id="int6-g16"),
    pytest.param(6, 16, True, id="int6-g16-mins"),
]
N, K = 37, 256  # N not a multiple of the kernel's 4-row tiles


@pytest.mark.parametrize(("bits", "group", "with_mins"), FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_equals_the_spec_exactly(
    bits: int, group: int, with_mins: bool, dtype: torch.dtype
) -> None:
    group = group or K
    qweight, scales, mins = random_weight(N, K, bits, group, with_mins)
    got = portable.quant_dequantize(qweight, scales, mins, bits, group, dtype)
    assert got.dtype == dtype and got.shape == (N, K)
    assert torch.equal(got, reference_dequantize(qweight, scales, mins, bits, group).to(dtype))


def relative_error(got: Tensor, want: Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def quantized_activations(x: Tensor, qmax: int) -> Tensor:
    """x as the integer path sees it: per block of 32, round(x / dx) * dx with
    dx = max|x| / qmax (127: int8, llama.cpp's Q8_0; 32767: int16)."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    dx = blocks.abs().amax(dim=-1, keepdim=True) / qmax
    q = torch.where(dx > 0, torch.round(blocks / dx), torch.zeros_like(blocks))
    return (q * dx).reshape(x.shape)


# bits -> (activations' qmax, relative error the rounding of x leaves against x @ W.T):
# int8 x against 4-bit weights moves the output by ~0.5 % of its norm (up to ~1.5 % on a
# draw); int16 x against int8 weights by ~250x less
INTEGER_ACTIVATIONS = {4: (127, 3e-2), 6: (127, 3e-2), 8: (32767, 1e-4)}


def random_product(
    bits: int, group: int, with_mins: bool, rows: int, dense_from_rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quant_linear`` of a random x (``rows`` × K) and a random weight in the format (group
    0: one group of K), both seeded by ``rows``: (the output, checked to be ``rows`` × N
    float32; x; the weight dequantized by the reference)."""
    group = group or K
    qweight, scales, mins = random_weight(N, K, bits, group, with_mins, seed=rows)
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
    w = reference_dequantize(qweight, scales, mins, bits, group)
    got = portable.quant_linear(x, qweight, scales, mins, bits, group, dense_from_rows)
    assert got.shape == (rows, N) and got.dtype == torch.float32
    return got, x, w


@pytest.mark.parametrize(("bits", "group", "with_mins"), FORMATS)
@pytest.mark.parametrize("rows", [1, 3, 8, 33])
def test_the_integer_path_matches_the_dense_product(
    bits: int, group: int, with_mins: bool, rows: int
) -> None:
    got, x, w = random_product(bits, group, with_mins, rows, DENSE_NEVER)
    qmax, tolerance = INTEGER_ACTIVATIONS[bits]
    # the same product up to float32 rounding once x is rounded per block like the kernel
    assert relative_error(got, quantized_activations(x, qmax) @ w.T) < 1e-5
    assert relative_error(got, x @ w.T) < tolerance


@pytest.mark.parametrize("k", [32, 64, 96, 128, 160, 224, 352, 512, 576, 608, 672])
@pytest.mark.parametrize("with_mins", [True, False])
@pytest.mark.parametrize("group", [32, 64])  # 32: scales read per row; 64: the tile path
def test_one_row_of_4_bit_weights_two_blocks_a_step(k: int, with_mins: bool, group: int) -> None:
    """One activation row takes 4-bit blocks in pairs, 8 a loop (with AVX-512 in quads first,
    16 a loop): K of 1 to 21 blocks run every branch (the loops, the quad, the pair and the
    odd last block after them)."""
    if k % group:
        pytest.skip("K is not a multiple of the group")
    qweight, scales, mins = random_weight(9, k, 4, group, with_mins, seed=k)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(k))
    w = reference_dequantize(qweight, scales, mins, 4, group)
    got = portable.quant_linear(x, qweight, scales, mins, 4, group, DENSE_NEVER)
    assert relative_error(got, quantized_activations(x, 127) @ w.T) < 1e-5
    two = portable.quant_linear(x.repeat(2, 1), qweight, scales, mins, 4, group, DENSE_NEVER)
    assert relative_error(got[0], two[0]) < 1e-6  # the unpacked path of several rows agrees


@pytest.mark.parametrize("k", [32, 96, 160, 288, 576, 608])
@pytest.mark.parametrize("with_mins", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("bits", "group"), [(4, 32), (8, 32), (8, 0)], ids=["int4", "int8-g32", "int8-channel"]
)
def test_a_row_of_a_batch_equals_the_row_alone(
    k: int, with_mins: bool, dtype: torch.dtype, bits: int, group: int
) -> None:
    """Several activation rows share the weights (4-bit: each load, four rows at a time;
    int8: a tile in L1) but every row goes through the same operations as one row alone:
    1 to 9 rows (full and partial groups of rows) give the one-row results bit for bit, so a
    request's output does not depend on what is batched with it."""
    group = group or k
    qweight, scales, mins = random_weight(13, k, bits, group, with_mins, seed=k)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(k)).to(dtype)

    def run(rows: Tensor) -> Tensor:
        return portable.quant_linear(rows, qweight, scales, mins, bits, group, DENSE_NEVER)

    alone = torch.cat([run(x[i : i + 1]) for i in range(9)])
    for rows in range(2, 10):
        assert torch.equal(run(x[:rows]), alone[:rows]), rows
    w = reference_dequantize(qweight, scales, mins, bits, group)
    qmax, _ = INTEGER_ACTIVATIONS[bits]
    want = quantized_activations(x.float(), qmax) @ w.T
    assert relative_error(alone.float(), want) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("k", [128, 256, 640, 2048])
@pytest.mark.parametrize("with_mins", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_of_6_bit_weights_is_the_same_among_1_to_9_rows(
    k: int, with_mins: bool, dtype: torch.dtype
) -> None:
    """6-bit weights (GGUF Q6_K's values): 1 to 9 rows give the one-row results bit for bit,
    and the one-row results are the spec's product with x rounded as the kernel rounds it
    (int8 per block of 32, llama.cpp's Q8 against its Q6_K)."""
    qweight, scales, mins = random_weight(13, k, 6, 16, with_mins, seed=k)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(k)).to(dtype)

    def run(rows: Tensor) -> Tensor:
        return portable.quant_linear(rows, qweight, scales, mins, 6, 16, DENSE_NEVER)

    alone = torch.cat([run(x[i : i + 1]) for i in range(9)])
    for rows in range(2, 10):
        assert torch.equal(run(x[:rows]), alone[:rows]), rows
    w = reference_dequantize(qweight, scales, mins, 6, 16)
    want = quantized_activations(x.float(), 127) @ w.T
    assert relative_error(alone.float(), want) < (1e-5 if dtype == torch.float32 else 1e-2)


def random_super_blocks(
    n: int, k: int, bits: int, seed: int
) -> tuple[Tensor, Tensor, Tensor | None]:
    """GGUF Q4_K / Q6_K kept whole: per 256 k's the values and the sub-block scales as bytes
    (144 / 208), d (and -dmin) one float16 per super-block."""
    gen = torch.Generator().manual_seed(seed)
    per = 144 if bits == 4 else 208
    q = torch.randint(0, 256, (n, k // 256, per), generator=gen, dtype=torch.uint8)
    if bits == 4:
        q[..., 128:] &= 0x3F  # 6-bit scales and mins
    scales = (torch.rand(n, k // 256, generator=gen) * 2e-3 + 1e-4).half()
    mins = -(torch.rand(n, k // 256, generator=gen) * 2e-3).half() if bits == 4 else None
    return q.reshape(n, -1), scales, mins


def super_reference(qweight: Tensor, scales: Tensor, mins: Tensor | None, bits: int) -> Tensor:
    """The spec: Q4_K's W = q * (d * sc) + (-dmin) * m per 32 k's, Q6_K's (u - 32) * (d * sc)
    per 16, d * sc in float32."""
    n, s = scales.shape
    blocks = qweight.reshape(n, s, -1)
    d = scales.float()[..., None]
    if bits == 4:
        chunks = blocks[..., :128].reshape(n, s, 8, 16).to(torch.int32)
        q = torch.cat([chunks & 0x0F, chunks >> 4], dim=-1).float()
        sc = (d * blocks[..., 128:136].float())[..., None]
        assert mins is not None
        m = (mins.float()[..., None] * blocks[..., 136:144].float())[..., None]
        return (q * sc + m).reshape(n, -1)
    u = six_bit_values(blocks[..., :192].reshape(n, s * 192)).reshape(n, s, 16, 16)
    sc = (d * blocks[..., 192:].contiguous().view(torch.int8).float())[..., None]
    return ((u - 32).float() * sc).reshape(n, -1)


@pytest.mark.parametrize("bits", [4, 6], ids=["q4_k", "q6_k"])
@pytest.mark.parametrize("k", [256, 768, 2048])
def test_k_quant_super_blocks_are_the_spec_and_rows_are_independent(bits: int, k: int) -> None:
    """Super-blocks dequantize to the spec's floats bit for bit (float32, and bfloat16 as
    float32 rounded); the integer path gives the spec's product with x rounded as the kernel
    rounds it, each of 1-9 rows bit for bit as alone; the dense path the float product."""
    qweight, scales, mins = random_super_blocks(11, k, bits, seed=k + bits)
    w = super_reference(qweight, scales, mins, bits)
    got = portable.quant_dequantize(qweight, scales, mins, bits, 256, torch.float32)
    assert torch.equal(got, w)
    got16 = portable.quant_dequantize(qweight, scales, mins, bits, 256, torch.bfloat16)
    assert torch.equal(got16, w.bfloat16())
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(k))

    def run(rows: Tensor, switch: int = DENSE_NEVER) -> Tensor:
        return portable.quant_linear(rows, qweight, scales, mins, bits, 256, switch)

    alone = torch.cat([run(x[i : i + 1]) for i in range(9)])
    for rows in range(2, 10):
        assert torch.equal(run(x[:rows]), alone[:rows]), rows
    assert relative_error(alone, quantized_activations(x, 127) @ w.T) < 1e-5
    assert relative_error(run(x, 1), x @ w.T) < 1e-5


def test_6_bit_weights_read_the_same_values_as_their_int8_widening() -> None:
    """A Q6_K weight narrowed from int8 (what the loader does) dequantizes to the same floats
    and multiplies like the spec; its bytes are 3/4 of int8's."""
    from adapters.torch.quant_format import QuantizedWeight, narrow_to_6bit

    gen = torch.Generator().manual_seed(3)
    q8 = torch.randint(-32, 32, (24, 512), generator=gen, dtype=torch.int8)
    scales = (torch.rand(24, 32, generator=gen) * 0.02).half()
    wide = QuantizedWeight(q8, scales, None, 8, 16)
    narrow = narrow_to_6bit(wide)
    assert narrow.bits == 6 and narrow.qweight.shape == (24, 384)
    dense = portable.quant_dequantize(q8, scales, None, 8, 16, torch.float32)
    six = portable.quant_dequantize(narrow.qweight, scales, None, 6, 16, torch.float32)
    assert torch.equal(six, dense)
    assert torch.equal(reference_dequantize(narrow.qweight, scales, None, 6, 16), dense)


def test_int8_weights_take_int16_activations() -> None:
    """Blocks of one large value and small ones: int8 x (dx = 1 / 127) would round the small
    ones to zero, 3 % of the output; int16 x (dx = 1 / 32767) keeps them to ~1e-5."""
    qweight = torch.ones(4, K, dtype=torch.int8)
    scales = torch.ones(4, K // 32, dtype=torch.float16)
    x = torch.full((1, K), 2.0**-10)
    x[0, ::32] = 1.0  # each block's max
    got = portable.quant_linear(x, qweight, scales, None, 8, 32, DENSE_NEVER)
    assert relative_error(got, x @ torch.ones(4, K).T) < 1e-4


@pytest.mark.parametrize(("bits", "group", "with_mins"), FORMATS)
@pytest.mark.parametrize("rows", [1, 3, 8, 33])
def test_the_dense_path_matches_the_dense_product(
    bits: int, group: int, with_mins: bool, rows: int
) -> None:
    got, x, w = random_product(bits, group, with_mins, rows, 1)
    torch.testing.assert_close(got, x @ w.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dense_from_rows", [1, DENSE_NEVER], ids=["dense", "integer"])
@pytest.mark.parametrize(("bits", "group", "with_mins"), [FORMATS[0], FORMATS[5]])
def test_bfloat16_input_gives_bfloat16_output(
    bits: int, group: int, with_mins: bool, dense_from_rows: int
) -> None:
    qweight, scales, mins = random_weight(N, K, bits, group, with_mins)
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(5))
    want = x @ reference_dequantize(qweight, scales, mins, bits, group).T
    got = portable.quant_linear(x.bfloat16(), qweight, scales, mins, bits, group, dense_from_rows)
    assert got.dtype == torch.bfloat16 and got.shape == (5, N)
    assert relative_error(got, want) < 3e-2  # bfloat16 x and output: ~0.4 % each


def test_non_contiguous_input_and_a_large_layer() -> None:
    """A transposed x; N and K large enough for several threads' chunks and tiles."""
    n, k = 1030, 1536
    qweight, scales, mins = random_weight(n, k, 4, 32, True, seed=7)
    x = torch.randn(k, 6, generator=torch.Generator().manual_seed(7)).T
    want = x @ reference_dequantize(qweight, scales, mins, 4, 32).T
    for dense_from_rows in (1, DENSE_NEVER):
        got = portable.quant_linear(x, qweight, scales, mins, 4, 32, dense_from_rows)
        assert relative_error(got, want) < (1e-5 if dense_from_rows == 1 else 3e-2)


@pytest.mark.parametrize("mode", ["inference_mode", "requires_grad"])
def test_both_paths_work_in_inference_mode_and_with_grad_inputs(mode: str) -> None:
    """The dense path's worker threads run ATen ops on the caller's tensors: they must work
    whatever autograd state the caller (not the workers) is in."""
    n, k = 1030, 256  # several tiles: several threads where there are
    qweight, scales, mins = random_weight(n, k, 4, 32, True)
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(4))
    want = x @ reference_dequantize(qweight, scales, mins, 4, 32).T
    for dense_from_rows in (1, DENSE_NEVER):
        if mode == "inference_mode":
            with torch.inference_mode():
                got = portable.quant_linear(x, qweight, scales, mins, 4, 32, dense_from_rows)
        else:
            xg = x.clone().requires_grad_()
            got = portable.quant_linear(xg, qweight, scales, mins, 4, 32, dense_from_rows)
        assert relative_error(got, want) < (1e-5 if dense_from_rows == 1 else 3e-2)


def test_no_rows_gives_an_empty_output() -> None:
    qweight, scales, _ = random_weight(N, K, 8, K, False)
    got = portable.quant_linear(torch.zeros(0, K), qweight, scales, None, 8, K, DENSE_NEVER)
    assert got.shape == (0, N)


def bad_arguments() -> list:
    q8, s8, _ = random_weight(N, K, 8, 32, False)
    q4, s4, m4 = random_weight(N, K, 4, 32, True)
    q6, _, _ = random_weight(N, K, 6, 16, False)
    s6 = s8  # one scale per 32: not the 6-bit format's 16
    x = torch.randn(2, K)
    return [
        pytest.param((x, q8, s8, None, 5, 32), "bits must be 4, 6 or 8", id="bits"),
        pytest.param((x, q4, s4, None, 6, 32), "whole 96-byte quads", id="q6-bytes"),
        pytest.param((x, q6, s6, None, 6, 32), "group_size must be 16", id="q6-group"),
        pytest.param((x, q8.view(torch.uint8), s8, None, 8, 32), "must be int8", id="q8-dtype"),
        pytest.param((x, q4.view(torch.int8), s4, m4, 4, 32), "must be uint8", id="q4-dtype"),
        pytest.param((x[:, :128], q8, s8, None, 8, 32), "x has 128 features", id="k-mismatch"),
        pytest.param((x, q8, s8.float(), None, 8, 32), "scales must be float16", id="scale-dt"),
        pytest.param((x, q8, s8[:, :4], None, 8, 32), "scales must be [N, K/group", id="scales"),
        pytest.param((x, q4, s4, m4[:-1], 4, 32), "mins must be [N, K/group", id="mins"),
        pytest.param((x, q4, s4, m4.float(), 4, 32), "mins must be float16", id="mins-dt"),
        pytest.param((x, q8, s8, None, 8, 48), "must divide K", id="group-divides"),
        pytest.param((x, q8, s8, None, 8, 8), "multiple of 16", id="group8"),
        pytest.param((x, q4, s4, m4, 4, 16), "multiple of 32", id="group16-int4"),
        pytest.param((x.double(), q8, s8, None, 8, 32), "float32 or bfloat16", id="x-dtype"),
        pytest.param((x[0], q8, s8, None, 8, 32), "must be 2-D", id="x-dim"),
    ]


@pytest.mark.parametrize(("args", "message"), bad_arguments())
def test_bad_arguments_raise_a_clear_error(args: tuple, message: str) -> None:
    with pytest.raises(RuntimeError, match=message.replace("[", r"\[")):
        portable.quant_linear(*args, DENSE_NEVER)


def test_k_must_be_a_multiple_of_32() -> None:
    k = 48  # a multiple of 16: a valid int8 group size, but not of the 32-block
    qweight = torch.zeros(4, k, dtype=torch.int8)
    scales = torch.ones(4, k // 16, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        portable.quant_linear(torch.randn(1, k), qweight, scales, None, 8, 16, DENSE_NEVER)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        portable.quant_dequantize(qweight, scales, None, 8, 16, torch.float32)
