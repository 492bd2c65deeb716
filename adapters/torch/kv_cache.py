"""Contiguous, preallocated KV cache with a batch dimension (no per-step concatenation)."""

from dataclasses import dataclass

import torch
from torch import Tensor

from adapters.torch.config import ModelConfig


def cache_dtype(model_dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """float32 on a CPU: SDPA's CPU kernel is ~3x slower for a bf16 decode query, and a bf16
    cache would be upcast in full at every step; the model's dtype elsewhere."""
    return torch.float32 if torch.device(device).type == "cpu" else model_dtype


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

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

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

    def reset(self) -> None:
        self.seq_len = 0
