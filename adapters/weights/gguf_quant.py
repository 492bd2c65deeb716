"""GGUF quantized blocks -> infer's quantized linear format, without dequantizing.

Every decoder takes a tensor's raw bytes, uint8 [rows, bytes per row] as ``ReaderTensor.data``
holds them, and returns the same weights as (qweight, scales, mins, bits, group_size):
W[n, k] = q[n, k] * scales[n, k // g] (+ mins[n, k // g]) for the block formats, exactly.
The K-quants stay super-blocks of 256 (group_size 256; ``adapters/torch/quant.py`` and
``cpu/csrc/portable/quant_six.h`` say the layouts): each row holds the values and the sub-block
scales as bytes, ``scales`` / ``mins`` one float16 per super-block (Q4_K's d and -dmin,
Q6_K's d), so the weights are the file's to the bit and as many bytes. All work is
whole-tensor numpy: no Python loop runs per block.
"""

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
from gguf import GGMLQuantizationType

QK_K = 256  # elements in a K-quant super-block


class QuantizedLinear(NamedTuple):
    # int8 [N, K] (bits 8), uint8 [N, K // 2] (bits 4); super-blocks: uint8 [N, K // 256 * 144]
    # (bits 4) or [N, K // 256 * 208] (bits 6)
    qweight: np.ndarray
    scales: np.ndarray  # float16 [N, K // group_size]
    mins: np.ndarray | None  # float16 [N, K // group_size], or None
    bits: int
    group_size: int


def q8_0(raw: np.ndarray) -> QuantizedLinear:
    """Block of 32: f16 d, 32 x int8 q; w = d * q."""
    blocks = _blocks(raw, 34)
    d = _f16(blocks[..., 0:2])
    q = blocks[..., 2:].view(np.int8)
    return QuantizedLinear(_rows(q, raw), _rows(d, raw), None, 8, 32)


def q5_0(raw: np.ndarray) -> QuantizedLinear:
    """Block of 32: f16 d, uint32 qh (bit j = 5th bit of element j), 16 bytes of low nibbles."""
    blocks = _blocks(raw, 22)
    d = _f16(blocks[..., 0:2])
    high = np.unpackbits(blocks[..., 2:6], axis=-1, bitorder="little")  # [..., 32], element order
    q = (_nibbles(blocks[..., 6:]) | (high << 4)).astype(np.int8) - np.int8(16)
    return QuantizedLinear(_rows(q, raw), _rows(d, raw), None, 8, 32)


def q4_0(raw: np.ndarray) -> QuantizedLinear:
    """Block of 32: f16 d, 16 bytes of nibbles; w = d * (q - 8), so the min is -8 d."""
    blocks = _blocks(raw, 18)
    d = _f16(blocks[..., 0:2])
    mins = (d.astype(np.float32) * -8).astype(np.float16)
    return QuantizedLinear(_rows(blocks[..., 2:], raw), _rows(d, raw), _rows(mins, raw), 4, 32)


def q4_1(raw: np.ndarray) -> QuantizedLinear:
    """Block of 32: f16 d, f16 m, 16 bytes of nibbles; w = d * q + m."""
    blocks = _blocks(raw, 20)
    d, m = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    return QuantizedLinear(_rows(blocks[..., 4:], raw), _rows(d, raw), _rows(m, raw), 4, 32)


def q4_k(raw: np.ndarray) -> QuantizedLinear:
    """Super-block of 256: f16 d, f16 dmin, 12 bytes of 6-bit (sc, m) x 8, 128 bytes of qs.

    Sub-block i (32 elements): w = d * sc[i] * q - dmin * m[i]. Its nibbles sit in the
    low (i even) or high (i odd) halves of the 32 bytes 32 * (i // 2) ..: unpacked here
    and packed again in the Q4_0 layout of the format (128 bytes), then the 8 scales and
    the 8 mins as a byte each (144 bytes a super-block, as in the file); d and -dmin are the
    weight's scales and mins.
    """
    blocks = _blocks(raw, 144)
    lead = blocks.shape[:-1]
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    sc, m = _k_scale_min(blocks[..., 4:16])
    qs = blocks[..., 16:].reshape(*lead, 4, 1, 32)
    values = (qs >> np.array([0, 4], dtype=np.uint8)[:, None]) & 0x0F  # [..., 4, 2, 32]
    values = values.reshape(*lead, 8, 32)
    packed = (values[..., :16] | (values[..., 16:] << 4)).reshape(*lead, 128)
    row = np.concatenate([packed, sc, m], axis=-1)  # [..., 144]
    return QuantizedLinear(_rows(row, raw), _rows(d, raw), _rows(-dmin, raw), 4, QK_K)


