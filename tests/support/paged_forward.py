"""One sequence through the paged path (the engine's forward: :class:`PagedBatch` over a
:class:`PagedKVCache`), and paged steps of several rows over a scrambled pool, for tests that
hold them against the no-cache ``forward`` (the reference)."""

import random

import torch
from torch import Tensor

from adapters.torch.models.layers import PagedBatch
from adapters.torch.models.paged_kv import PagedKVCache
from adapters.torch.models.transformer import Transformer
from tests.support.tiny_models import VOCAB


class PagedSequence:
    """A sequence of up to ``capacity`` positions in a pool of its own (blocks in order):
    :meth:`prefill` runs prompt chunks, :meth:`decode` one decode row, each at its end."""

    def __init__(self, model: Transformer, capacity: int, *, block_size: int = 16) -> None:
        weight = model.embed_tokens.weight
        blocks = -(-capacity // block_size)
        self.model, self.device = model, weight.device
        self.cache = PagedKVCache(
            model.config, blocks, block_size, dtype=weight.dtype, device=weight.device
        )
        self.table = list(range(blocks))
        self.length = 0

    def prefill(self, ids: list[int] | Tensor) -> Tensor:
        """A prompt chunk after the positions so far: its logits ``[len(ids), vocab]``."""
        ids = torch.as_tensor(ids, device=self.device).flatten()
        count = ids.shape[0]
        batch = PagedBatch(
            self.cache, [], [(self.table, self.length, count)], self.model.windows(), self.device
        )
        self.length += count
        return self.model.forward_mixed(ids, batch, torch.arange(count, device=self.device))

    def decode(self, token: int | Tensor) -> Tensor:
        """One decode row (the next token): its logits ``[vocab]``."""
        ids = torch.as_tensor([int(token)], device=self.device)
        batch = PagedBatch(
            self.cache, [(self.table, self.length)], [], self.model.windows(), self.device
        )
        self.length += 1
        rows = torch.zeros(1, dtype=torch.long, device=self.device)
        return self.model.forward_mixed(ids, batch, rows)[0]


BLOCK = 4  # Pool's block size, small: every sequence spans several, chunks straddle their edges


class Pool:
    """A paged cache whose blocks are handed out in a scrambled order."""

    def __init__(self, model: Transformer, num_blocks: int = 40, seed: int = 0) -> None:
        self.cache = PagedKVCache(
            model.config, num_blocks, BLOCK, dtype=torch.float32, device="cpu"
        )
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    def grow(self, table: list[int], length: int) -> list[int]:
        while len(table) * BLOCK < length:
            table.append(self.free.pop())
        return table


def rand_ids(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (length,), generator=generator).tolist()


def full_logits(model: Transformer, ids: list[int]) -> Tensor:
    """Logits ``[len(ids), vocab]`` of one forward without a cache (the reference)."""
    return model(torch.tensor([ids]))[0]


def paged_step(
    model: Transformer,
    cache: PagedKVCache,
    rows: list[tuple[list[int], int, int]],
    chunks: list[tuple[list[int], int, list[int]]],
) -> Tensor:
    """One paged step: decode rows ``(table, position, token)`` and prompt chunks ``(table,
    start, tokens)``; returns every token's logits ``[N, vocab]``."""
    tokens = [token for _, _, token in rows] + [t for _, _, ids in chunks for t in ids]
    batch = PagedBatch(
        cache,
        [(table, position) for table, position, _ in rows],
        [(table, start, len(ids)) for table, start, ids in chunks],
        model.windows(),
        torch.device("cpu"),
    )
    every = torch.arange(len(tokens))
    return model.forward_mixed(torch.tensor(tokens), batch, every)
