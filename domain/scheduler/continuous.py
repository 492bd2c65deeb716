"""The continuous policy: admission, the step's token budget, KV growth and preemption."""

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import replace

from domain.config import EngineConfig
from domain.kv_blocks import CachedPrefix
from domain.request import Request
from domain.scheduler.base import QueueingScheduler
from domain.scheduler.fairness import FairQueue, TenantShares
from domain.scheduler.outputs import RunnerOutput, SampledToken, ScheduledChunk, SchedulerOutput
from domain.scheduler.shared_prefill import SharedPrefill, cache_namespace, next_chunk


class ContinuousScheduler(QueueingScheduler):
    """Admits and retires requests every step, under a token budget and a running cap.

    Running requests go first (one decode token each, or the rest of a chunked prompt),
    then waiting ones are admitted while slots and budget last; a prompt larger than the
    remaining budget is prefilled in chunks over several steps.

    Fairness (``request.context``; the tenants' shares are :class:`TenantShares`):

    - admission: the highest ``priority`` first; among equal priorities, the tenant with
      the least *virtual time* (weighted fair queuing); FCFS within a tenant. One tenant
      with one priority is plain FCFS.
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
    step, freed when a request ends or is preempted; prompts computed once for several
    requests are :class:`SharedPrefill`'s.

    Weights: ``tenant_weights`` here or :meth:`set_tenant_weights` (default 1.0), or
    ``shares`` given, whose weights their owner sets (the server's access: its keyring's).
    """

    def __init__(
        self,
        config: EngineConfig,
        eos_token_ids: Iterable[int] = (),
        *,
        tenant_weights: Mapping[str, float] | None = None,
        shares: TenantShares | None = None,
    ) -> None:
        super().__init__(config, eos_token_ids, prefix_caching=config.prefix_caching)
        self.waiting: FairQueue = FairQueue()
        self.running: list[Request] = []
        self.shares = shares or TenantShares(tenant_weights)
        self.sharing = SharedPrefill(self.blocks)
        self._running_priorities: Counter[int] = Counter()
        self._budget = 0  # tokens left in the step being scheduled

    def set_tenant_weights(self, weights: Mapping[str, float]) -> None:
        """:meth:`TenantShares.set_weights`."""
        self.shares.set_weights(weights)

    def tenant_weight(self, tenant_id: str | None) -> float:
        return self.shares.weight(tenant_id)

    def virtual_time(self, tenant_id: str | None) -> float:
        """The tenant's weighted service so far (tokens scheduled / weight)."""
        return self.shares.virtual_time(tenant_id)

    def add_request(self, request: Request) -> bool:
        if not super().add_request(request):
            return False
        self.shares.activate(request.context.tenant_id)
        return True

    def schedule(self) -> SchedulerOutput:
        released = []
        for request in self.running:
            if request.is_done:
                released.append(request.request_id)
                self.blocks.free(request.request_id)
                self._running_priorities[request.context.priority] -= 1
                self.shares.deactivate(request.context.tenant_id)
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
        while self.waiting and len(self.running) < self.config.max_num_seqs and self._budget:
            request = self.waiting.pop_next(self.shares.virtual_time)
            if not self._admit(request, chunks, preempted):
                self.waiting.requeue(request)
                break
        released += preempted
        return SchedulerOutput(list(chunks.values()), released, preempted, self.eos_token_ids)

    def update_from_output(
        self, output: SchedulerOutput, result: RunnerOutput
    ) -> list[SampledToken]:
        sampled = super().update_from_output(output, result)
        size = self.blocks.block_size
        for chunk in output.chunks:
            request, end = chunk.request, chunk.start + chunk.num_tokens
            if chunk.drafts and not request.is_done:
                end = request.num_computed_tokens  # the newest token and accepted drafts
                self.blocks.trim(request.request_id, end + 1)  # rejected drafts' blocks
            if (
                self.blocks.enable_caching  # name the blocks this step filled, for reuse
                and end // size > chunk.start // size
                and request.request_id in self.blocks
            ):
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
        """The cached blocks ``request`` can start from: with prompt logprobs, only those
        before the positions it scores (from ``prompt_logprobs_from``; those must run)."""
        params = request.sampling_params
        tokens = request.token_ids_from(0, request.num_tokens)
        if params.prompt_logprobs:
            if params.prompt_logprobs_from <= 1:
                return CachedPrefix()
            tokens = tokens[: params.prompt_logprobs_from]  # a prefix short of P - 1's row
        return self.blocks.find_cached_prefix(tokens, cache_namespace(request))

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
        chunk = self.sharing.fork(request, self._budget, self._live)
        if chunk is None and request.prefill_source_id is None:
            if request.request_id not in self.blocks:
                prefix = self._cached_prefix(request)
                request.num_computed_tokens = prefix.num_tokens
                if request.num_cached_tokens is None:  # a recompute hits its own blocks
                    request.num_cached_tokens = prefix.num_tokens
                if admitting and self.sharing.join(request, prefix, self.running):
                    return True  # waits for the same prompt's prefill, then forks it
            chunk = next_chunk(request, self._budget)
            if chunk is not None and request.draft_token_ids:
                chunk = self._with_drafts(chunk)
        if chunk is None and prefix is None:
            return True  # a choice waiting for its source's prefill
        end = chunk.start + chunk.num_rows if chunk else request.num_computed_tokens
        adapter_id, blocks = cache_namespace(request), self.blocks
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
            self.shares.charge(request.context.tenant_id, chunk.num_rows)
            self._budget -= chunk.num_rows
        return True

    def _with_drafts(self, chunk: ScheduledChunk) -> ScheduledChunk:
        """A decode chunk with its request's drafts (taken: a step verifies them once),
        as many as the step's budget, the context and the free blocks allow."""
        request = chunk.request
        drafts, request.draft_token_ids = request.draft_token_ids, []
        if chunk.num_tokens != 1 or chunk.start != request.num_tokens - 1:
            return chunk  # not decoding (a prompt's chunk): no drafts
        room = min(self._budget - 1, self.config.max_model_len - request.num_tokens)
        drafts = drafts[: max(room, 0)]
        rows = chunk.start + 1 + len(drafts)
        if drafts and not self.blocks.can_allocate(request.request_id, rows):
            drafts = []  # drafts never preempt anyone
        return replace(chunk, drafts=tuple(drafts)) if drafts else chunk

    def _evict(
        self, victim: Request, chunks: dict[str, ScheduledChunk], preempted: list[str]
    ) -> None:
        """Preempt ``victim`` for its KV blocks (its chunk this step, if any, unscheduled)."""
        chunk = chunks.pop(victim.request_id, None)
        if chunk is not None:
            self._budget += chunk.num_tokens
        self._requeue(victim)
        preempted.append(victim.request_id)

    def _budget_order(self, budget: int) -> list[Request]:
        """Running requests in the order they take the step's budget: admission order when
        it covers them all, else by priority then tenant virtual time (stable)."""
        needed = sum(r.num_tokens - r.num_computed_tokens for r in self.running)
        if needed <= budget:
            return list(self.running)  # a copy: preemption removes running requests
        return sorted(
            self.running,
            key=lambda r: (-r.context.priority, self.shares.virtual_time(r.context.tenant_id)),
        )

    def _preempt(self) -> list[str]:
        """Free batch slots for waiting requests of higher priority than running ones."""
        if not self.waiting or not self.running:
            return []
        free = self.config.max_num_seqs - len(self.running)
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
        request.draft_token_ids = []
        request.num_preemptions += 1
        self.waiting.requeue(request)

    def _remove_waiting(self, request_id: str) -> Request | None:
        request = super()._remove_waiting(request_id)
        if request is not None:
            self.shares.deactivate(request.context.tenant_id)
        return request

    def _num_live(self) -> int:
        return sum(not r.is_done for r in self.running)

    def _running(self) -> list[Request]:
        return self.running

    def _live(self, request_id: str) -> Request | None:
        return next((r for r in self.running if r.request_id == request_id), None)

    def has_work(self) -> bool:
        return bool(self.waiting) or bool(self.running)
