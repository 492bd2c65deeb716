"""The decode step as CUDA graphs, one per padded batch size (nano-vllm's and vLLM's way).

A decode step of ``R`` rows on a GPU is launch-bound when run eagerly (hundreds of small
kernels, each launched from Python). Here the model's decode forward is captured once per
size ``b`` of :data:`SIZES` up to the engine's ``max_num_seqs``, over static input
buffers; a step of ``R`` rows copies its inputs (tokens, positions, KV slots, block tables)
into the buffers of the smallest ``b >= R`` with one host-to-device copy, replays that
graph and reads the first ``R`` rows of its logits. The ``b - R`` padding rows run on a
scratch block beyond the scheduler's pool (token 0 at position 0, its KV written there).

Only decode-only steps replay (no prompt chunk, no LoRA adapter, no prompt logprobs); every
other step, and every step with ``enforce_eager``, runs the eager forward. Sampling runs
after the graph, eagerly, on its logits. The attention inside is the Triton paged decode
kernel (:mod:`adapters.torch.cuda.paged_attention`), which reads a row's keys through its
block table up to its length, so one graph serves every sequence length.
"""

from collections.abc import Callable

import structlog
import torch
from torch import Tensor

from adapters.torch.models.layers import PagedBatch
from adapters.torch.models.paged_kv import PagedKVCache
from adapters.torch.models.transformer import Transformer

log = structlog.get_logger(__name__)

# Padded batch sizes captured (vLLM's list, up to 512), up to the engine's max_num_seqs.
SIZES = (1, 2, 4, 8, *range(16, 513, 16))


def graph_sizes(max_rows: int) -> list[int]:
    """The padded sizes for steps of at most ``max_rows`` rows (``max_rows`` itself last
    when it is not on the list)."""
    sizes = [b for b in SIZES if b < max_rows]
    return [*sizes, min(max_rows, SIZES[-1])]


class DecodeGraphs:
    """Replays of the decode forward at padded batch sizes; see the module's doc.

    ``scratch_block``: a block of ``cache`` no request owns (padding rows write there).
    ``capture`` False runs the same static-buffer forward eagerly (a CPU, or a test)."""

    def __init__(
        self,
        model: Transformer,
        cache: PagedKVCache,
        max_rows: int,
        max_blocks: int,
        scratch_block: int,
        *,
        capture: bool = True,
    ) -> None:
        self.model, self.cache, self.scratch = model, cache, scratch_block
        self.sizes = graph_sizes(max_rows)
        self.max_rows, self.max_blocks = self.sizes[-1], max_blocks
        device = cache.k.device
        # One int64 row per padded row: token, position, slot, then the block table.
        self.width = 3 + max_blocks
        self.inputs = torch.empty((self.max_rows, self.width), dtype=torch.long, device=device)
        self.host = torch.empty(
            (self.max_rows, self.width), dtype=torch.long, pin_memory=device.type == "cuda"
        )
        self._padding = [0, 0, scratch_block * cache.block_size] + [scratch_block] * max_blocks
        self.inputs.copy_(torch.tensor([self._padding] * self.max_rows, dtype=torch.long))
        self.outputs: dict[int, Tensor] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.steps = 0  # decode steps run here (replayed, or eager without capture)
        if capture:
            self._capture()

    def covers(self, tables: list[list[int]]) -> bool:
        """A step of these rows' block tables fits the captured buffers."""
        return 0 < len(tables) <= self.max_rows and max(map(len, tables)) <= self.max_blocks

    def forward(self, tokens: list[int], tables: list[list[int]], positions: list[int]) -> Tensor:
        """Logits ``[R, vocab]`` of ``R`` decode rows (each row's next token at its
        position, read through its block table)."""
        rows = len(tokens)
        size = next(b for b in self.sizes if b >= rows)
        block_size, width = self.cache.block_size, self.max_blocks
        data = [
            [token, position, table[position // block_size] * block_size + position % block_size]
            + table
            + [self.scratch] * (width - len(table))
            for token, table, position in zip(tokens, tables, positions, strict=True)
        ]
        data.extend([self._padding] * (size - rows))
        host = self.host[:size]
        host.copy_(torch.tensor(data, dtype=torch.long))
        self.inputs[:size].copy_(host, non_blocking=True)
        self.steps += 1
        graph = self.graphs.get(size)
        if graph is None:
            return self._run(size)[:rows]
        graph.replay()
        return self.outputs[size][:rows]

    def _run(self, size: int) -> Tensor:
        inputs = self.inputs[:size]
        batch = PagedBatch.decode_only(
            self.cache, inputs[:, 1], inputs[:, 2], inputs[:, 3:], self.model.windows()
        )
        rows = torch.arange(size, device=inputs.device)
        return self.model.forward_mixed(inputs[:, 0], batch, rows)

    def _capture(self) -> None:
        """Warm each size up on a side stream (Triton compiles there), then capture it,
        largest first, into one memory pool."""
        pool = None
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        with torch.inference_mode():
            for size in reversed(self.sizes):
                _warm_up(self._run, size)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[size] = self._run(size)
                pool = graph.pool()
                self.graphs[size] = graph
        end.record()
        end.synchronize()
        log.info(
            "CUDA graphs captured",
            sizes=len(self.sizes),
            max_batch=self.max_rows,
            seconds=round(start.elapsed_time(end) / 1000, 2),
        )


def _warm_up(run: Callable[[int], Tensor], size: int) -> None:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            run(size)
    torch.cuda.current_stream().wait_stream(stream)
