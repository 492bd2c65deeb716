"""The decoder-only transformer every family shares; families supply their blocks.

``forward(input_ids)``: one causal forward without a cache (the reference the paged path is
tested against: HF parity, training); ``forward_mixed``: one engine step over the paged KV
pool (:class:`PagedBatch`); ``packed_hidden_states``: a training forward of sequences that
share prefixes, each prefix once (:class:`PackedView`).
"""

from collections.abc import Callable, Sequence
from typing import cast

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
        # Every layer's decode rows in one call, installed by CPU inference optimizations:
        # (x, ropes, batch) -> the last layer's output, or None where it does not apply to
        # this step (the layers run). See cpu.quant_decode.QuantDecodeStack.
        self.decode_stack: (
            Callable[[Tensor, dict[bool, tuple[Tensor, Tensor]], PagedBatch], Tensor | None] | None
        ) = None

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

    def packed_hidden_states(
        self, input_ids: Tensor, packs: Sequence[tuple[int, Sequence[int]]]
    ) -> Tensor:
        """:meth:`hidden_states` of sequences that share prefixes, each prefix computed once:
        ``input_ids`` ``[N]`` are flat rows holding ``packs`` one after another, each
        ``(prefix, own)``: ``prefix`` rows its sequences share, then the rows of each
        sequence after it (``own``: their counts, 0 for a sequence that is the prefix).
        Returns ``[N, hidden]``; a sequence's states are :meth:`hidden_states`' on it alone
        (its rows attend to the prefix's and to its own earlier rows only, see
        :class:`PackedView`)."""
        layout = PackedLayout(packs, input_ids.device)
        ropes = {s: table.gather_tokens(layout.positions) for s, table in self.rope.items()}
        # A packed view takes a paged view's place in the layers (the same two methods).
        exact = self.prompt_kernel()
        views = {
            s: cast(Cache, PackedView(layout, self._window(s), exact=exact)) for s in self.rope
        }
        x = self.embed(input_ids[None])
        for layer, sliding in zip(self.layers, self.sliding, strict=True):
            x = layer(x, ropes[sliding], _NO_MASK, views[sliding])
        return self.norm(x[0])

    def forward_mixed(self, input_ids: Tensor, batch: PagedBatch, sample_rows: Tensor) -> Tensor:
        """One continuous-batching step: ``input_ids`` ``[N]`` laid out as ``batch`` says;
        returns logits ``[S, vocab]`` of the tokens at ``sample_rows`` ``[S]``."""
        ropes = {s: table.gather_tokens(batch.positions) for s, table in self.rope.items()}
        x = self.embed(input_ids[None])
        stacked = self.decode_stack(x, ropes, batch) if self.decode_stack is not None else None
        if stacked is not None:
            x = stacked
        else:
            views = {s: batch.view(s) for s in self.rope}
            for layer, sliding in zip(self.layers, self.sliding, strict=True):
                x = layer(x, ropes[sliding], _NO_MASK, views[sliding])
        return self.logits(self.norm(x[0, sample_rows]))

    def prompt_kernel(self) -> bool:
        """Whether some layer attends through a prompt kernel (the AVX512-BF16 build's),
        which rounds a prompt's rows as the engine's chunks do."""
        return any(
            getattr(block.attn.backend, "prompt", None) is not None
            for block in self.layers
            if isinstance(block, Block)
        )

    def windows(self) -> dict[bool, int | None]:
        """The sliding window of each kind of layer this model has (None: global)."""
        return {s: self._window(s) for s in self.rope}

    def logits(self, x: Tensor) -> Tensor:
        return self.lm_head(x)

    def _window(self, sliding: bool) -> int | None:
        return self.config.sliding_window if sliding else None


