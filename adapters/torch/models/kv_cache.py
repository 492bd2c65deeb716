"""Contiguous, preallocated KV cache with a batch dimension (no per-step concatenation)."""

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from adapters.torch.cpu.kernels import for_bf16_cpu
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


class SlotKVCache:
    """Continuous batching storage: one contiguous slot per running request,
    ``[layers, slots, kv_heads, max_seq_len, head_dim]``.

    A prefill chunk runs on :meth:`slot`, a one-row :class:`KVCache` view. A batched decode
    step runs rows ``0..B-1`` = slots ``0..B-1`` (the runner keeps occupied slots
    compacted), each writing its one new position; attention reads the slots' first
    ``decode_len`` positions and masks each row beyond its own position.
    """

    def __init__(
        self,
        config: ModelConfig,
        slots: int,
        max_seq_len: int,
        *,
        dtype: torch.dtype,
        device: str | torch.device,
    ) -> None:
        shape = (config.num_layers, slots, config.num_kv_heads, max_seq_len, config.head_dim)
        # Zeroed, unlike KVCache: a batched decode reads every row up to the longest row,
        # and a masked-out key still multiplies its value by 0 — garbage NaN would leak.
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self._k_layers, self._v_layers = self.k.unbind(0), self.v.unbind(0)
        self._write_index = torch.empty(0, dtype=torch.long, device=device)
        self._positions = self._write_index
        kernels = for_bf16_cpu(self.k)
        self._write_rows = kernels.write_rows if kernels is not None else None
        self.decode_len = 0

    @property
    def max_seq_len(self) -> int:
        return self.k.shape[3]

    def slot(self, index: int, seq_len: int) -> KVCache:
        """Slot ``index`` as a batch-1 cache whose first ``seq_len`` positions are written."""
        return KVCache(self.k[:, index : index + 1], self.v[:, index : index + 1], seq_len)

    def begin_decode(self, positions: Tensor, decode_len: int) -> None:
        """Row ``b`` writes its key/value at ``positions[b]`` ``[B]``; keys ``< decode_len``."""
        self._positions = positions
        if self._write_rows is None:
            _, _, kv_heads, max_len, _ = self.k.shape
            rows = torch.arange(positions.shape[0], device=positions.device)
            heads = torch.arange(kv_heads, device=positions.device)
            # Where row b, head h writes, as a row of a layer seen as
            # [slots * kv_heads * max_len, D]: one index_copy_ per layer.
            self._write_index = (
                (rows[:, None] * kv_heads + heads[None, :]) * max_len + positions[:, None]
            ).flatten()
        self.decode_len = decode_len

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """``k, v`` ``[B, kv_heads, 1, D]`` -> keys/values ``[B, kv_heads, decode_len, D]``."""
        k_all, v_all = self._k_layers[layer], self._v_layers[layer]
        if self._write_rows is not None:
            self._write_rows(k_all, k, self._positions)
            self._write_rows(v_all, v, self._positions)
        else:
            dim = k.shape[-1]
            k_all.view(-1, dim).index_copy_(0, self._write_index, k.reshape(-1, dim))
            v_all.view(-1, dim).index_copy_(0, self._write_index, v.reshape(-1, dim))
        rows = k.shape[0]
        return k_all[:rows, :, : self.decode_len], v_all[:rows, :, : self.decode_len]

    def decode_rows(self, layer: int, lengths: Tensor, window: int) -> DecodeRows:
        """The rows of the decode step begun by :meth:`begin_decode`, for one layer."""
        return DecodeRows(
            self._k_layers[layer],
            self._v_layers[layer],
            self._positions,
            lengths,
            self.decode_len,
            window,
        )

    def move(self, source: int, target: int, length: int) -> None:
        """Copy slot ``source``'s first ``length`` positions into slot ``target``."""
        self.k[:, target, :, :length] = self.k[:, source, :, :length]
        self.v[:, target, :, :length] = self.v[:, source, :, :length]
