"""Prometheus metrics: the engine's steps, the API's requests, rate limits, Tinker work.

:class:`Metrics` is a domain ``StepObserver`` (``on_step``, once per engine step on the
event-loop thread) and the sink of the HTTP middleware (``request_started`` /
``stream_started`` / ``request_finished`` with each API request's ``RequestRecord``).
Every metric lives in the instance's own ``CollectorRegistry``, is named ``infer:...`` and
carries a ``model_name`` label; the engine metrics mirror vLLM's ``vllm:...`` names and
meanings so its dashboards work with the prefix swapped. Label values that clients choose
(tenants, routes, methods) are bounded: past the cap they are counted as ``other``. The
metrics themselves, and what each measures: :mod:`adapters.observability.metric_families`.
"""

import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest

from adapters.observability.metric_families import MetricFamilies
from application.serving.request_record import RequestRecord
from domain.observer import RequestStats, StepStats, TrainingOpStats

MAX_ROUTES = 64
OTHER = "other"
NO_TENANT = "none"
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class Metrics:
    """The server's Prometheus metrics in their own registry (see the module's docstring).

    ``kv_cache_bytes``: the KV cache's size, for ``infer:kv_cache_bytes`` (0: unknown);
    ``max_tenants``: distinct tenant label values before ``other``; ``clock``: the clock of
    ``RequestRecord.started_s`` (``time.monotonic``)."""

    def __init__(
        self,
        model_name: str,
        *,
        max_num_seqs: int,
        kv_cache_bytes: int = 0,
        max_tenants: int = 100,
        max_loras: int = 16,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry()
        self._kv_cache_bytes = kv_cache_bytes
        self._max_tenants = max_tenants
        self._max_loras = max_loras
        self._clock = clock
        self._f = MetricFamilies(model_name, self.registry, max_num_seqs)
        # Step state.
        self._arrivals: dict[str, float] = {}  # requests started, before their first token
        self._last_end: float | None = None  # when the previous step that ran ended
        self._lora_labels: tuple[str, str] | None = None  # vllm:lora_requests_info's sample
        # Bounded label values.
        self._tenants: dict[str | None, str] = {None: NO_TENANT}
        self._tenant_children: dict[str, tuple[Counter, Counter, Counter]] = {}
        self._routes: set[str] = set()
        self._streams: set[int] = set()  # id() of the records that started a stream

    def breaker(self, replica_id: str, state: str) -> None:
        """A replica's circuit breaker is now ``state`` (``closed``, ``open``)."""
        self._f.breaker_open.labels(self.model_name, replica_id).set(int(state != "closed"))
        if state == "open":
            self._f.breaker_opens.labels(self.model_name, replica_id).inc()

    # -- engine -------------------------------------------------------------------------

    def on_step(self, stats: StepStats) -> None:
        """One engine step's statistics (the domain ``StepObserver`` port)."""
        scheduler, f = stats.scheduler, self._f
        f.running.set(scheduler.running)
        f.waiting.set(scheduler.waiting)
        f.kv_usage.set(scheduler.kv_usage)
        for gauge, value in zip(
            f.vllm_state,
            (scheduler.running, scheduler.waiting, scheduler.kv_usage),
            strict=True,
        ):
            gauge.set(value)
        labels = (",".join(scheduler.running_adapters), ",".join(scheduler.waiting_adapters))
        if labels != self._lora_labels:  # one sample: the current adapters
            if self._lora_labels is not None:
                f.lora_info.remove(self.model_name, str(self._max_loras), *self._lora_labels)
            self._lora_labels = labels
            f.lora_info.labels(self.model_name, str(self._max_loras), *labels).set(time.time())
        f.kv_bytes.set(scheduler.kv_usage * self._kv_cache_bytes)
        if scheduler.prefix_queried_tokens:
            f.prefix_queries.inc(scheduler.prefix_queried_tokens)
            f.prefix_hits.inc(scheduler.prefix_hit_tokens)
        if scheduler.prefill_tokens:
            f.prompt_tokens.inc(scheduler.prefill_tokens)
        if stats.sampled_tokens:
            f.generation_tokens.inc(stats.sampled_tokens)
        if stats.preempted:
            f.preemptions.inc(len(stats.preempted))
        if stats.drafted_tokens:
            f.spec_drafts.inc(stats.drafts)
            f.spec_draft_tokens.inc(stats.drafted_tokens)
            f.spec_accepted.inc(stats.accepted_tokens)
        for start in stats.started:
            self._arrivals[start.request_id] = start.arrival_s
        if stats.ran:
            self._observe_batch(stats)
        else:
            self._last_end = None
        for request_id in stats.first_tokens:
            arrival = self._arrivals.pop(request_id, None)
            if arrival is not None:
                f.ttft.observe(stats.time_s - arrival)
        for request in stats.finished:
            self._observe_end(request)

    def _observe_batch(self, stats: StepStats) -> None:
        scheduler = stats.scheduler
        prefill_rows = decode_rows = 0
        for row in stats.rows:
            if row.prefill_tokens:
                prefill_rows += 1
            if row.decode_tokens:
                decode_rows += 1
        self._f.iteration_tokens.observe(scheduler.prefill_tokens + scheduler.decode_tokens)
        self._f.batch_prefill.observe(prefill_rows)
        self._f.batch_decode.observe(decode_rows)
        previous = self._last_end
        # With nothing running after this step the engine goes idle (or only prefills next).
        self._last_end = stats.time_s if scheduler.running else None
        if previous is not None and decode_rows and stats.sampled_tokens:
            gap = stats.time_s - previous
            for _ in range(decode_rows):
                self._f.itl.observe(gap)

    def _observe_end(self, request: RequestStats) -> None:
        self._arrivals.pop(request.request_id, None)
        success = self._f.success_by_reason.get(request.finish_reason)
        if success is None:
            success = self._f.success.labels(self.model_name, request.finish_reason)
        success.inc()
        self._f.e2e.observe(request.finished_s - request.arrival_s)
        scheduled, first = request.scheduled_s, request.first_token_s
        if scheduled is not None:
            self._f.queue.observe(scheduled - request.arrival_s)
            if first is not None:
                self._f.prefill.observe(first - scheduled)
        if first is not None:
            self._f.decode.observe(request.finished_s - first)
        self._f.request_prompt.observe(request.prompt_tokens)
        self._f.request_generation.observe(request.completion_tokens)
        requests, prompt, generation = self._tenant_counters(request.context.tenant_id)
        requests.inc()
        if request.prompt_tokens:
            prompt.inc(request.prompt_tokens)
        if request.completion_tokens:
            generation.inc(request.completion_tokens)

    def _tenant_label(self, tenant_id: str | None) -> str:
        label = self._tenants.get(tenant_id)
        if label is not None:
            return label
        if len(self._tenants) - 1 >= self._max_tenants:  # None's entry is not a tenant
            return OTHER
        self._tenants[tenant_id] = tenant_id or NO_TENANT
        return self._tenants[tenant_id]

    def _tenant_counters(self, tenant_id: str | None) -> tuple[Counter, Counter, Counter]:
        label = self._tenant_label(tenant_id)
        children = self._tenant_children.get(label)
        if children is None:
            children = (
                self._f.tenant_requests.labels(self.model_name, label),
                self._f.tenant_prompt.labels(self.model_name, label),
                self._f.tenant_generation.labels(self.model_name, label),
            )
            self._tenant_children[label] = children
        return children

    # -- HTTP ---------------------------------------------------------------------------

    def request_started(self, record: RequestRecord) -> None:
        """An API request arrived (``infer:active_requests`` + 1)."""
        self._f.active_requests.inc()

    def stream_started(self, record: RequestRecord) -> None:
        """``record``'s response is a stream (``infer:active_streams`` + 1 until it ends)."""
        key = id(record)
        if key not in self._streams:
            self._streams.add(key)
            self._f.active_streams.inc()

    def request_finished(self, record: RequestRecord) -> None:
        """An API request ended: count it by route, method and status, its duration and
        tokens; ``active_requests`` (and ``active_streams`` if it streamed) - 1."""
        self._f.active_requests.dec()
        key = id(record)
        if key in self._streams:
            self._streams.discard(key)
            self._f.active_streams.dec()
        code = "500" if record.status is None else str(record.status)
        route = self._route_label(record.route)
        method = record.method if record.method in HTTP_METHODS else OTHER
        self._f.requests.labels(self.model_name, route, method, code).inc()
        if record.status is None or record.status >= 400:
            self._f.errors.labels(self.model_name, code).inc()
        duration = self._clock() - record.started_s
        self._f.duration.labels(self.model_name, route).observe(duration)
        if record.rollout is not None and record.model is not None:
            labels = (self.model_name, record.rollout, record.model)
            self._f.rollout_requests.labels(*labels, code).inc()
            self._f.rollout_duration.labels(*labels).observe(duration)
            if (ttft := record.ttft_s) is not None:
                self._f.rollout_ttft.labels(*labels).observe(ttft)
        if record.prompt_tokens:
            self._f.tokens_input.inc(record.prompt_tokens)
        if record.completion_tokens:
            self._f.tokens_output.inc(record.completion_tokens)

    def _route_label(self, route: str) -> str:
        if route in self._routes:
            return route
        if len(self._routes) >= MAX_ROUTES:
            return OTHER
        self._routes.add(route)
        return route

    def rate_limited(self, tenant_id: str | None, limit: str) -> None:
        """A request refused by a rate limit (``limit``: requests, tokens, streams, queue)."""
        self._f.rate_limited.labels(self.model_name, limit).inc()
        self._f.tenant_limited.labels(self.model_name, self._tenant_label(tenant_id)).inc()

    # -- Tinker -------------------------------------------------------------------------

    def on_training_op(self, stats: TrainingOpStats) -> None:
        """The Tinker service's observer port: :meth:`training_op` for one operation."""
        self.training_op(stats.op, stats.tokens, stats.end_s - stats.start_s, stats.ok)

    def training_op(self, op: str, tokens: int, seconds: float, ok: bool) -> None:
        """One Tinker operation ran (``op``: forward_backward, optim_step, ...)."""
        self._f.tinker_ops.labels(self.model_name, op, "ok" if ok else "error").inc()
        if tokens:
            self._f.tinker_tokens.labels(self.model_name, op).inc(tokens)
        self._f.tinker_seconds.labels(self.model_name, op).observe(seconds)

    def track_pending_futures(self, fn: Callable[[], int]) -> None:
        """Report ``fn()`` as ``infer:tinker_pending_futures`` at every scrape."""
        self._f.pending_futures.set_function(fn)

    def track_usage(self, recorder: Any) -> None:
        """Report the usage recorder's queue, drops and failed writes at every scrape."""
        self._f.usage_pending.set_function(lambda: recorder.pending)
        self._f.usage_dropped.set_function(lambda: recorder.dropped)
        self._f.usage_failures.set_function(lambda: recorder.failures)

    # -- exposition ---------------------------------------------------------------------

    def render(self) -> tuple[bytes, str]:
        """The text exposition of every metric, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