class PackedLayout:
    """Where the blocks of :class:`PackedView` take their rows from, for flat rows holding
    ``packs`` (see :meth:`Transformer.packed_hidden_states`); built once per forward."""

    def __init__(self, packs: Sequence[tuple[int, Sequence[int]]], device: torch.device) -> None:
        starts, prefixes = [], []  # per pack
        positions: list[int] = []  # per row
        # Per pack with rows after its prefix: their first row, sequence and position.
        owners, own_starts = [], []
        segments: list[list[int]] = []
        own_positions: list[list[int]] = []
        at = 0
        # Per pack: its prefix's first row and length, and each sequence's own rows after
        # it (first row, count): the flat rows in order (PackedView's exact path).
        self.parts: list[tuple[int, int, list[tuple[int, int]]]] = []
        for b, (prefix, counts) in enumerate(packs):
            starts.append(at)
            prefixes.append(prefix)
            positions += range(prefix)
            own_at = at + prefix
            owns = []
            for n in counts:
                if n:
                    owns.append((own_at, n))
                own_at += n
            self.parts.append((at, prefix, owns))
            at += prefix
            segment = [s for s, n in enumerate(counts) for _ in range(n)]
            own_position = [i for n in counts for i in range(prefix, prefix + n)]
            positions += own_position
            if segment:
                owners.append(b)
                own_starts.append(at)
                segments.append(segment)
                own_positions.append(own_position)
            at += len(segment)
        self.positions = torch.tensor(positions, device=device)  # [N] each row's position
        span = torch.arange(max(prefixes), device=device)
        lens = torch.tensor(prefixes, device=device)
        # Prefix blocks [P, p_max]: rows past a prefix's end repeat its last (discarded).
        context = torch.tensor(starts, device=device)[:, None] + torch.minimum(
            span, lens[:, None] - 1
        )
        self.prefix_index, prefix_real = context, span < lens[:, None]
        kept = [context[prefix_real]]  # the real rows, in block order
        padded = [prefix_real.flatten().nonzero()[:, 0]]  # their places in the blocks
        # Own blocks [O, o_max]: each pack's rows after its prefix; their keys
        # [O, p_max + o_max] the pack's prefix rows, then the same rows.
        self.own_index: Tensor | None = None
        if owners:
            q = torch.arange(max(len(x) for x in segments), device=device)
            rows = torch.tensor([len(x) for x in segments], device=device)
            own_real = q < rows[:, None]
            self.own_index = torch.tensor(own_starts, device=device)[:, None] + torch.minimum(
                q, rows[:, None] - 1
            )
            self.key_index = torch.cat([context[owners], self.own_index], 1)
            kept.append(self.own_index[own_real])
            padded.append(context.numel() + own_real.flatten().nonzero()[:, 0])
            o_max = len(q)  # padding: segment -1, positions on after the last
            seg = torch.tensor([x + [-1] * (o_max - len(x)) for x in segments], device=device)
            pos = torch.tensor(
                [y + list(range(y[-1] + 1, y[-1] + 1 + o_max - len(y))) for y in own_positions],
                device=device,
            )
            # A row sees its pack's prefix and its own sequence's earlier rows.
            self.own_seen = torch.cat(
                [
                    (span < lens[owners][:, None])[:, None, :].expand(-1, len(q), -1),
                    (seg[:, None, :] == seg[:, :, None]) & (q[None, :] <= q[:, None]),
                ],
                2,
            )  # [O, o_max, p_max + o_max]
            k_pos = torch.cat([span.expand(len(owners), -1), pos], 1)
            self.own_distance = pos[:, :, None] - k_pos[:, None, :]
        # Each row's place among the blocks' rows (prefix blocks, then own blocks, flat).
        self.source = torch.cat(padded)[torch.cat(kept).argsort()]


