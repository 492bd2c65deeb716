"""Layers shared by every family: RMSNorm, rotary embeddings, attention, gated MLP, masks.

Projections are fused (``wqkv``, ``w13``) so a layer costs four matmuls: on a CPU the
per-call overhead of small matmuls is a large part of a decode step.
"""

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from adapters.torch.config import ModelConfig, RopeConfig
from adapters.torch.kv_cache import KVCache


class RMSNorm(nn.Module):
    """``x / rms(x) * w`` computed in float32; Gemma stores ``w - 1`` (``unit_offset``)."""

    def __init__(self, dim: int, eps: float, *, unit_offset: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
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
    """cos/sin for every position, ``[max_positions, head_dim]``, computed once in float32."""

    def __init__(
        self, rope: RopeConfig, head_dim: int, max_positions: int, dtype: torch.dtype, device
    ) -> None:
        inv = inverse_frequencies(rope, head_dim).to(device)
        pos = torch.arange(max_positions, device=device, dtype=torch.float32)
        freqs = torch.outer(pos, inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(dtype)
        self.sin = emb.sin().to(dtype)

    def at(self, start: int, length: int) -> tuple[Tensor, Tensor]:
        """cos, sin for positions ``[start, start + length)``, ``[1, 1, length, head_dim]``."""
        return self.cos[None, None, start : start + length], self.sin[
            None, None, start : start + length
        ]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE on ``x`` ``[batch, heads, T, head_dim]``."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


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

    def forward(
        self, x: Tensor, rope: tuple[Tensor, Tensor], mask: "AttnMask", cache: KVCache | None
    ) -> Tensor:
        bsz, seqlen, _ = x.shape
        q, k, v = self.wqkv(x).split(
            [self.n_heads * self.head_dim, self.n_kv * self.head_dim, self.n_kv * self.head_dim],
            dim=-1,
        )
        q = q.view(bsz, seqlen, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(bsz, seqlen, self.n_kv, self.head_dim).transpose(1, 2)
        v = v.view(bsz, seqlen, self.n_kv, self.head_dim).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if cache is not None:
            k, v = cache.update(self.layer, k, v)
        if mask.kv_start:
            k, v = k[:, :, mask.kv_start :], v[:, :, mask.kv_start :]
        if seqlen == 1:
            y = decode_attention(q, k, v, mask.mask, self.scale)
        else:
            y = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask.mask,
                is_causal=mask.is_causal,
                scale=self.scale,
                enable_gqa=self.n_kv != self.n_heads,
            )
        return self.wo(y.transpose(1, 2).reshape(bsz, seqlen, -1))


def decode_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """One query per row: ``q`` ``[B, H, 1, D]``, ``k, v`` ``[B, Hkv, L, D]`` -> ``[B, H, 1, D]``.

    Two batched matmuls with the query heads grouped per KV head: on a CPU, SDPA's flash
    kernel costs several times more than this for a single query.
    """
    bsz, n_heads, _, head_dim = q.shape
    n_kv = k.shape[1]
    qg = q.view(bsz, n_kv, n_heads // n_kv, head_dim)
    scores = torch.matmul(qg, k.transpose(-1, -2)) * scale  # [B, Hkv, G, L]
    if mask is not None:
        scores = scores.masked_fill(~mask.view(mask.shape[0], 1, 1, -1), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
    return torch.matmul(probs, v).view(bsz, n_heads, 1, head_dim)


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
    ``kv_start`` drops keys before a sliding window instead of masking them.
    """

    __slots__ = ("is_causal", "kv_start", "mask")

    def __init__(self, mask: Tensor | None, is_causal: bool, kv_start: int = 0) -> None:
        self.mask, self.is_causal, self.kv_start = mask, is_causal, kv_start


def build_mask(
    start: int, seqlen: int, padding_mask: Tensor | None, window: int | None, device: torch.device
) -> AttnMask:
    """Mask for queries at positions ``[start, start + seqlen)`` over keys ``[0, start + seqlen)``.

    ``padding_mask`` ``[batch, >= kv_len]`` marks real positions (right padding); ``window``
    is a sliding-window size (key ``j`` visible from query ``i`` iff ``i - j < window``).
    """
    kv_len = start + seqlen
    kv_start = max(0, kv_len - seqlen - window + 1) if window else 0
    windowed = window is not None and kv_len - kv_start > window
    if padding_mask is None and not windowed:
        if seqlen == 1:
            return AttnMask(None, False, kv_start)
        if start == 0:
            return AttnMask(None, True, 0)
    q_pos = torch.arange(start, kv_len, device=device)[:, None]
    k_pos = torch.arange(kv_start, kv_len, device=device)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= q_pos - k_pos < window
    mask = allowed[None, None]
    if padding_mask is not None:
        mask = mask & padding_mask[:, None, None, kv_start:kv_len]
    return AttnMask(mask, False, kv_start)
