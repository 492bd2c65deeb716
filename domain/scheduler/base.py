"""The scheduler interface and what every policy shares: a bounded waiting queue, the KV
block manager, and applying the runner's output (token stops decided here, once)."""

import math
from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import Protocol, TypeVar

from domain.config import EngineConfig
from domain.kv_blocks import BlockHash, BlockManager
from domain.kv_events import KVEvent
from domain.request import Request, is_stop_token, token_finish_reason
from domain.scheduler.outputs import (
    KVStats,
    RunnerOutput,
    SampledToken,
    ScheduledChunk,
    SchedulerOutput,
)


class Scheduler(Protocol):
    def room(self) -> int:
        """Requests that can be added now: capacity (running + waiting) minus those held."""
        ...

    def add_request(self, request: Request) -> bool: ...
    def schedule(self) -> SchedulerOutput: ...
    def update_from_output(
        self, output: SchedulerOutput, result: RunnerOutput
    ) -> list[SampledToken]: ...
    def finish_requests(self, request_ids: Iterable[str], reason: str) -> list[Request]:
        """End requests not done yet (``abort``, or ``stop`` for a stop string the output
        stage found); waiting ones leave the queue, running ones free their slot at the
        next ``schedule``. Returns those ended."""
        ...

    def abort(self, request_id: str) -> Request | None: ...
    def has_work(self) -> bool: ...
    def counts(self) -> tuple[int, int]:
        """(running, waiting): requests holding a batch slot, requests queued for one."""
        ...

    def kv_stats(self) -> KVStats: ...

    def take_evicted(self) -> list[BlockHash]:
        """The prefix cache's blocks evicted since the last call, by hash."""
        ...

    def take_kv_events(self) -> list[KVEvent]:
        """vLLM's KV cache events since the last call (``kv_events_config``)."""
        ...

    def adapters(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The LoRA adapters of the running requests, then of the waiting ones (each once,
        sorted; the base model is none)."""
        ...


class WaitingQueue(Protocol):
    """The waiting requests, however a policy orders them."""

    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...
    def append(self, request: Request) -> None: ...
    def remove(self, request: Request) -> None: ...


class QueueingScheduler:
    """What every policy shares: a bounded waiting queue and output application.

    The bound is the engine's capacity, ``max_num_seqs`` running plus
    ``max_waiting_requests`` waiting: a request may wait while a running slot is free
    (until the next step admits it), so a burst fills the free slots as well.
    """

    waiting: WaitingQueue

    def __init__(
        self, config: EngineConfig, eos_token_ids: Iterable[int], *, prefix_caching: bool
    ) -> None:
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        events = config.kv_events_config
        self.blocks = BlockManager(
            config.kv_blocks,
            config.kv_block_size,
            enable_caching=prefix_caching,
            record_events=events is not None and events.recording,
        )

    def kv_stats(self) -> KVStats:
        blocks = self.blocks
        return KVStats(
            blocks.usage,
            blocks.prefix_queried_tokens,
            blocks.prefix_hit_tokens,
            blocks.num_cached_blocks / blocks.num_blocks,
        )

    def take_evicted(self) -> list[BlockHash]:
        return self.blocks.take_evicted()

    def take_kv_events(self) -> list[KVEvent]:
        return self.blocks.take_events()

    def adapters(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        running = {r.adapter_id for r in self._running() if not r.is_done}
        waiting = {r.adapter_id for r in self.waiting}
        return (
            tuple(sorted(a for a in running if a is not None)),
            tuple(sorted(a for a in waiting if a is not None)),
        )

    def _running(self) -> Iterable[Request]:
        """The requests admitted to the batch."""
        raise NotImplementedError

    def _table(self, chunk: ScheduledChunk) -> ScheduledChunk:
        """``chunk`` with its request's block table (the blocks its positions need)."""
        table = self.blocks.block_table(chunk.request.request_id)
        needed = self.blocks.num_blocks_for(chunk.start + chunk.num_rows)
        return replace(chunk, block_table=tuple(table[:needed]))

    def room(self) -> int:
        return self.config.capacity - len(self.waiting) - self._num_live()

    def _num_live(self) -> int:
        """Requests admitted to the batch and not done."""
        raise NotImplementedError

    def add_request(self, request: Request) -> bool:
        """Queue ``request``; False when the engine is full (the caller answers 503)."""
        if self.room() < 1:
            return False
        self.waiting.append(request)
        return True

    def update_from_output(
        self, output: SchedulerOutput, result: RunnerOutput
    ) -> list[SampledToken]:
        """Advance every scheduled request; returns the tokens sampled this step."""
        sampled = []
        for chunk in output.chunks:
            request = chunk.request
            if request.is_done:  # aborted or failed while the step ran
                continue
            request.num_computed_tokens = chunk.start + chunk.num_tokens
            # The chunk's prompt logprobs are those of positions start + 1 ..; a recomputed
            # chunk (after a preemption) has its first ones already.
            rid, start = request.request_id, chunk.start
            _extend(request.prompt_logprobs, result.prompt_logprobs.get(rid), start, math.nan)
            _extend(request.prompt_top_logprobs, result.prompt_top_logprobs.get(rid), start, [])
            _extend(request.prompt_ranks, result.prompt_ranks.get(rid), start, 0)
            targets = result.prompt_target_logprobs.get(rid)
            _extend(request.prompt_target_logprobs, targets, start, [])
            _extend(request.prompt_samples, result.prompt_samples.get(rid), start, [])
            token = result.sampled_token_ids.get(request.request_id)
            if chunk.samples and token is not None:
                request.num_draws += chunk.num_rows - chunk.num_tokens + 1
                sampled += self._append_all(chunk, result, token)
        return sampled

    def _append_all(
        self, chunk: ScheduledChunk, result: RunnerOutput, token: int
    ) -> list[SampledToken]:
        """The step's tokens of a sampling chunk: its accepted drafts (their KV is computed
        now), then the token sampled after them; those after a finish are dropped."""
        request, rid = chunk.request, chunk.request.request_id
        accepted = result.accepted.get(rid, []) if chunk.drafts else []
        request.num_drafted += len(chunk.drafts)
        request.num_accepted += len(accepted)
        request.num_computed_tokens += len(accepted)
        logprobs = [*result.accepted_logprobs.get(rid, ()), result.logprobs.get(rid)]
        top = [*result.accepted_top_logprobs.get(rid, ()), result.top_logprobs.get(rid)]
        tokens = []
        for i, token_id in enumerate([*accepted, token]):
            scores = top[i] if i < len(top) else None
            tokens.append(
                self._append(
                    request,
                    token_id,
                    logprobs[i] if i < len(logprobs) else None,
                    tuple(scores) if scores else None,
                )
            )
            if request.is_done:
                break
        return tokens

    def _append(
        self,
        request: Request,
        token: int,
        logprob: float | None = None,
        top: tuple[tuple[int, float], ...] | None = None,
    ) -> SampledToken:
        request.generated_token_ids.append(token)
        params, eos = request.sampling_params, self.eos_token_ids
        index = len(request.generated_token_ids)
        reason = token_finish_reason(params, eos, token, index)
        if reason is None:
            return SampledToken(request, token, None, False, index - 1, logprob, top)
        request.finish(reason)
        stop = is_stop_token(params, eos, token)
        return SampledToken(request, token, reason, stop, index - 1, logprob, top)

    def finish_requests(self, request_ids: Iterable[str], reason: str) -> list[Request]:
        ended = []
        for request_id in request_ids:
            request = self._remove_waiting(request_id) or self._live(request_id)
            if request is not None and not request.is_done:
                request.finish(reason)
                ended.append(request)
        return ended

    def abort(self, request_id: str) -> Request | None:
        """Drop a waiting request, or finish a running one (its slot frees next step)."""
        ended = self.finish_requests([request_id], "abort")
        return ended[0] if ended else None

    def counts(self) -> tuple[int, int]:
        return self._num_live(), len(self.waiting)

    def _live(self, request_id: str) -> Request | None:
        """The admitted request with this id (done or not)."""
        raise NotImplementedError

    def _remove_waiting(self, request_id: str) -> Request | None:
        for request in self.waiting:
            if request.request_id == request_id:
                self.waiting.remove(request)
                return request
        return None


T = TypeVar("T")


def _extend(known: list[T], computed: list[T] | None, start: int, missing: T) -> None:
    """Append the per-position values a chunk starting at ``start`` computed (positions
    ``start + 1`` ..) that ``known`` lacks (a recomputed chunk's first ones it has); the
    positions before it that ran from the prefix cache hold ``missing`` (shared: never
    mutated)."""
    if computed:
        known.extend([missing] * (start - len(known)))
        known.extend(computed[max(0, len(known) - start) :])
