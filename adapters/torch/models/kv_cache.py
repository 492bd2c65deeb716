"""Contiguous, preallocated KV cache with a batch dimension, for the model-level API
(``Transformer.forward(ids, kv_cache)`` and :func:`~adapters.torch.runtime.generate.generate`:
one prompt batch, no scheduler). The engine keeps its KV in the paged pool
(:mod:`adapters.torch.models.paged_kv`)."""

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from adapters.torch.models.config import ModelConfig


@dataclass(frozen=True)
class DecodeRows:
    """A step whose every token is one sequence's next token (row ``r`` = cache row ``r``),
    as a fused decode layer takes it: one layer's caches ``[S, Hkv, M, D]``, where each row
    writes (``positions`` ``[R]``), how many positions attention reads (``kv_len``), the keys
    each row sees (``< lengths[r]``, within ``window``; 0 = all)."""

    k: Tensor
    v: Tensor
    positions: Tensor
    lengths: Tensor
    kv_len: int
    window: int


class KVStore(Protocol):
    """What attention layers need from a cache: write this step's keys/values, read all."""

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]: ...


@dataclass
class KVCache:
    """Keys and values of every layer, ``[layers, batch, kv_heads, max_seq_len, head_dim]``.

    All rows share ``seq_len``, the number of positions written so far; a forward writes its
    ``T`` new positions at ``[seq_len, seq_len + T)`` of every layer and then ``advance(T)``.
    """

    k: Tensor
    v: Tensor
    seq_len: int = 0

    def __post_init__(self) -> None:
        # Per-layer views made once: indexing the 5-d tensors costs several ops per step.
        self._k_layers, self._v_layers = self.k.unbind(0), self.v.unbind(0)
        # [seq_len] for decode_rows, made once per step (at the position it was made for)
        self._position, self._position_at = torch.empty(0, dtype=torch.long), -1

    @staticmethod
    def from_model_config(
        config: ModelConfig,
        max_seq_len: int,
        *,
        batch_size: int = 1,
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cpu",
    ) -> "KVCache":
        shape = (config.num_layers, batch_size, config.num_kv_heads, max_seq_len, config.head_dim)
        # Uninitialized: a position is always written before any view includes it.
        return KVCache(
            k=torch.empty(shape, dtype=dtype, device=device),
            v=torch.empty(shape, dtype=dtype, device=device),
        )

    @property
    def max_seq_len(self) -> int:
        return self.k.shape[3]

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write ``k, v`` ``[batch, kv_heads, T, head_dim]`` at the current position; return
        views of everything written so far, ``[batch, kv_heads, seq_len + T, head_dim]``."""
        end = self.seq_len + k.shape[2]
        if end > self.max_seq_len:
            raise ValueError(f"KV cache overflow: {end} positions > max_seq_len {self.max_seq_len}")
        k_all, v_all = self._k_layers[layer], self._v_layers[layer]
        k_all[:, :, self.seq_len : end].copy_(k)
        v_all[:, :, self.seq_len : end].copy_(v)
        return k_all[:, :, :end], v_all[:, :, :end]

    def advance(self, num_tokens: int) -> None:
        self.seq_len += num_tokens

    def decode_rows(self, layer: int, lengths: Tensor, window: int) -> DecodeRows:
        """This cache (batch 1) as one decode row writing at ``seq_len``."""
        if self.seq_len >= self.max_seq_len:
            end, limit = self.seq_len + 1, self.max_seq_len
            raise ValueError(f"KV cache overflow: {end} positions > max_seq_len {limit}")
        if self._position_at != self.seq_len:
            self._position = torch.tensor([self.seq_len], device=self.k.device)
            self._position_at = self.seq_len
        return DecodeRows(
            self._k_layers[layer],
            self._v_layers[layer],
            self._position,
            lengths,
            self.seq_len + 1,
            window,
        )
