"""Scheduler policies: which requests run in the next step, and how many tokens each.

The decision is plain data (:class:`SchedulerOutput`); the runner returns plain data
(:class:`RunnerOutput`); ``update_from_output`` applies it: token appended, EOS / stop
token / length checks, state changes, each sampled token reported with the finish it caused.
Stop *strings* need text: the engine's output stage finds them and hands them back through
``finish_requests``. A policy releases finished requests at its next ``schedule``.

The continuous policy is fair across tenants (weighted fair queuing on tokens scheduled)
and honours ``request.context.priority``, preempting lower-priority requests when the batch
is full; the static policy is FCFS.

KV memory is paged (:mod:`domain.kv_blocks`): each policy owns a :class:`BlockManager`, and
every scheduled chunk carries its request's block table for the runner. The continuous
policy admits and grows requests by free blocks, reuses cached prefixes (prefix caching)
and preempts when blocks run out; the static policy reserves ``max_seq_len`` positions per
request of a batch (no prefix caching).
"""

import math
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Protocol

from domain.config import EngineConfig
from domain.errors import InvalidParameterError
from domain.kv_blocks import BlockManager, CachedPrefix
from domain.request import Request, is_stop_token, token_finish_reason


@dataclass(frozen=True)
class ScheduledChunk:
    """``num_tokens`` of ``request``'s tokens, from position ``start``, run this step.

    ``block_table``: the request's KV blocks, in order, covering positions ``[0, start +
    num_tokens)`` (position ``p`` in block ``p // block_size``); positions before ``start``
    hold computed KV (its own, a cached prefix's or a sibling choice's, shared)."""

    request: Request
    start: int
    num_tokens: int
    block_table: tuple[int, ...] = ()

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
    # Requests whose runner state (generator, grammar matcher) can be freed now; their KV
    # blocks are the scheduler's, freed already.
    released: list[str] = field(default_factory=list)
    # Requests put back to the waiting queue this step (also in ``released``): when
    # admitted again they start over at position 0 (prompt and generated tokens recomputed).
    preempted: list[str] = field(default_factory=list)
    # The tokenizer's EOS ids: what the runner masks out (with each request's stop ids)
    # while a request has generated fewer than its ``min_tokens``.
    eos_token_ids: frozenset[int] = frozenset()

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(frozen=True, slots=True)
class KVStats:
    """The KV block pool: the fraction referenced by requests, and the prefix cache's
    cumulative counters (tokens of admitted requests looked up, of those found cached)."""

    usage: float
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0


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

    def kv_stats(self) -> KVStats: ...


class _WaitingQueue(Protocol):
    """The waiting requests, however a policy orders them."""

    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...
    def append(self, request: Request) -> None: ...
    def remove(self, request: Request) -> None: ...


