"""GGUF quantized blocks -> infer's quantized linear format, without dequantizing.

Every decoder takes a tensor's raw bytes, uint8 [rows, bytes per row] as ``ReaderTensor.data``
holds them, and returns the same weights as (qweight, scales, mins, bits, group_size):
W[n, k] = q[n, k] * scales[n, k // g] (+ mins[n, k // g]). The integers are kept exactly;
only the K-quants' products (d * sub-block scale) are rounded, to float16. All work is
whole-tensor numpy: no Python loop runs per block.
"""

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
from gguf import GGMLQuantizationType

QK_K = 256  # elements in a K-quant super-block


class QuantizedLinear(NamedTuple):
    qweight: np.ndarray  # int8 [N, K] (bits 8) or uint8 [N, K // 2] (bits 4)
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
    and packed again in the Q4_0 layout of the format.
    """
    blocks = _blocks(raw, 144)
    d = _f16(blocks[..., 0:2]).astype(np.float32)[..., None]
    dmin = _f16(blocks[..., 2:4]).astype(np.float32)[..., None]
    sc, m = _k_scale_min(blocks[..., 4:16])
    qs = blocks[..., 16:].reshape(*blocks.shape[:-1], 4, 1, 32)
    values = (qs >> np.array([0, 4], dtype=np.uint8)[:, None]) & 0x0F  # [..., 4, 2, 32]
    values = values.reshape(*blocks.shape[:-1], 8, 32)
    packed = values[..., :16] | (values[..., 16:] << 4)  # [..., 8, 16]
    scales = (d * sc).astype(np.float16)
    mins = (-dmin * m).astype(np.float16)
    return QuantizedLinear(_rows(packed, raw), _rows(scales, raw), _rows(mins, raw), 4, 32)


def q6_k(raw: np.ndarray) -> QuantizedLinear:
    """Super-block of 256: ql 128, qh 64, int8 scales[16], f16 d; w = d * scales[i] * (q - 32).

    Element e = 128 h + 32 t + i (h half, t quarter, i 0..31) takes its low 4 bits from
    byte 64 h + 32 (t % 2) + i of ql (high nibble when t >= 2) and its top 2 bits from
    bits 2 t of byte 32 h + i of qh.
    """
    blocks = _blocks(raw, 210)
    lead = blocks.shape[:-1]
    ql = blocks[..., :128].reshape(*lead, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8)[:, None]
    low = (ql & 0x0F).reshape(*lead, 2, 4, 32)  # [h, t, i]: t = 2 * nibble + ql byte half
    qh = blocks[..., 128:192].reshape(*lead, 2, 1, 32)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 0x03  # [h, t, i]
    q = (low | (high << 4)).astype(np.int8) - np.int8(32)
    d = _f16(blocks[..., 208:210]).astype(np.float32)[..., None]
    scales = (d * blocks[..., 192:208].view(np.int8).astype(np.float32)).astype(np.float16)
    return QuantizedLinear(_rows(q, raw), _rows(scales, raw), None, 8, 16)


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
    """[..., 12] bytes -> the 8 sub-blocks' 6-bit scales and mins, float32 [..., 8] each.

    Bytes 0-3 hold sc[0..3] (low 6 bits) and the top 2 bits of sc[4..7]; bytes 4-7 the
    same for the mins; bytes 8-11 the low 4 bits of sc[4..7] (low nibble) and m[4..7].
    """
    d, m, md = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)
