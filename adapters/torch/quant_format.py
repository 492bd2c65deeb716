"""The quantized weight format (one for ``int8``, ``int4`` and ``gguf``;
``adapters/weights/gguf_quant.py`` writes it from GGUF blocks): :class:`QuantizedWeight`, its
quantizers, packings and dequantizer.

A weight ``W [N, K]`` is ``qweight`` (``int8 [N, K]``, or for 4 bits ``uint8 [N, K/2]`` where, in
each run of 32 k's, byte ``j`` holds element ``j`` in its low nibble and ``j + 16`` in its high
one: GGUF Q4_0's layout), ``scales`` and optional ``mins`` (``float16 [N, K/g]``), and
``W[n, k] = q[n, k] * scales[n, k/g] + mins[n, k/g]``. 6 bits (GGUF Q5_0's values, narrowed
from the int8 the file's cache holds where the kernel has the 6-bit path:
:func:`narrow_to_6bit`): ``uint8 [N, 3K/4]``, 96 bytes per 128 k's (:func:`pack_int6`), ``g``
16, and ``W = (u - 32) * scale + min`` for the value u (0..63). Super-blocks (GGUF Q4_K and
Q6_K kept whole, ``g`` 256: ``cpu/csrc/portable/quant_weight.h``): per 256 k's a row holds the
values (4-bit: 128 bytes; 6-bit: two 96-byte runs) and then the sub-block scales as bytes
(Q4_K: 8 scales and 8 mins, u8; Q6_K: 16 int8 scales), and ``scales`` / ``mins`` hold one
float16 per super-block (Q4_K's d and -dmin, Q6_K's d): ``W = q * d * sc + mins * m`` and
``(u - 32) * d * sc``, the file's weights to the bit."""

from dataclasses import dataclass

import torch
from torch import Tensor

INT4_GROUP_SIZE = 32


SUPER_BLOCK = 256  # a K-quant super-block's k's


SUPER_BYTES = {4: 144, 6: 208}  # a super-block's bytes in a row (values, sub-block scales)


SIX_BIT_GROUP, SIX_BIT_RUN = 16, 128  # 6-bit: k's a scale covers, k's a 96-byte run holds


