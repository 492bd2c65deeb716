"""Scheduler policies: which requests run in the next step, and how many tokens each.

The decision is plain data (:class:`SchedulerOutput`); the runner returns plain data
(:class:`RunnerOutput`); ``update_from_output`` applies it: token appended, EOS / stop
token / length checks, state changes, each sampled token reported with the finish it caused.
Stop *strings* need text: the engine's output stage finds them and hands them back through
``finish_requests``. A policy releases finished requests at its next ``schedule``.
"""

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from domain.config import EngineConfig
from domain.request import Request, is_stop_token, token_finish_reason


@dataclass(frozen=True)
class ScheduledChunk:
    """``num_tokens`` of ``request``'s tokens, from position ``start``, run this step."""

    request: Request
    start: int
    num_tokens: int

    @property
    def token_ids(self) -> list[int]:
        return self.request.token_ids_from(self.start, self.num_tokens)

    @property
    def samples(self) -> bool:
        """True when the chunk reaches the newest token, so the step samples a next one."""
        return self.start + self.num_tokens == self.request.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    # Requests whose runner state (KV slot, generator) can be freed now.
    released: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(frozen=True, slots=True)
class SampledToken:
    """A token a request got this step, and the finish it caused (None: runs on).
    ``stop_token``: it ended the request as an EOS / stop id, so it has no text."""

    request: Request
    token_id: int
    finish_reason: str | None
    stop_token: bool


@dataclass(frozen=True)
class RunnerOutput:
    """Per request id that sampled this step: its token (and the token's logprob)."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, float] = field(default_factory=dict)
    top_logprobs: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    # Per request id that asked for prompt logprobs: those of the prompt tokens this step's
    # chunk predicts (positions start+1 .. within the prompt), in order.
    prompt_logprobs: dict[str, list[float]] = field(default_factory=dict)
    prompt_top_logprobs: dict[str, list[list[tuple[int, float]]]] = field(default_factory=dict)


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


class _QueueingScheduler:
    """What every policy shares: a bounded FCFS waiting queue and output application.

    The bound is the engine's capacity, ``max_batch_size`` running plus
    ``max_waiting_requests`` waiting: a request may wait while a running slot is free
    (until the next step admits it), so a burst fills the free slots as well.
    """

    def __init__(self, config: EngineConfig, eos_token_ids: Iterable[int]) -> None:
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()

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
            request.prompt_logprobs.extend(result.prompt_logprobs.get(request.request_id, ()))
            request.prompt_top_logprobs.extend(
                result.prompt_top_logprobs.get(request.request_id, ())
            )
            token = result.sampled_token_ids.get(request.request_id)
            if chunk.samples and token is not None:
                sampled.append(self._append(request, token))
        return sampled

    def _append(self, request: Request, token: int) -> SampledToken:
        request.generated_token_ids.append(token)
        params, eos = request.sampling_params, self.eos_token_ids
        reason = token_finish_reason(params, eos, token, len(request.generated_token_ids))
        if reason is None:
            return SampledToken(request, token, None, False)
        request.finish(reason)
        return SampledToken(request, token, reason, is_stop_token(params, eos, token))

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


class StaticScheduler(_QueueingScheduler):
    """Seed 000 §3: a batch forms (bounded wait), runs until every member is done, clears."""

    def __init__(
        self,
        config: EngineConfig,
        eos_token_ids: Iterable[int] = (),
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        super().__init__(config, eos_token_ids)
        self.active: list[Request] = []
        self.clock = clock
        self._batch_wait_deadline: float | None = None

    def schedule(self) -> SchedulerOutput:
        if self.active and not all(r.is_done for r in self.active):
            return SchedulerOutput(chunks=_next_tokens(self.active))
        released = [r.request_id for r in self.active]
        self.active = []
        if not self.waiting:
            return SchedulerOutput(released=released)
        if self._batch_wait_deadline is None:
            self._batch_wait_deadline = self.clock() + self.config.batch_wait_timeout_s
        full = len(self.waiting) >= self.config.max_batch_size
        if not full and self.clock() < self._batch_wait_deadline:
            return SchedulerOutput(released=released)
        return SchedulerOutput(self._start_batch(), released)

    def _start_batch(self) -> list[ScheduledChunk]:
        self._batch_wait_deadline = None
        while self.waiting and len(self.active) < self.config.max_batch_size:
            self.active.append(self.waiting.popleft())
        return [ScheduledChunk(r, 0, r.num_prompt_tokens) for r in self.active]

    def _num_live(self) -> int:
        return sum(not r.is_done for r in self.active)

    def _live(self, request_id: str) -> Request | None:
        # An active request that ends early idles its row until the batch ends.
        return next((r for r in self.active if r.request_id == request_id), None)

    def has_work(self) -> bool:
        return bool(self.waiting) or any(not r.is_done for r in self.active)


class ContinuousScheduler(_QueueingScheduler):
    """Admits and retires requests every step, under a token budget and a running cap.

    Running requests go first (one decode token each, or the rest of a chunked prompt),
    then waiting ones are admitted FCFS while slots and budget last; a prompt larger than
    the remaining budget is prefilled in chunks over several steps.
    """

    def __init__(self, config: EngineConfig, eos_token_ids: Iterable[int] = ()) -> None:
        super().__init__(config, eos_token_ids)
        self.running: list[Request] = []

    def schedule(self) -> SchedulerOutput:
        released = [r.request_id for r in self.running if r.is_done]
        self.running = [r for r in self.running if not r.is_done]
        budget = self.config.max_num_batched_tokens
        chunks = []
        for request in self.running:
            chunk = _chunk(request, budget)
            if chunk is None:
                break
            chunks.append(chunk)
            budget -= chunk.num_tokens
        while self.waiting and len(self.running) < self.config.max_batch_size and budget > 0:
            request = self.waiting.popleft()
            self.running.append(request)
            chunk = _chunk(request, budget)
            assert chunk is not None, "budget > 0 and a non-empty prompt always give a chunk"
            chunks.append(chunk)
            budget -= chunk.num_tokens
        return SchedulerOutput(chunks, released)

    def _num_live(self) -> int:
        return sum(not r.is_done for r in self.running)

    def _live(self, request_id: str) -> Request | None:
        return next((r for r in self.running if r.request_id == request_id), None)

    def has_work(self) -> bool:
        return bool(self.waiting) or bool(self.running)


def _chunk(request: Request, budget: int) -> ScheduledChunk | None:
    remaining = request.num_tokens - request.num_computed_tokens
    count = min(remaining, budget)
    return ScheduledChunk(request, request.num_computed_tokens, count) if count > 0 else None


def _next_tokens(batch: list[Request]) -> list[ScheduledChunk]:
    """Static batching after prefill: the newest token of every unfinished request."""
    return [
        ScheduledChunk(r, r.num_computed_tokens, r.num_tokens - r.num_computed_tokens)
        for r in batch
        if not r.is_done
    ]


def make_scheduler(config: EngineConfig, eos_token_ids: Iterable[int]) -> Scheduler:
    if config.batching_mode == "static":
        return StaticScheduler(config, eos_token_ids)
    return ContinuousScheduler(config, eos_token_ids)