class PackedView:
    """Attention over flat rows holding packs of sequences that share a prefix (see
    :meth:`Transformer.packed_hidden_states`) for one kind of layer (``window``: its
    sliding window, None: global), in two batched calls per layer rather than one under an
    ``[N, N]`` mask: each pack's prefix rows causally over themselves, then the rest of
    each pack's rows over its prefix rows and the rest, each sequence's rows seeing its own
    earlier ones only. No key is copied per sequence: the memory stays that of the rows.

    Stands in for a paged view as the layers' ``cache`` argument (``attend``,
    ``decode_rows``)."""

    def __init__(self, layout: PackedLayout, window: int | None, *, exact: bool = False) -> None:
        # exact: each prefix and each sequence's own rows attend in a call of their own,
        # under the masks of a prompt chunk (after the prefix), as the engine computes
        # that sequence's prompt: a backend's prompt kernel then rounds alike (the LoRA
        # trainer on the serving kernels); else two batched calls per layer.
        self.layout, self.window, self.exact = layout, window, exact
        if window is None:  # right padding: causal is right for the real rows
            self.prefix_mask = AttnMask(None, True)
        else:
            span = torch.arange(layout.prefix_index.shape[1], device=layout.positions.device)
            distance = span[:, None] - span[None, :]
            self.prefix_mask = AttnMask(((distance >= 0) & (distance < window))[None, None], False)
        self.own_mask: AttnMask | None = None
        if layout.own_index is not None:
            seen = layout.own_seen
            if window is not None:
                seen = seen & (layout.own_distance < window)
            self.own_mask = AttnMask(seen[:, None], False)

    def attend(
        self,
        layer: int,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        attend: Callable[[Tensor, Tensor, Tensor, AttnMask], Tensor],
    ) -> Tensor:
        """``q`` ``[1, H, N, D]``, ``k, v`` ``[1, Hkv, N, D]`` -> ``[1, H, N, D]``."""
        if self.exact:
            return self._attend_each(q, k, v, attend)
        q, k, v, layout = q[0], k[0], v[0], self.layout

        def blocks(x: Tensor, index: Tensor) -> Tensor:  # [heads, N, D] -> [B, heads, L, D]
            picked = x.index_select(1, index.flatten())  # (index_select: a cheap backward)
            return picked.view(x.shape[0], *index.shape, x.shape[-1]).transpose(0, 1)

        def rows(y: Tensor) -> Tensor:  # [B, heads, L, D] -> [heads, B * L, D]
            return y.transpose(0, 1).reshape(y.shape[1], -1, y.shape[-1])

        i = layout.prefix_index
        outs = [rows(attend(blocks(q, i), blocks(k, i), blocks(v, i), self.prefix_mask))]
        if layout.own_index is not None and self.own_mask is not None:
            i, j = layout.own_index, layout.key_index
            outs.append(rows(attend(blocks(q, i), blocks(k, j), blocks(v, j), self.own_mask)))
        return torch.cat(outs, 1).index_select(1, layout.source)[None]

    def _attend_each(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        attend: Callable[[Tensor, Tensor, Tensor, AttnMask], Tensor],
    ) -> Tensor:
        """:meth:`attend`, a call per prefix and per sequence's own rows (the prefix's keys
        then its own), each masked as a prompt chunk at its positions."""
        device, window = q.device, self.window
        outs = []
        for start, prefix, owns in self.layout.parts:
            end = start + prefix
            k_prefix, v_prefix = k[:, :, start:end], v[:, :, start:end]
            outs.append(
                attend(
                    q[:, :, start:end], k_prefix, v_prefix, build_mask(0, prefix, window, device)
                )
            )
            for first, count in owns:
                rows = slice(first, first + count)
                keys = torch.cat([k_prefix, k[:, :, rows]], 2)
                values = torch.cat([v_prefix, v[:, :, rows]], 2)
                mask = build_mask(prefix, count, window, device)
                outs.append(attend(q[:, :, rows], keys, values, mask))
        return torch.cat(outs, 2)

    def decode_rows(self, layer: int) -> PagedDecodeRows | None:
        """None: no decode kernel applies to a packed forward."""
        return None
