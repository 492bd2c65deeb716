"""Layers shared by every family: RMSNorm, rotary embeddings, attention, gated MLP, masks.

Projections are fused (``wqkv``, ``w13``) so a layer costs four matmuls: on a CPU the
per-call overhead of small matmuls is a large part of a decode step.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from adapters.torch.models.attention_backend import SDPA, SdpaAttention
from adapters.torch.models.config import ModelConfig, RopeConfig
from adapters.torch.models.paged_kv import PagedKVCache, block_tables, slot_mapping


class RMSNorm(nn.Module):
    """``x / rms(x) * w`` computed in float32; Gemma stores ``w - 1`` (``unit_offset``)."""

    def __init__(self, dim: int, eps: float, *, unit_offset: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Normalized in float32, as HF does, whatever the activation dtype.
        h = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        if self.unit_offset:  # Gemma multiplies in float32 before casting back
            return (h * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * h.to(x.dtype)


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> Tensor:
    """``[head_dim // 2]`` float32, with linear or llama3 scaling as configured."""
    inv = 1.0 / rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    if rope.rope_type == "linear":
        return inv / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scaling(inv, rope)
    return inv


def _llama3_scaling(inv: Tensor, rope: RopeConfig) -> Tensor:
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryTable:
    """cos and signed sin for every position, ``[max_positions, head_dim]``, computed once in
    float32. The sin's first half is negated so rotate-half needs only a roll."""

    def __init__(
        self, rope: RopeConfig, head_dim: int, max_positions: int, dtype: torch.dtype, device
    ) -> None:
        inv = inverse_frequencies(rope, head_dim).to(device)
        pos = torch.arange(max_positions, device=device, dtype=torch.float32)
        freqs = torch.outer(pos, inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        sin = emb.sin()
        sin[:, : head_dim // 2].neg_()
        self.cos = emb.cos().to(dtype)
        self.sin = sin.to(dtype)

    def gather_tokens(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin for a flat run of tokens, ``positions`` ``[N]`` -> ``[1, N, 1, head_dim]``."""
        return self.cos[positions][None, :, None], self.sin[positions][None, :, None]

    def gather(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin at one position per row, ``positions`` ``[B]`` -> ``[B, 1, 1, head_dim]``."""
        return self.cos[positions][:, None, None], self.sin[positions][:, None, None]

    def at(self, start: int, length: int) -> tuple[Tensor, Tensor]:
        """cos, sin for positions ``[start, start + length)``, ``[1, length, 1, head_dim]``."""
        return self.cos[None, start : start + length, None], self.sin[
            None, start : start + length, None
        ]


def apply_rope(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """Rotate-half RoPE on ``x`` ``[batch, T, heads, head_dim]``:
    ``x * cos + cat(-x2, x1) * sin`` written as ``x * cos + roll(x) * signed_sin``."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


class Attention(nn.Module):
    """GQA self-attention through SDPA; optional per-head QK-norm (Qwen3, Gemma3)."""

    def __init__(self, config: ModelConfig, layer: int, *, qk_norm: bool, unit_offset: bool):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv, self.head_dim = (
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
        )
        self.wqkv = nn.Linear(
            config.hidden_size, config.q_size + 2 * config.kv_size, bias=config.attention_bias
        )
        self.wo = nn.Linear(config.q_size, config.hidden_size, bias=False)
        self.q_norm = (
            RMSNorm(config.head_dim, config.rms_norm_eps, unit_offset=unit_offset)
            if qk_norm
            else None
        )
        self.k_norm = (
            RMSNorm(config.head_dim, config.rms_norm_eps, unit_offset=unit_offset)
            if qk_norm
            else None
        )
        scalar = config.query_pre_attn_scalar
        self.scale = scalar**-0.5 if scalar else config.head_dim**-0.5
        # How it attends (SDPA, or kernels): chosen once per model where its kernels are
        # installed, one backend shared by every layer (attention_backend.py).
        self.backend: SdpaAttention = SDPA

    def forward(
        self, x: Tensor, rope: tuple[Tensor, Tensor], mask: "AttnMask", cache: "Cache | None"
    ) -> Tensor:
        bsz, seqlen, _ = x.shape
        n_qk = self.n_heads + self.n_kv
        qkv = self.wqkv(x).view(bsz, seqlen, n_qk + self.n_kv, self.head_dim)
        qk, v = qkv[:, :, :n_qk], qkv[:, :, n_qk:]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split([self.n_heads, self.n_kv], dim=2)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=2)
        # One rotation for queries and keys together: half the small ops of a decode step.
        rotate = self.backend.rope or apply_rope
        q, k = rotate(qk, *rope).transpose(1, 2).split([self.n_heads, self.n_kv], dim=1)
        v = v.transpose(1, 2)
        if cache is None:  # the no-cache forward: the sequence attends over its own keys
            y = self._attend(q, k, v, mask)
        else:
            y = cache.attend(self.layer, q, k, v, self._attend)
        return self.wo(y.transpose(1, 2).reshape(bsz, seqlen, -1))

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, mask: "AttnMask") -> Tensor:
        """``q`` ``[B, H, T, D]``, ``k, v`` ``[B, Hkv, L, D]`` -> ``[B, H, T, D]``; or, when
        ``mask.tables`` is set, ``k, v`` one layer's block pools read through them."""
        return self.backend.attend(self, q, k, v, mask)


class GatedMLP(nn.Module):
    """``w2(act(w1 x) * w3 x)`` with ``w1`` (gate) and ``w3`` (up) fused into ``w13``."""

    def __init__(self, hidden: int, intermediate: int, act: Callable[[Tensor], Tensor]) -> None:
        super().__init__()
        self.w13 = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.w2 = nn.Linear(intermediate, hidden, bias=False)
        self.act = act

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(self.act(gate) * up)


def gelu_tanh(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")


class AttnMask:
    """What SDPA needs for one forward and one kind of layer (global or sliding).

    ``mask`` is boolean ``[batch | 1, 1, T, kv_len - kv_start]`` (True = attend) or None;
    ``kv_start`` drops keys before a sliding window instead of masking them. The
    same mask is also given as ``lengths`` (``[B]`` or ``[1]``: row ``b``'s last query
    sees keys ``< lengths[b]``, earlier queries one fewer each, causally) and ``window``
    (only the last ``window`` keys up to a query's position; 0 = all), for a kernel.
    Over a paged cache, ``tables`` ``[B, max_blocks]`` int32 are the rows' block tables and
    ``kv_len`` the positions the mask spans (what a gather reads); ``rows`` marks a step's
    decode rows (one query each, what a paged decode kernel takes), not a prompt chunk.
    """

    __slots__ = ("is_causal", "kv_len", "kv_start", "lengths", "mask", "rows", "tables", "window")

    def __init__(
        self,
        mask: Tensor | None,
        is_causal: bool,
        kv_start: int = 0,
        *,
        lengths: Tensor | None = None,
        window: int = 0,
    ) -> None:
        self.mask, self.is_causal, self.kv_start = mask, is_causal, kv_start
        self.lengths, self.window = lengths, window
        self.tables: Tensor | None = None
        self.kv_len, self.rows = 0, False

    def paged(self, tables: Tensor, kv_len: int, *, rows: bool = False) -> "AttnMask":
        """This mask over keys read through block ``tables`` (``kv_len`` positions), for
        decode ``rows`` or a prompt chunk."""
        self.tables, self.kv_len, self.rows = tables, kv_len, rows
        return self


def position_mask(positions: Tensor, kv_len: int, window: int | None) -> AttnMask:
    """One query per row at ``positions`` ``[B]`` over keys ``[0, kv_len)``: key ``j`` is
    visible iff ``j <= position`` (and within the sliding ``window``)."""
    k_pos = torch.arange(kv_len, device=positions.device)[None, :]
    q_pos = positions[:, None]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= q_pos - k_pos < window
    return AttnMask(allowed[:, None, None, :], False, 0, lengths=positions + 1, window=window or 0)


def build_mask(start: int, seqlen: int, window: int | None, device: torch.device) -> AttnMask:
    """Mask for queries at positions ``[start, start + seqlen)`` over keys ``[0, start + seqlen)``;
    ``window`` is a sliding-window size (key ``j`` visible from query ``i`` iff
    ``i - j < window``)."""
    kv_len = start + seqlen
    kv_start = max(0, kv_len - seqlen - window + 1) if window else 0
    windowed = window is not None and kv_len - kv_start > window
    lengths = torch.tensor([kv_len], device=device)
    if not windowed:
        if seqlen == 1:
            return AttnMask(None, False, kv_start, lengths=lengths, window=window or 0)
        if start == 0:
            return AttnMask(None, True, 0, lengths=lengths, window=window or 0)
    q_pos = torch.arange(start, kv_len, device=device)[:, None]
    k_pos = torch.arange(kv_start, kv_len, device=device)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= q_pos - k_pos < window
    return AttnMask(allowed[None, None], False, kv_start, lengths=lengths, window=window or 0)


class PagedBatch:
    """One continuous-batching step over a :class:`PagedKVCache` as one forward: ``N`` flat
    tokens (projections and MLPs run on all of them at once), first the decode
    rows ``(block table, position)`` (one token each), then the prompt chunks ``(block
    table, start, length)``; a table lists a sequence's blocks in order, covering its
    positions up to this step's last. Every token's key and value are written through the
    step's slot mapping (one ``index_copy_`` per layer); attention reads each part's keys
    through its tables: one batched call for the decode rows (the paged attention kernel
    where one is installed, else SDPA over gathered blocks), one per chunk (a chunk from
    position 0 attends over its own keys, nothing to read back).
    """

    def __init__(
        self,
        cache: PagedKVCache,
        rows: list[tuple[list[int], int]],
        chunks: list[tuple[list[int], int, int]],
        windows: dict[bool, int | None],
        device: torch.device,
        *,
        fused: bool = True,
    ) -> None:
        # fused: decode steps may run through a layer's installed decode kernel (False: a
        # step the kernels cannot compute, e.g. one with LoRA deltas, runs the modules).
        self.cache, self.rows, size = cache, len(rows), cache.block_size
        self.fused = fused
        token_positions = [position for _, position in rows]
        slots = [s for table, p in rows for s in slot_mapping(table, p, 1, size)]
        self.decode_masks: dict[bool, AttnMask] = {}
        if rows:
            at, kv_len = torch.tensor(token_positions, device=device), max(token_positions) + 1
            tables = block_tables([table for table, _ in rows], device)
            self.decode_masks = {
                s: position_mask(at, kv_len, w).paged(tables, kv_len, rows=True)
                for s, w in windows.items()
            }
        self.chunks: list[tuple[int, int]] = []  # token offset, length
        self.chunk_masks: list[dict[bool, AttnMask]] = []
        for table, start, length in chunks:
            self.chunks.append((len(token_positions), length))
            masks = {s: build_mask(start, length, w, device) for s, w in windows.items()}
            if start:  # a chunk after computed positions reads them through its table
                tables = block_tables([table], device)
                masks = {s: mask.paged(tables, start + length) for s, mask in masks.items()}
            self.chunk_masks.append(masks)
            token_positions.extend(range(start, start + length))
            slots.extend(slot_mapping(table, start, length, size))
        self.positions = torch.tensor(token_positions, device=device)
        self.write_index = cache.write_index(torch.tensor(slots, device=device))

    @classmethod
    def decode_only(
        cls,
        cache: PagedKVCache,
        positions: Tensor,
        slots: Tensor,
        tables: Tensor,
        windows: dict[bool, int | None],
    ) -> "PagedBatch":
        """A step of decode rows alone, from device tensors (``positions``, ``slots``
        ``[R]``, ``tables`` ``[R, max_blocks]``) and made of device ops only, so that it can
        be built inside a CUDA-graph capture (the paged kernel reads ``tables`` and the
        lengths; a gather would read ``max_blocks`` blocks)."""
        batch = cls.__new__(cls)
        batch.cache, batch.rows, batch.fused = cache, positions.shape[0], True
        lengths = positions + 1
        kv_len = tables.shape[1] * cache.block_size
        masks = {
            s: AttnMask(None, False, lengths=lengths, window=w or 0) for s, w in windows.items()
        }
        batch.decode_masks = {s: m.paged(tables, kv_len, rows=True) for s, m in masks.items()}
        batch.chunks, batch.chunk_masks = [], []
        batch.positions = positions
        batch.write_index = cache.write_index(slots)
        return batch

    def view(self, sliding: bool) -> "PagedView":
        return PagedView(self, sliding)


class PagedView:
    """A :class:`PagedBatch` as seen by one kind of layer (global or sliding-window)."""

    def __init__(self, batch: PagedBatch, sliding: bool) -> None:
        self.batch, self.sliding = batch, sliding

    def attend(
        self,
        layer: int,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        attend: Callable[[Tensor, Tensor, Tensor, AttnMask], Tensor],
    ) -> Tensor:
        """``q`` ``[1, H, N, D]``, ``k, v`` ``[1, Hkv, N, D]`` -> ``[1, H, N, D]``."""
        batch, rows, outs = self.batch, self.batch.rows, []
        cache = batch.cache
        cache.write(layer, k[0].transpose(0, 1), v[0].transpose(0, 1), batch.write_index)
        k_pool, v_pool = cache.k_layers[layer], cache.v_layers[layer]
        if rows:  # [1, H, R, D] -> [R, H, 1, D] and back
            q_rows = q[0, :, :rows].transpose(0, 1).unsqueeze(2)
            y = attend(q_rows, k_pool, v_pool, batch.decode_masks[self.sliding])
            outs.append(y[:, :, 0].transpose(0, 1).unsqueeze(0))
        for (offset, length), masks in zip(batch.chunks, batch.chunk_masks, strict=True):
            part, mask = slice(offset, offset + length), masks[self.sliding]
            if mask.tables is None:  # a chunk from position 0 sees only its own keys
                outs.append(attend(q[:, :, part], k[:, :, part], v[:, :, part], mask))
            else:
                outs.append(attend(q[:, :, part], k_pool, v_pool, mask))
        return torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]

    def decode_rows(self, layer: int) -> "PagedDecodeRows | None":
        """The step as decode rows over this layer's pool, for a fused decode layer (None
        when it has prompt chunks or runs unfused)."""
        batch = self.batch
        if batch.chunks or not batch.rows or not batch.fused:
            return None
        mask = batch.decode_masks[self.sliding]
        assert mask.lengths is not None and mask.tables is not None
        cache = batch.cache
        return PagedDecodeRows(
            cache.k_layers[layer],
            cache.v_layers[layer],
            batch.write_index,
            mask.tables,
            mask.lengths,
            mask.window,
        )


@dataclass(frozen=True)
class PagedDecodeRows:
    """A step whose every token is one sequence's next token, over one layer of a
    :class:`PagedKVCache` (``k_pool``, ``v_pool`` ``[blocks, Hkv, block_size, D]``), as a
    fused decode layer takes it: where each row's key and value heads go (``write_index``
    ``[R * Hkv]``, rows of the pool seen as ``[-1, D]``), each row's block table (``tables``
    ``[R, max_blocks]`` int32) and the keys it sees (``< lengths[r]``, within ``window``;
    0 = all)."""

    k_pool: Tensor
    v_pool: Tensor
    write_index: Tensor
    tables: Tensor
    lengths: Tensor
    window: int


Cache = PagedView


def decode_rows(cache: Cache | None, layer: int) -> PagedDecodeRows | None:
    """The step as decode rows (every token a sequence's next one) for a fused decode layer,
    or None: prompt chunks, or no cache (the no-cache forward)."""
    return cache.decode_rows(layer) if cache is not None else None
