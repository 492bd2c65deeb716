"""One sequence through the paged path (the engine's forward: :class:`PagedBatch` over a
:class:`PagedKVCache`), for tests that hold it against the no-cache ``forward`` (the
reference)."""

import torch
from torch import Tensor

from adapters.torch.models.layers import PagedBatch
from adapters.torch.models.paged_kv import PagedKVCache
from adapters.torch.models.transformer import Transformer


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
