"""The decoder-only transformer every family shares; families supply their blocks.

``forward(input_ids)``: one causal forward without a cache (the reference the paged path is
tested against: HF parity, training); ``forward_mixed``: one engine step over the paged KV
pool (:class:`PagedBatch`).
"""

from collections.abc import Callable

import torch
from torch import Tensor, nn

from adapters.torch.models.config import ModelConfig
from adapters.torch.models.layers import (
    Attention,
    AttnMask,
    Cache,
    PagedBatch,
    PagedDecodeRows,
    RMSNorm,
    RotaryTable,
    build_mask,
    decode_rows,
)

_NO_MASK = AttnMask(None, False)  # a PagedBatch carries its own masks


class Block(nn.Module):
    """One decoder layer; ``sliding`` selects the local rope and sliding-window mask. A family
    writes :meth:`forward_modules`; :meth:`forward` tries an installed decode kernel first."""

    sliding: bool = False
    # The whole layer for decode rows in one call, installed by CPU inference optimizations:
    # (x, rope, rows) -> the modules' result, or None where it does not apply to this step
    # (the modules run). See cpu.fused_decode.FusedDecodeLayer, cpu.quant_decode.
    decode_kernel: (
        Callable[[Tensor, tuple[Tensor, Tensor], PagedDecodeRows], Tensor | None] | None
    ) = None

    attn: Attention

    def forward(
        self, x: Tensor, rope: tuple[Tensor, Tensor], mask: AttnMask, cache: Cache | None
    ) -> Tensor:
        """The decode kernel's result where one is installed and applies to this step, else
        :meth:`forward_modules`."""
        if self.decode_kernel is not None:
            rows = decode_rows(cache, self.attn.layer)
            y = self.decode_kernel(x, rope, rows) if rows is not None else None
            if y is not None:
                return y
        return self.forward_modules(x, rope, mask, cache)

    def forward_modules(
        self, x: Tensor, rope: tuple[Tensor, Tensor], mask: AttnMask, cache: Cache | None
    ) -> Tensor:
        """The layer through its modules (the family's own)."""
        raise NotImplementedError


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig, blocks: list[Block], *, unit_offset: bool) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(blocks)
        self.sliding = [b.sliding for b in blocks]
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=unit_offset)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope: dict[bool, RotaryTable] = {}

    def setup_rope(self, dtype: torch.dtype, device: torch.device | str) -> None:
        """Build the cos/sin tables (not parameters: they are derived, never loaded)."""
        c = self.config
        self.rope = {
            False: RotaryTable(c.rope, c.head_dim, c.max_position_embeddings, dtype, device)
        }
        if c.local_rope is not None:
            self.rope[True] = RotaryTable(
                c.local_rope, c.head_dim, c.max_position_embeddings, dtype, device
            )

    def embed(self, input_ids: Tensor) -> Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: Tensor) -> Tensor:
        """``input_ids`` ``[batch, T]`` (no cache, causal) -> logits ``[batch, T, vocab]``."""
        return self.logits(self.hidden_states(input_ids))

    def hidden_states(self, input_ids: Tensor) -> Tensor:
        """``input_ids`` ``[batch, T]`` (no cache, causal) -> the final normed hidden states
        ``[batch, T, hidden]``: what ``forward`` feeds the LM head (training uses it to
        score only some rows)."""
        seqlen = input_ids.shape[1]
        ropes = {s: table.at(0, seqlen) for s, table in self.rope.items()}
        masks = {s: build_mask(0, seqlen, self._window(s), input_ids.device) for s in self.rope}
        x = self.embed(input_ids)
        for layer, sliding in zip(self.layers, self.sliding, strict=True):
            x = layer(x, ropes[sliding], masks[sliding], None)
        return self.norm(x)

    def forward_mixed(self, input_ids: Tensor, batch: PagedBatch, sample_rows: Tensor) -> Tensor:
        """One continuous-batching step: ``input_ids`` ``[N]`` laid out as ``batch`` says;
        returns logits ``[S, vocab]`` of the tokens at ``sample_rows`` ``[S]``."""
        ropes = {s: table.gather_tokens(batch.positions) for s, table in self.rope.items()}
        views = {s: batch.view(s) for s in self.rope}
        x = self.embed(input_ids[None])
        for layer, sliding in zip(self.layers, self.sliding, strict=True):
            x = layer(x, ropes[sliding], _NO_MASK, views[sliding])
        return self.logits(self.norm(x[0, sample_rows]))

    def windows(self) -> dict[bool, int | None]:
        """The sliding window of each kind of layer this model has (None: global)."""
        return {s: self._window(s) for s in self.rope}

    def logits(self, x: Tensor) -> Tensor:
        return self.lm_head(x)

    def _window(self, sliding: bool) -> int | None:
        return self.config.sliding_window if sliding else None
