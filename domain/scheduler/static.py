"""The static policy: FCFS batches that run until every member is done."""

import time
from collections import deque
from collections.abc import Callable, Iterable

from domain.config import EngineConfig
from domain.request import Request
from domain.scheduler.base import QueueingScheduler
from domain.scheduler.outputs import ScheduledChunk, SchedulerOutput


class StaticScheduler(QueueingScheduler):
    """A batch forms (bounded wait), runs until every member is done, clears.

    Batches form FCFS: tenants and priorities (``request.context``) are ignored and nothing
    is preempted. Each member reserves KV blocks for ``max_model_len`` positions when its
    batch starts (the batch stops growing when blocks run out) and frees them when it ends.
    ``clock``: what the bounded wait (``batch_wait_timeout``) is measured on, the
    engine's.
    """

    def __init__(
        self,
        config: EngineConfig,
        eos_token_ids: Iterable[int] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(config, eos_token_ids, prefix_caching=False)
        self.waiting: deque[Request] = deque()
        self.active: list[Request] = []
        self.clock = clock
        self._batch_wait_deadline: float | None = None

    def schedule(self) -> SchedulerOutput:
        if self.active and not all(r.is_done for r in self.active):
            chunks = [self._table(c) for c in _next_tokens(self.active)]
            return SchedulerOutput(chunks, eos_token_ids=self.eos_token_ids)
        released = [r.request_id for r in self.active]
        for request_id in released:
            self.blocks.free(request_id)
        self.active = []
        if not self.waiting:
            return SchedulerOutput(released=released)
        if self._batch_wait_deadline is None:
            self._batch_wait_deadline = self.clock() + self.config.batch_wait_timeout
        full = len(self.waiting) >= self.config.max_num_seqs
        if not full and self.clock() < self._batch_wait_deadline:
            return SchedulerOutput(released=released)
        return SchedulerOutput(self._start_batch(), released, eos_token_ids=self.eos_token_ids)

    def _start_batch(self) -> list[ScheduledChunk]:
        self._batch_wait_deadline = None
        seq_len = self.config.max_model_len
        while self.waiting and len(self.active) < self.config.max_num_seqs:
            if self.blocks.allocate(self.waiting[0].request_id, seq_len) is None:
                break
            self.active.append(self.waiting.popleft())
        return [self._table(ScheduledChunk(r, 0, r.num_prompt_tokens)) for r in self.active]

    def _num_live(self) -> int:
        return sum(not r.is_done for r in self.active)

    def _running(self) -> list[Request]:
        return self.active

    def _live(self, request_id: str) -> Request | None:
        # An active request that ends early idles its row until the batch ends.
        return next((r for r in self.active if r.request_id == request_id), None)

    def has_work(self) -> bool:
        return bool(self.waiting) or any(not r.is_done for r in self.active)


def _next_tokens(batch: list[Request]) -> list[ScheduledChunk]:
    """Static batching after prefill: the newest token of every unfinished request."""
    return [
        ScheduledChunk(r, r.num_computed_tokens, r.num_tokens - r.num_computed_tokens)
        for r in batch
        if not r.is_done
    ]
