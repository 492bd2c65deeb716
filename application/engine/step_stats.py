"""What one engine step did, for the StepObserver port (metrics, tracing, a fleet's load):
:class:`StepStatsCollector` keeps what happened between two steps (requests queued, ended
outside a step) and turns a step's batch and outputs into its :class:`StepStats`."""

from collections.abc import Sequence

from domain.observer import RequestStart, RequestStats, SchedulerStats, StepRow, StepStats
from domain.request import Request, StepOutput
from domain.scheduler import Scheduler, SchedulerOutput

ADAPTERS_EVERY_S = 1.0


class StepStatsCollector:
    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler
        self._ended: list[Request] = []  # aborted or failed since the last step's stats
        self._started: list[RequestStart] = []  # queued since the last step's stats
        self._step_start = 0.0
        self._prefix_counts = (0, 0)  # the scheduler's cumulative prefix counters, last seen
        # The running and waiting LoRA adapters, scanned at most every ADAPTERS_EVERY_S (a
        # walk over every request: not each step's work, for a gauge scraped per second).
        self._adapters: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
        self._adapters_at = float("-inf")

    def started(self, start: RequestStart) -> None:
        """A request was queued (reported with the next step)."""
        self._started.append(start)

    def ended(self, requests: Sequence[Request]) -> None:
        """Requests ended outside a step's outputs: aborted, or failed with their batch."""
        self._ended.extend(requests)

    def step_started(self, now: float) -> None:
        self._step_start = now

    def collect(
        self,
        batch: SchedulerOutput,
        now: float,
        *,
        ran: bool,
        sampled: int,
        outputs: Sequence[StepOutput] = (),
        accepted: int = 0,
    ) -> StepStats:
        """The step's stats: ``batch`` as scheduled (``ran`` False: nothing ran), the
        ``sampled`` rows' ``outputs`` (first tokens and finished requests stamped at ``now``),
        ``accepted`` speculative drafts kept; and what happened since the last step."""
        first, ended = [], self._ended
        for output in outputs:
            if output.completion_tokens == 1:
                first.append(output.request_id)
        if outputs:
            requests = {c.request.request_id: c.request for c in batch.chunks}
            for request_id in first:
                requests[request_id].first_token_s = now
            ended = ended + [requests[o.request_id] for o in outputs if o.finished]
        self._ended = []
        started, self._started = tuple(self._started), []
        prefill = decode = drafted = 0
        rows = []
        if ran:
            for chunk in batch.chunks:
                request = chunk.request
                # Prefill: prompt tokens, and generated ones recomputed after a preemption.
                prefill_end = max(request.num_prompt_tokens, request.num_recompute_tokens)
                in_prompt = max(0, min(chunk.num_tokens, prefill_end - chunk.start))
                prefill += in_prompt
                decode += chunk.num_tokens - in_prompt
                rows.append(StepRow(request.request_id, in_prompt, chunk.num_tokens - in_prompt))
                drafted += len(chunk.drafts)
        running, waiting = self._scheduler.counts()
        kv = self._scheduler.kv_stats()
        queried = kv.prefix_queried_tokens - self._prefix_counts[0]
        hit = kv.prefix_hit_tokens - self._prefix_counts[1]
        self._prefix_counts = (kv.prefix_queried_tokens, kv.prefix_hit_tokens)
        if now - self._adapters_at >= ADAPTERS_EVERY_S:
            self._adapters, self._adapters_at = self._scheduler.adapters(), now
        running_adapters, waiting_adapters = self._adapters
        scheduler = SchedulerStats(
            running,
            waiting,
            prefill,
            decode,
            kv.usage,
            queried,
            hit,
            kv.cached,
            running_adapters,
            waiting_adapters,
        )
        return StepStats(
            ran,
            now,
            scheduler,
            sampled,
            tuple(first),
            tuple(request_stats(r, now) for r in ended),
            start_s=self._step_start if ran else None,
            rows=tuple(rows),
            started=started,
            preempted=tuple(batch.preempted),
            drafts=sum(bool(c.drafts) for c in batch.chunks) if ran else 0,
            drafted_tokens=drafted,
            accepted_tokens=accepted,
            kv_events=tuple(self._scheduler.take_kv_events()),
        )


def request_stats(request: Request, now: float) -> RequestStats:
    """An ended request's timeline and counts (its end stamped ``now`` if not yet)."""
    finished = request.finished_s if request.finished_s is not None else now
    request.finished_s = finished
    return RequestStats(
        request.request_id,
        request.arrival_time_s,
        request.scheduled_s,
        request.first_token_s,
        finished,
        request.finish_reason or "abort",
        request.num_prompt_tokens,
        len(request.generated_token_ids),
        request.adapter_id,
        request.context,
        request.num_preemptions,
        request.num_drafted,
        request.num_accepted,
    )