@dataclass(frozen=True)
class QuantizedWeight:
    """One linear's weight in the format above."""

    qweight: Tensor
    scales: Tensor
    mins: Tensor | None
    bits: int
    group_size: int

    @property
    def super_blocks(self) -> bool:
        """Whether it is a super-block format (a GGUF K-quant kept whole)."""
        per = SUPER_BYTES.get(self.bits)
        return (
            self.group_size == SUPER_BLOCK
            and per is not None
            and self.scales.dim() == 2
            and self.qweight.shape[-1] == self.scales.shape[1] * per
        )

    @property
    def shape(self) -> tuple[int, int]:
        rows, cols = self.qweight.shape
        if self.super_blocks:
            return rows, self.scales.shape[1] * SUPER_BLOCK
        return rows, cols * 2 if self.bits == 4 else cols * 4 // 3 if self.bits == 6 else cols

    def check(self) -> None:
        n, k = self.shape
        g = self.group_size
        if self.bits not in (4, 6, 8):
            raise ValueError(f"bits must be 4, 6 or 8, got {self.bits}")
        if k % 32 or g <= 0 or k % g or g % (32 if self.bits == 4 else 16):
            raise ValueError(f"group size {g} does not fit {self.bits}-bit rows of {k}")
        superb = self.super_blocks
        if self.bits == 6 and not superb and (g != SIX_BIT_GROUP or k % SIX_BIT_RUN):
            raise ValueError(f"6-bit rows take groups of 16 and whole runs of 128, not {g} / {k}")
        if superb and (self.mins is None) != (self.bits == 6):
            raise ValueError("4-bit super-blocks need mins, 6-bit ones take none")
        want = torch.int8 if self.bits == 8 else torch.uint8
        if self.qweight.dtype != want:
            raise ValueError(f"{self.bits}-bit qweight must be {want}, got {self.qweight.dtype}")
        for name, t in (("scales", self.scales), ("mins", self.mins)):
            if t is not None and (t.dtype != torch.float16 or tuple(t.shape) != (n, k // g)):
                raise ValueError(f"{name} must be float16 {(n, k // g)}, got {t.dtype} {t.shape}")

    @property
    def nbytes(self) -> int:
        parts = (self.qweight, self.scales, self.mins)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)


def quantize_int8(weight: Tensor, group_size: int | None = None) -> QuantizedWeight:
    """Symmetric int8, one scale per output channel (``group_size`` None) or per group."""
    n, k = weight.shape
    g = group_size or k
    w = weight.detach().float().reshape(n, k // g, g)
    scales = (w.abs().amax(-1) / 127).to(torch.float16)
    q = torch.round(w / _safe(scales)[..., None]).clamp(-127, 127).to(torch.int8)
    return QuantizedWeight(q.reshape(n, k), scales, None, 8, g)


def quantize_int4(weight: Tensor, group_size: int = INT4_GROUP_SIZE) -> QuantizedWeight:
    """Asymmetric 4 bits (GGUF Q4_1's scheme): per group, ``min + q * (max - min) / 15``."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // group_size, group_size)
    low, high = w.amin(-1), w.amax(-1)
    scales, mins = ((high - low) / 15).to(torch.float16), low.to(torch.float16)
    q = torch.round((w - mins.float()[..., None]) / _safe(scales)[..., None]).clamp(0, 15)
    return QuantizedWeight(pack_int4(q.to(torch.uint8).reshape(n, k)), scales, mins, 4, group_size)


def _safe(scales: Tensor) -> Tensor:
    """Float scales with zeros replaced by one (an all-zero group quantizes to zeros)."""
    s = scales.float()
    return torch.where(s == 0, torch.ones_like(s), s)


def pack_int4(q: Tensor) -> Tensor:
    """``uint8 [N, K]`` of values 0..15 -> ``[N, K/2]`` in the layout above."""
    n, k = q.shape
    halves = q.reshape(n, k // 32, 2, 16)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k // 2)


def pack_int6(u: Tensor) -> Tensor:
    """``uint8 [N, K]`` of values 0..63 -> ``[N, 3K/4]``: per 128 k's (four blocks of 32),
    the blocks' low four bits as :func:`pack_int4` packs them (64 bytes), then 32 bytes of
    their top two bits: byte ``i`` holds block ``j``'s k ``i`` in bits ``2j, 2j+1``, byte
    ``16 + i`` its k ``16 + i`` (``cpu/csrc/portable/quant_six.h`` reads them so)."""
    n, k = u.shape
    runs = u.reshape(n, k // 128, 4, 2, 16)  # [n, run, block j, half, i]
    low = runs & 15
    nibbles = (low[:, :, :, 0] | (low[:, :, :, 1] << 4)).reshape(n, k // 128, 64)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=u.device).view(1, 1, 4, 1, 1)
    top = ((runs >> 4) << shifts).sum(2, dtype=torch.uint8)  # [n, run, half, i]: no carries
    return torch.cat((nibbles, top.reshape(n, k // 128, 32)), dim=2).reshape(n, k * 3 // 4)


def unpack_int6(packed: Tensor) -> Tensor:
    """The inverse of :func:`pack_int6`."""
    n, cols = packed.shape
    runs = packed.reshape(n, cols // 96, 96)
    low = unpack_int4(runs[:, :, :64].reshape(n, -1)).reshape(n, -1, 4, 2, 16)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=packed.device)
    top = (runs[:, :, 64:].reshape(n, -1, 1, 2, 16) >> shifts.view(1, 1, 4, 1, 1)) & 3
    return (low | (top << 4)).reshape(n, cols * 4 // 3)


def plain_blocks(w: QuantizedWeight, *, exact: bool = False) -> QuantizedWeight:
    """A super-block weight in the block formats: 4-bit with a scale and min per 32, 6-bit
    values as int8 with a scale per 16 (the format the kernels have AVX2 code for, and
    fused projections mixing formats use). Their float16 scales round d * sc (the file's
    product is exact in float32); ``exact``: float32 scales instead, for
    :func:`dequantize` only (not a format the kernels take)."""
    if not w.super_blocks:
        return w
    n, k = w.shape
    supers = k // SUPER_BLOCK
    rows = w.qweight.reshape(n, supers, SUPER_BYTES[w.bits])
    dtype = torch.float32 if exact else torch.float16
    d = w.scales.float()[..., None]
    if w.bits == 4:
        nibbles = rows[..., :128].reshape(n, k // 2)
        sub = rows[..., 128:].float()
        assert w.mins is not None
        scales = (d * sub[..., :8]).reshape(n, k // 32).to(dtype)
        mins = (w.mins.float()[..., None] * sub[..., 8:]).reshape(n, k // 32).to(dtype)
        return QuantizedWeight(nibbles.contiguous(), scales, mins, 4, 32)
    values = unpack_int6(rows[..., :192].reshape(n, supers * 192).contiguous())
    sub = rows[..., 192:].contiguous().view(torch.int8).float()
    scales = (d * sub).reshape(n, k // 16).to(dtype)
    return QuantizedWeight((values.to(torch.int16) - 32).to(torch.int8), scales, None, 8, 16)


def narrow_to_6bit(w: QuantizedWeight) -> QuantizedWeight:
    """An int8 weight whose values all lie in -32..31 (GGUF Q6_K's and Q5_0's, as the
    converted file keeps them) in 6 bits, exactly, its scales (and mins) repeated per 16
    k's where its groups are longer; any other weight unchanged."""
    n, k = w.shape
    if w.bits != 8 or w.group_size % SIX_BIT_GROUP or k % SIX_BIT_RUN or n == 0:
        return w
    if int(w.qweight.min()) < -32 or int(w.qweight.max()) > 31:
        return w
    u = (w.qweight.to(torch.int16) + 32).to(torch.uint8)
    split = w.group_size // SIX_BIT_GROUP
    scales = w.scales.repeat_interleave(split, dim=1) if split > 1 else w.scales
    mins = w.mins.repeat_interleave(split, dim=1) if split > 1 and w.mins is not None else w.mins
    return QuantizedWeight(pack_int6(u), scales, mins, 6, SIX_BIT_GROUP)


def unpack_int4(packed: Tensor) -> Tensor:
    """The inverse of :func:`pack_int4`."""
    n, half = packed.shape
    chunks = packed.reshape(n, half // 16, 1, 16)
    return torch.cat((chunks & 15, chunks >> 4), dim=2).reshape(n, half * 2)


def dequantize(w: QuantizedWeight, dtype: torch.dtype = torch.float32) -> Tensor:
    """The dense ``[N, K]`` weight."""
    n, k = w.shape
    if w.super_blocks:
        return dequantize(plain_blocks(w, exact=True), dtype)
    if w.bits == 6:
        q = unpack_int6(w.qweight).to(torch.int16) - 32
    else:
        q = unpack_int4(w.qweight) if w.bits == 4 else w.qweight
    groups = q.float().reshape(n, k // w.group_size, w.group_size) * w.scales.float()[..., None]
    if w.mins is not None:
        groups = groups + w.mins.float()[..., None]
    return groups.reshape(n, k).to(dtype)


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """The weights stacked along N (fused q/k/v, gate/up), in a format that holds them all
    exactly: 4 bits widen to 6 or 8 and 6 to 8 (with mins), groups split to the smallest one."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    if all(p.super_blocks and p.bits == first.bits for p in parts):  # rows stack as they are
        stacked = [p.mins for p in parts if p.mins is not None]
        return QuantizedWeight(
            torch.cat([p.qweight for p in parts]),
            torch.cat([p.scales for p in parts]),
            torch.cat(stacked) if stacked else None,
            first.bits,
            first.group_size,
        )
    parts = [narrow_to_6bit(plain_blocks(p)) if p.super_blocks else p for p in parts]
    bits = max(p.bits for p in parts)
    group = min(p.group_size for p in parts)
    with_mins = any(p.mins is not None for p in parts)
    if with_mins and group % 32 and bits != 6:  # 8-bit mins need whole 32-runs: requantize
        return quantize_int8(torch.cat([dequantize(p) for p in parts]), 32)
    same = [_widen(p, bits, group, with_mins) for p in parts]
    mins = torch.cat([p.mins for p in same if p.mins is not None]) if with_mins else None
    return QuantizedWeight(
        torch.cat([p.qweight for p in same]),
        torch.cat([p.scales for p in same]),
        mins,
        bits,
        group,
    )


def _widen(w: QuantizedWeight, bits: int, group: int, with_mins: bool) -> QuantizedWeight:
    qweight, scales, mins = w.qweight, w.scales, w.mins
    if bits != w.bits:  # the same values in the wider format, the mins unchanged
        values = unpack_int4(qweight) if w.bits == 4 else unpack_int6(qweight).to(torch.int16) - 32
        # a 4-bit q is the 6-bit u = q + 32
        qweight = pack_int6((values + 32).to(torch.uint8)) if bits == 6 else values.to(torch.int8)
    split = w.group_size // group
    scales = scales.repeat_interleave(split, dim=1)
    if mins is not None:
        mins = mins.repeat_interleave(split, dim=1)
    elif with_mins:
        mins = torch.zeros_like(scales)
    return QuantizedWeight(qweight, scales, mins, bits, group)