def q6_k(raw: np.ndarray) -> QuantizedLinear:
    """Super-block of 256: ql 128, qh 64, int8 scales[16], f16 d; w = d * scales[i] * (q - 32).

    Element e = 128 h + 32 t + i (h half, t quarter, i 0..31) takes its low 4 bits from
    byte 64 h + 32 (t % 2) + i of ql (high nibble when t >= 2) and its top 2 bits from
    bits 2 t of byte 32 h + i of qh. Kept as the format's 6-bit layout (two 96-byte runs of
    128, :func:`pack_int6`) and the 16 int8 scales (208 bytes a super-block); d is the
    weight's scale.
    """
    blocks = _blocks(raw, 210)
    lead = blocks.shape[:-1]
    ql = blocks[..., :128].reshape(*lead, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8)[:, None]
    low = (ql & 0x0F).reshape(*lead, 2, 4, 32)  # [h, t, i]: t = 2 * nibble + ql byte half
    qh = blocks[..., 128:192].reshape(*lead, 2, 1, 32)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 0x03  # [h, t, i]
    u = (low | (high << 4)).reshape(*lead, 2, 128)  # 0..63, element order
    row = np.concatenate([pack_int6(u).reshape(*lead, 192), blocks[..., 192:208]], axis=-1)
    return QuantizedLinear(_rows(row, raw), _rows(_f16(blocks[..., 208:210]), raw), None, 6, QK_K)


def pack_int6(u: np.ndarray) -> np.ndarray:
    """[..., 128 m] values 0..63 -> [..., 96 m] bytes: per 128, the low nibbles in the 4-bit
    layout (64 bytes), then the top two bits of the four blocks of 32, block j at bits 2 j
    (k i of the blocks in byte i, k 16 + i in byte 16 + i)."""
    runs = u.reshape(*u.shape[:-1], -1, 4, 2, 16)  # [..., run, block j, half, i]
    low = runs & 0x0F
    nibbles = (low[..., 0, :] | (low[..., 1, :] << 4)).reshape(*runs.shape[:-3], 64)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8)[:, None, None]
    top = np.bitwise_or.reduce((runs >> 4) << shifts, axis=-3).reshape(*runs.shape[:-3], 32)
    return np.concatenate([nibbles, top], axis=-1).reshape(*u.shape[:-1], -1)


DECODERS: dict[GGMLQuantizationType, Callable[[np.ndarray], QuantizedLinear]] = {
    GGMLQuantizationType.Q8_0: q8_0,
    GGMLQuantizationType.Q5_0: q5_0,
    GGMLQuantizationType.Q4_0: q4_0,
    GGMLQuantizationType.Q4_1: q4_1,
    GGMLQuantizationType.Q4_K: q4_k,
    GGMLQuantizationType.Q6_K: q6_k,
}


def _blocks(raw: np.ndarray, block_bytes: int) -> np.ndarray:
    """[rows, bytes per row] -> [rows, blocks per row, block bytes]."""
    if raw.ndim != 2 or raw.dtype != np.uint8 or raw.shape[1] % block_bytes:
        raise ValueError(
            f"expected uint8 rows of {block_bytes}-byte blocks, got {raw.dtype} {raw.shape}"
        )
    return np.ascontiguousarray(raw).reshape(raw.shape[0], -1, block_bytes)


def _rows(per_block: np.ndarray, raw: np.ndarray) -> np.ndarray:
    """[rows, blocks, ...] -> [rows, everything of the row in order], contiguous."""
    return np.ascontiguousarray(per_block.reshape(raw.shape[0], -1))


def _f16(two_bytes: np.ndarray) -> np.ndarray:
    """[..., 2] little-endian bytes -> float16 [...]."""
    return np.ascontiguousarray(two_bytes).view(np.float16)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32]: the 16 low nibbles, then the 16 high ones."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _k_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., 12] bytes -> the 8 sub-blocks' 6-bit scales and mins, uint8 [..., 8] each.

    Bytes 0-3 hold sc[0..3] (low 6 bits) and the top 2 bits of sc[4..7]; bytes 4-7 the
    same for the mins; bytes 8-11 the low 4 bits of sc[4..7] (low nibble) and m[4..7].
    """
    d, m, md = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn
