"""Paged KV storage: every layer's keys and values in one pool of fixed-size blocks.

The pool is ``[layers, num_blocks, kv_heads, block_size, head_dim]``: within a block, each
KV head's ``block_size`` keys are contiguous ``head_dim`` rows, what the CPU attention
kernel reads (``dot_scores`` reads 16 keys of one head at a time and the P @ V loop walks
value rows), so the paged kernel reads a block as one run of keys, and a block of 16 keys
is exactly one of the prompt kernel's key tiles. (vLLM's CUDA layout
``[blocks, block_size, kv_heads, head_dim]`` suits a token-major write; here the writes are a
few rows a step and the reads are the whole context, so the reads choose.)

A token at position ``p`` of a sequence whose block table is ``table`` lives in slot
``table[p // block_size] * block_size + p % block_size``. A step writes its new keys and
values by slot mapping (one slot per flat token) and reads each row's context through its
block table (``[rows, max_blocks]`` int32, padded with any valid block) and context length.
Without a kernel, reading gathers a row's blocks into a contiguous ``[rows, kv_heads, ctx,
head_dim]`` view for SDPA (the pool is zeroed at creation, so the padding keys of a gather
are finite and a masked-out key contributes 0, never NaN).

The scheduler's block manager (:mod:`domain.kv_blocks`) decides which blocks each request
uses; every scheduled chunk carries its request's block table, and the runner derives the
step's slot mapping from the tables and positions. ``n`` > 1 siblings and cached prefixes
share blocks by reference. Decode rows read the pool through their tables with a paged
attention kernel: the AVX512-BF16 one for a bf16 model on a CPU that has it, else the
portable one (:mod:`adapters.torch.cpu.portable`, any CPU with a C++ compiler) or, where
none could be built, SDPA over gathered blocks. A step of decode rows reaches a block's
fused decode layer as :class:`~adapters.torch.models.layers.PagedDecodeRows`: the
AVX512-BF16 one (:mod:`adapters.torch.cpu.fused_decode`, ``decode_layer_paged``) and a
quantized model's (:mod:`adapters.torch.cpu.quant_decode`) both run over the pool.
"""

import torch
from torch import Tensor

from adapters.torch.models.config import ModelConfig

DEFAULT_BLOCK_SIZE = 16


class PagedKVCache:
    """Keys and values of every layer in ``num_blocks`` blocks of ``block_size`` positions."""

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        *,
        dtype: torch.dtype,
        device: str | torch.device,
        zeroed: bool = True,
    ) -> None:
        """``zeroed`` False leaves the pool uninitialized (its memory becomes resident as
        blocks are first written): only where nothing reads a position before it is
        written, i.e. decode rows read through a paged kernel, never a gather."""
        shape = (config.num_layers, num_blocks, config.num_kv_heads, block_size, config.head_dim)
        make = torch.zeros if zeroed else torch.empty
        self.k = make(shape, dtype=dtype, device=device)
        self.v = make(shape, dtype=dtype, device=device)
        self.k_layers, self.v_layers = self.k.unbind(0), self.v.unbind(0)

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def block_size(self) -> int:
        return self.k.shape[3]

    def write_index(self, slot_mapping: Tensor) -> Tensor:
        """Where each token's heads go, as rows of one layer seen as ``[-1, head_dim]``:
        ``slot_mapping`` ``[N]`` -> ``[N * kv_heads]`` (token-major), made once per step."""
        return write_index(slot_mapping, self.k.shape[2], self.block_size)

    def write(self, layer: int, k: Tensor, v: Tensor, index: Tensor) -> None:
        """Store ``k, v`` ``[N, kv_heads, head_dim]`` at the rows :meth:`write_index` gave."""
        dim = k.shape[-1]
        self.k_layers[layer].view(-1, dim).index_copy_(0, index, k.reshape(-1, dim))
        self.v_layers[layer].view(-1, dim).index_copy_(0, index, v.reshape(-1, dim))

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block ``source`` -> block ``target`` in every layer, per pair."""
        if not pairs:
            return
        source = torch.tensor([s for s, _ in pairs], device=self.k.device)
        target = torch.tensor([t for _, t in pairs], device=self.k.device)
        self.k[:, target] = self.k[:, source]
        self.v[:, target] = self.v[:, source]


def write_index(slot_mapping: Tensor, kv_heads: int, block_size: int) -> Tensor:
    """The rows of a pool layer ``[blocks, kv_heads, block_size, D]`` seen as ``[-1, D]``
    that each token's ``kv_heads`` heads go to: ``slot_mapping`` ``[N]`` -> ``[N * kv_heads]``."""
    heads = torch.arange(kv_heads, device=slot_mapping.device)
    block, offset = slot_mapping // block_size, slot_mapping % block_size
    return ((block[:, None] * kv_heads + heads[None, :]) * block_size + offset[:, None]).flatten()


def slot_mapping(table: list[int], start: int, length: int, block_size: int) -> list[int]:
    """The slots of positions ``[start, start + length)`` of a sequence with block ``table``."""
    return [
        table[p // block_size] * block_size + p % block_size for p in range(start, start + length)
    ]


def gather(pool: Tensor, tables: Tensor, length: int) -> Tensor:
    """One layer's pool ``[num_blocks, kv_heads, block_size, D]`` read through ``tables``
    ``[rows, max_blocks]`` -> ``[rows, kv_heads, length, D]`` contiguous (the first
    ``length`` positions of each row's blocks, in table order)."""
    rows = tables.shape[0]
    _, kv_heads, size, dim = pool.shape
    needed = -(-length // size)
    blocks = pool[tables[:, :needed].long()]  # [rows, needed, kv_heads, size, D]
    flat = blocks.transpose(1, 2).reshape(rows, kv_heads, needed * size, dim)
    return flat[:, :, :length] if needed * size != length else flat


def block_tables(tables: list[list[int]], device: torch.device | str) -> Tensor:
    """Per-row block tables -> ``[rows, max_blocks]`` int32, short rows padded with block 0
    (a valid block: padded positions are read only past a row's length, and masked)."""
    width = max((len(t) for t in tables), default=0)
    padded = [t + [0] * (width - len(t)) for t in tables]
    return torch.tensor(padded, dtype=torch.int32, device=device).view(len(tables), width)