class _QueueingScheduler:
    """What every policy shares: a bounded waiting queue and output application.

    The bound is the engine's capacity, ``max_batch_size`` running plus
    ``max_waiting_requests`` waiting: a request may wait while a running slot is free
    (until the next step admits it), so a burst fills the free slots as well.
    """

    waiting: _WaitingQueue

    def __init__(
        self, config: EngineConfig, eos_token_ids: Iterable[int], *, prefix_caching: bool
    ) -> None:
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.blocks = BlockManager(
            config.kv_blocks, config.kv_block_size, enable_caching=prefix_caching
        )

    def kv_stats(self) -> KVStats:
        blocks = self.blocks
        return KVStats(blocks.usage, blocks.prefix_queried_tokens, blocks.prefix_hit_tokens)

    def _table(self, chunk: ScheduledChunk) -> ScheduledChunk:
        """``chunk`` with its request's block table (the blocks its positions need)."""
        table = self.blocks.block_table(chunk.request.request_id)
        needed = self.blocks.num_blocks_for(chunk.start + chunk.num_tokens)
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
            known = max(0, len(request.prompt_logprobs) - chunk.start)
            request.prompt_logprobs.extend(
                result.prompt_logprobs.get(request.request_id, [])[known:]
            )
            known = max(0, len(request.prompt_top_logprobs) - chunk.start)
            request.prompt_top_logprobs.extend(
                result.prompt_top_logprobs.get(request.request_id, [])[known:]
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
    """Seed 000 §3: a batch forms (bounded wait), runs until every member is done, clears.

    Batches form FCFS: tenants and priorities (``request.context``) are ignored and nothing
    is preempted. Each member reserves KV blocks for ``max_seq_len`` positions when its
    batch starts (the batch stops growing when blocks run out) and frees them when it ends.
    """

    def __init__(
        self,
        config: EngineConfig,
        eos_token_ids: Iterable[int] = (),
        clock: Callable[[], float] = time.perf_counter,
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
            self._batch_wait_deadline = self.clock() + self.config.batch_wait_timeout_s
        full = len(self.waiting) >= self.config.max_batch_size
        if not full and self.clock() < self._batch_wait_deadline:
            return SchedulerOutput(released=released)
        return SchedulerOutput(self._start_batch(), released, eos_token_ids=self.eos_token_ids)

    def _start_batch(self) -> list[ScheduledChunk]:
        self._batch_wait_deadline = None
        seq_len = self.config.max_seq_len
        while self.waiting and len(self.active) < self.config.max_batch_size:
            if self.blocks.allocate(self.waiting[0].request_id, seq_len) is None:
                break
            self.active.append(self.waiting.popleft())
        return [self._table(ScheduledChunk(r, 0, r.num_prompt_tokens)) for r in self.active]

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
    then waiting ones are admitted while slots and budget last; a prompt larger than the
    remaining budget is prefilled in chunks over several steps.

    Fairness (``request.context``; a tenant id of None is one tenant of its own):

    - admission: the highest ``priority`` first; among equal priorities, the tenant with
      the least *virtual time* (tokens scheduled for it divided by its weight, as in
      weighted fair queuing); FCFS within a tenant. A tenant that becomes active starts at
      the system's virtual time (the least of the active tenants'), so idling banks no
      credit, and keeps a debt it ran up. One tenant with one priority is plain FCFS.
    - the token budget: when it cannot cover every running request's chunk, running
      requests take it in the same order (priority, then tenant virtual time).
    - preemption: with the batch full, a waiting request of strictly higher priority than
      a running one takes the slot of the youngest (latest arrival) of the lowest-priority
      running requests. That request goes back to the front of its tenant's queue with its
      runner state and KV blocks released; admitted again, it prefills its prompt and the
      tokens it generated so far (recompute; from its cached prefix when its blocks are
      still cached), then goes on generating.

    KV blocks: a request is admitted when blocks for its first chunk are free (after its
    cached prefix: ``num_computed_tokens`` starts there; requests asking for prompt
    logprobs run every position); each step's chunk allocates its growth. When the blocks
    run out, the youngest of the lowest-priority running requests is preempted (the
    growing request itself when it is that one), and an admission preempts only running
    requests of lower priority. Blocks are committed (named for prefix reuse) after each
    step, freed when a request ends or is preempted; ``n`` > 1 choices fork the first
    choice's full prompt blocks, and so does a request admitted while a running one
    computes its very prompt (in-flight sharing, with prefix caching on).

    Weights: ``tenant_weights`` here or :meth:`set_tenant_weights` (default 1.0).
    """

    def __init__(
        self,
        config: EngineConfig,
        eos_token_ids: Iterable[int] = (),
        *,
        tenant_weights: Mapping[str, float] | None = None,
    ) -> None:
        super().__init__(config, eos_token_ids, prefix_caching=config.enable_prefix_caching)
        self.waiting: _FairQueue = _FairQueue()
        self.running: list[Request] = []
        self._running_priorities: Counter[int] = Counter()
        self._weights: dict[str, float] = {}
        self._vtime: dict[str | None, float] = {}  # tenant -> tokens scheduled / weight
        self._active: dict[str | None, int] = {}  # tenant -> its requests waiting or running
        self._vclock = 0.0  # the system's virtual time: the least active one, kept when idle
        self._budget = 0  # tokens left in the step being scheduled
        self.set_tenant_weights(tenant_weights or {})

    def set_tenant_weights(self, weights: Mapping[str, float]) -> None:
        """Each tenant's share of tokens under contention, relative to the others' (tenants
        not named here, and the None tenant, weigh 1.0). Replaces the previous weights;
        service already counted stays counted. A weight must be a positive finite number."""
        for tenant, weight in weights.items():
            if not (math.isfinite(weight) and weight > 0):
                raise InvalidParameterError(
                    "tenant_weights", f"tenant {tenant!r}: {weight} is not a positive number"
                )
        self._weights = dict(weights)

    def tenant_weight(self, tenant_id: str | None) -> float:
        return 1.0 if tenant_id is None else self._weights.get(tenant_id, 1.0)

    def virtual_time(self, tenant_id: str | None) -> float:
        """The tenant's weighted service so far (tokens scheduled / weight)."""
        return self._vtime.get(tenant_id, 0.0)

    def add_request(self, request: Request) -> bool:
        if not super().add_request(request):
            return False
        self._activate(request.context.tenant_id)
        return True

    def schedule(self) -> SchedulerOutput:
        released = []
        for request in self.running:
            if request.is_done:
                released.append(request.request_id)
                self.blocks.free(request.request_id)
                self._running_priorities[request.context.priority] -= 1
                self._deactivate(request.context.tenant_id)
        if released:
            self.running = [r for r in self.running if not r.is_done]
            self._running_priorities = +self._running_priorities  # drop zero counts
        preempted = self._preempt()
        self._budget = self.config.max_num_batched_tokens
        chunks: dict[str, ScheduledChunk] = {}  # request id -> its chunk, in schedule order
        for request in self._budget_order(self._budget):
            if self._budget == 0:
                break
            if request.request_id not in preempted:  # not a victim of this step
                self._add_chunk(chunks, request, preempted)
        while self.waiting and len(self.running) < self.config.max_batch_size and self._budget:
            request = self.waiting.pop_next(self.virtual_time)
            if not self._admit(request, chunks, preempted):
                self.waiting.requeue(request)
                break
        released += preempted
        return SchedulerOutput(list(chunks.values()), released, preempted, self.eos_token_ids)

    def update_from_output(
        self, output: SchedulerOutput, result: RunnerOutput
    ) -> list[SampledToken]:
        sampled = super().update_from_output(output, result)
        if self.blocks.enable_caching:  # name the blocks this step filled, for reuse
            size = self.blocks.block_size
            for chunk in output.chunks:
                request, end = chunk.request, chunk.start + chunk.num_tokens
                if end // size > chunk.start // size and request.request_id in self.blocks:
                    self.blocks.commit(request.request_id, request.token_ids_from(0, end), end)
        return sampled

    def _admit(
        self, request: Request, chunks: dict[str, ScheduledChunk], preempted: list[str]
    ) -> bool:
        """Start running ``request`` (its first chunk scheduled, if it has one now); False
        when its first chunk's blocks cannot be had (it holds none)."""
        if not self._add_chunk(chunks, request, preempted, admitting=True):
            self.blocks.free(request.request_id)  # a fork's shared blocks
            request.num_computed_tokens = 0
            return False
        self.running.append(request)
        self._running_priorities[request.context.priority] += 1
        return True

    def _cached_prefix(self, request: Request) -> CachedPrefix:
        """The cached blocks ``request`` can start from (none when it needs prompt
        logprobs: those positions must run)."""
        if request.sampling_params.prompt_logprobs:
            return CachedPrefix()
        tokens = request.token_ids_from(0, request.num_tokens)
        return self.blocks.find_cached_prefix(tokens, _cache_namespace(request))

    def _add_chunk(
        self,
        chunks: dict[str, ScheduledChunk],
        request: Request,
        preempted: list[str],
        *,
        admitting: bool = False,
    ) -> bool:
        """Schedule ``request``'s chunk for this step (the budget > 0), if it has one, its
        blocks allocated: a request without blocks starts from its cached prefix; when
        blocks run out, running requests are preempted (``request`` itself when it is the
        victim). ``admitting``: ``request`` is not running yet and preempts only requests
        of lower priority; False when that does not free enough."""
        prefix = None
        chunk = self._shared_prefill(request)
        if chunk is None and request.prefill_source_id is None:
            if request.request_id not in self.blocks:
                prefix = self._cached_prefix(request)
                request.num_computed_tokens = prefix.num_tokens
                if admitting and self._join_prefill(request, prefix):
                    return True  # waits for the same prompt's prefill, then forks it
            chunk = _chunk(request, self._budget)
        if chunk is None and prefix is None:
            return True  # a choice waiting for its source's prefill
        end = chunk.start + chunk.num_tokens if chunk else request.num_computed_tokens
        adapter_id, blocks = _cache_namespace(request), self.blocks
        while (
            blocks.allocate(request.request_id, end, adapter_id=adapter_id, prefix=prefix) is None
        ):
            victim = self._victim()
            if admitting and (
                victim is None or victim.context.priority >= request.context.priority
            ):
                return False
            assert victim is not None  # request itself is running
            self._evict(victim, chunks, preempted)
            if victim is request:
                return True
        if chunk is not None:
            chunks[request.request_id] = self._table(chunk)
            self._charge(request, chunk.num_tokens)
            self._budget -= chunk.num_tokens
        return True

    def _evict(
        self, victim: Request, chunks: dict[str, ScheduledChunk], preempted: list[str]
    ) -> None:
        """Preempt ``victim`` for its KV blocks (its chunk this step, if any, unscheduled)."""
        chunk = chunks.pop(victim.request_id, None)
        if chunk is not None:
            self._budget += chunk.num_tokens
        self._requeue(victim)
        preempted.append(victim.request_id)

    def _join_prefill(self, request: Request, prefix: CachedPrefix) -> bool:
        """In-flight prefix sharing (with prefix caching on): a request whose whole prompt
        a running request is computing right now (the same tokens, adapter and cache salt:
        Tinker's ``num_samples``, a burst of one prompt) waits for that prefill and forks
        its blocks, as ``n`` > 1 choices do (:meth:`_shared_prefill`), instead of computing
        the prompt again beside it. True when it was linked (it holds no blocks)."""
        if not self.blocks.enable_caching or request.sampling_params.prompt_logprobs:
            return False
        start, size = request.num_prompt_tokens - 1, self.blocks.block_size
        if start // size * size <= prefix.num_tokens:
            return False  # no full block to gain beyond what is cached
        prompt, namespace = request.prompt_token_ids, _cache_namespace(request)
        for source in self.running:
            if (
                source.num_prompt_tokens == request.num_prompt_tokens
                and source.num_computed_tokens < start
                and source.prefill_source_id is None
                and not source.is_done
                and source.request_id in self.blocks
                and source.prompt_token_ids == prompt
                and _cache_namespace(source) == namespace
            ):
                request.prefill_source_id = source.request_id
                request.num_computed_tokens = 0
                return True
        return False

    def _shared_prefill(self, request: Request) -> ScheduledChunk | None:
        """A choice sharing another's prefill (``prefill_source_id``): once the source
        computed the prompt's first ``num_prompt_tokens - 1`` positions, this request forks
        its full blocks among them and runs the rest (None meanwhile: it waits). When the
        source cannot serve (done, or not running: it was preempted), the link is dropped
        and the request prefills itself."""
        source_id = request.prefill_source_id
        if source_id is None:
            return None
        source = self._live(source_id)
        if source is None or source.is_done:
            request.prefill_source_id = None
            return None
        start = request.num_prompt_tokens - 1
        if source.num_computed_tokens < start:
            return None
        request.prefill_source_id = None  # forked once; a recompute prefills itself
        request.num_computed_tokens = self.blocks.fork(source_id, request.request_id, start)
        return _chunk(request, self._budget)

    def _budget_order(self, budget: int) -> list[Request]:
        """Running requests in the order they take the step's budget: admission order when
        it covers them all, else by priority then tenant virtual time (stable)."""
        needed = sum(r.num_tokens - r.num_computed_tokens for r in self.running)
        if needed <= budget:
            return list(self.running)  # a copy: preemption removes running requests
        return sorted(
            self.running,
            key=lambda r: (-r.context.priority, self.virtual_time(r.context.tenant_id)),
        )

    def _preempt(self) -> list[str]:
        """Free batch slots for waiting requests of higher priority than running ones."""
        if not self.waiting or not self.running:
            return []
        free = self.config.max_batch_size - len(self.running)
        preempted: list[str] = []
        for priority, count in self.waiting.priority_counts():  # highest first
            if priority <= min(self._running_priorities, default=priority):
                break  # nothing running has a lower priority
            if count <= free:
                free -= count
                continue
            for _ in range(count - free):
                victim = self._victim()
                if victim is None or victim.context.priority >= priority:
                    return preempted
                self._requeue(victim)
                preempted.append(victim.request_id)
            free = 0
        return preempted

    def _victim(self) -> Request | None:
        """The youngest of the lowest-priority running requests (the latest admitted among
        equal arrival times)."""
        if not self.running:
            return None
        lowest = min(r.context.priority for r in self.running)
        _, victim = max(
            ((i, r) for i, r in enumerate(self.running) if r.context.priority == lowest),
            key=lambda pair: (pair[1].arrival_time_s, pair[0]),
        )
        return victim

    def _requeue(self, request: Request) -> None:
        """Preempt a running request: its tokens so far are recomputed when readmitted."""
        self.blocks.free(request.request_id)
        self.running.remove(request)
        self._running_priorities[request.context.priority] -= 1
        self._running_priorities = +self._running_priorities
        request.num_recompute_tokens = request.num_tokens
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.requeue(request)

    def _charge(self, request: Request, tokens: int) -> None:
        tenant = request.context.tenant_id
        self._vtime[tenant] = self.virtual_time(tenant) + tokens / self.tenant_weight(tenant)

    def _activate(self, tenant: str | None) -> None:
        count = self._active.get(tenant, 0)
        if count == 0:  # newly active: no credit for the time it was idle
            self._vtime[tenant] = max(self.virtual_time(tenant), self._system_vtime())
        self._active[tenant] = count + 1

    def _deactivate(self, tenant: str | None) -> None:
        count = self._active.get(tenant, 0) - 1
        if count > 0:
            self._active[tenant] = count
            return
        vclock = self._system_vtime()  # with this tenant still counted as active
        self._active.pop(tenant, None)
        if len(self._vtime) > 2 * len(self._active) + 64:  # forget idle tenants without debt
            self._vtime = {t: v for t, v in self._vtime.items() if t in self._active or v > vclock}

    def _system_vtime(self) -> float:
        """The least virtual time of the active tenants (monotone; kept while none is)."""
        if self._active:
            least = min(self.virtual_time(t) for t in self._active)
            self._vclock = max(self._vclock, least)
        return self._vclock

    def _remove_waiting(self, request_id: str) -> Request | None:
        request = super()._remove_waiting(request_id)
        if request is not None:
            self._deactivate(request.context.tenant_id)
        return request

    def _num_live(self) -> int:
        return sum(not r.is_done for r in self.running)

    def _live(self, request_id: str) -> Request | None:
        return next((r for r in self.running if r.request_id == request_id), None)

    def has_work(self) -> bool:
        return bool(self.waiting) or bool(self.running)


class _FairQueue:
    """Waiting requests, one FIFO per (priority, tenant). Iterates queue by queue."""

    def __init__(self) -> None:
        # Insertion order: the order the queues became non-empty (ties go to the first).
        self._queues: dict[tuple[int, str | None], deque[Request]] = {}
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Request]:
        for queue in self._queues.values():
            yield from queue

    def append(self, request: Request) -> None:
        self._queue(request).append(request)
        self._len += 1

    def requeue(self, request: Request) -> None:
        """Back to the front of its queue (a preempted request)."""
        self._queue(request).appendleft(request)
        self._len += 1

    def remove(self, request: Request) -> None:
        key = _queue_key(request)
        queue = self._queues[key]
        queue.remove(request)
        self._len -= 1
        if not queue:
            del self._queues[key]

    def priority_counts(self) -> list[tuple[int, int]]:
        """(priority, requests waiting with it), highest priority first."""
        counts: Counter[int] = Counter()
        for (priority, _), queue in self._queues.items():
            counts[priority] += len(queue)
        return sorted(counts.items(), reverse=True)

    def pop_next(self, virtual_time: Callable[[str | None], float]) -> Request:
        """The head of the highest-priority queue whose tenant has the least virtual time."""
        key = min(self._queues, key=lambda k: (-k[0], virtual_time(k[1])))
        queue = self._queues[key]
        request = queue.popleft()
        self._len -= 1
        if not queue:
            del self._queues[key]
        return request

    def _queue(self, request: Request) -> deque[Request]:
        key = _queue_key(request)
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = deque()
        return queue


def _queue_key(request: Request) -> tuple[int, str | None]:
    return request.context.priority, request.context.tenant_id


def _chunk(request: Request, budget: int) -> ScheduledChunk | None:
    end = request.num_tokens
    if request.shares_prefill and request.num_computed_tokens < request.num_prompt_tokens - 1:
        end = request.num_prompt_tokens - 1  # its choices fork this much, then all run on
    count = min(end - request.num_computed_tokens, budget)
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


def _cache_namespace(request: Request) -> str | None:
    """What a request's KV blocks are keyed by beside their tokens: its LoRA adapter (KV
    computed under other weights is never reused) and its ``cache_salt`` (blocks are shared
    only between requests with the same salt)."""
    salt = request.sampling_params.cache_salt
    if salt is None:
        return request.adapter_id
    return f"{request.adapter_id or ''}\x00salt:{salt}"
