"""Prometheus metrics: the engine's steps, the API's requests, rate limits, Tinker work.

:class:`Metrics` is a domain ``StepObserver`` (``on_step``, once per engine step on the
event-loop thread) and the sink of the HTTP middleware (``request_started`` /
``stream_started`` / ``request_finished`` with each API request's ``RequestRecord``).
Every metric lives in the instance's own ``CollectorRegistry``, is named ``infer:...`` and
carries a ``model_name`` label; the engine metrics mirror vLLM's ``vllm:...`` names and
meanings so its dashboards work with the prefix swapped. Label values that clients choose
(tenants, routes, methods) are bounded: past the cap they are counted as ``other``.

Engine (from ``StepStats``):

- ``infer:num_requests_running`` / ``infer:num_requests_waiting``: requests holding a batch
  slot / queued for one, after the latest step.
- ``infer:kv_cache_usage_perc``: fraction (0..1) of the KV cache in use;
  ``infer:kv_cache_bytes``: the bytes that fraction is (usage * the cache's size).
- ``infer:prefix_cache_queries_total`` / ``infer:prefix_cache_hits_total``: prompt tokens
  of admitted requests looked up in the prefix cache / found there (not computed).
- ``infer:prompt_tokens_total``: prompt (prefill) tokens run; ``infer:generation_tokens_total``:
  tokens sampled; ``infer:num_preemptions_total``: requests put back to the queue.
- Speculative decoding (vLLM's names): ``infer:spec_decode_num_drafts_total`` (requests'
  steps that verified drafts), ``infer:spec_decode_num_draft_tokens_total`` (draft tokens
  verified), ``infer:spec_decode_num_accepted_tokens_total`` (of those, accepted); the
  acceptance rate is accepted / draft tokens.
- ``infer:request_success_total{finished_reason}``: ended requests by reason (eos, stop,
  length, abort, error).
- Histograms per request, observed when it ends: ``infer:e2e_request_latency_seconds``
  (arrival to end), ``infer:request_queue_time_seconds`` (arrival to first scheduled),
  ``infer:request_prefill_time_seconds`` (first scheduled to first token),
  ``infer:request_decode_time_seconds`` (first token to end), ``infer:request_prompt_tokens``,
  ``infer:request_generation_tokens``; a time the request never reached is not observed.
- ``infer:time_to_first_token_seconds``: arrival to first token, observed in the step that
  produced it (the request's ``RequestStart`` gives the arrival).
- ``infer:inter_token_latency_seconds``: for each decoding row of a step, the time since the
  previous step ended (not observed for the first step after the engine was idle).
- ``infer:iteration_tokens_total``: tokens run per step (prefill + decode);
  ``infer:batch_size_prefill`` / ``infer:batch_size_decode``: rows of a step running prompt
  tokens / decoding (steps that ran, zero included).
- ``infer:tenant_requests_total{tenant}``, ``infer:tenant_prompt_tokens_total{tenant}``,
  ``infer:tenant_generation_tokens_total{tenant}``: ended requests and their tokens by tenant
  (``none`` without a tenant; past ``max_tenants`` distinct tenants, ``other``).

HTTP (from ``RequestRecord``): ``infer:requests_total{route,method,code}``,
``infer:errors_total{code}``, ``infer:request_duration_seconds{route}``,
``infer:active_requests``, ``infer:active_streams``, ``infer:tokens_input_total``,
``infer:tokens_output_total``. Rate limits: ``infer:rate_limit_dropped_total{limit}`` and
``infer:tenant_rate_limited_total{tenant}``. Tinker: ``infer:tinker_operations_total{op,status}``,
``infer:tinker_tokens_total{op}``, ``infer:tinker_operation_seconds{op}``,
``infer:tinker_pending_futures``.
"""

import time
from collections.abc import Callable
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from application.serving.request_record import RequestRecord
from domain.observer import RequestStats, StepStats, TrainingOpStats

# vLLM's buckets (v1 loggers), a few finer ones first for small models and CPUs.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
ITERATION_TOKENS_BUCKETS = (
    1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
)  # fmt: skip
HTTP_DURATION_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
    600.0,
)  # fmt: skip
TINKER_SECONDS_BUCKETS = (
    0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0,
)  # fmt: skip

MAX_ROUTES = 64
OTHER = "other"
NO_TENANT = "none"
FINISH_REASONS = ("eos", "stop", "length", "abort", "error")
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def token_buckets(largest: int = 1_000_000) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``largest`` (vLLM's token-count buckets)."""
    buckets: list[float] = []
    scale = 1
    while True:
        for step in (1, 2, 5):
            if step * scale > largest:
                return tuple(buckets)
            buckets.append(float(step * scale))
        scale *= 10


def batch_buckets(max_num_seqs: int) -> tuple[float, ...]:
    """0, 1, 2, 4, ... then ``max_num_seqs``: rows in one step."""
    buckets = [0.0]
    size = 1
    while size < max_num_seqs:
        buckets.append(float(size))
        size *= 2
    buckets.append(float(max(1, max_num_seqs)))
    return tuple(buckets)


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
        self._engine_metrics()
        self._engine_histograms(max_num_seqs)
        self._tenant_metrics()
        self._http_metrics()
        self._tinker_metrics()
        # Step state.
        self._arrivals: dict[str, float] = {}  # requests started, before their first token
        self._last_end: float | None = None  # when the previous step that ran ended

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, ("model_name",), registry=self.registry).labels(self.model_name)

    def _counter(self, name: str, doc: str) -> Counter:
        return Counter(name, doc, ("model_name",), registry=self.registry).labels(self.model_name)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(
            name, doc, ("model_name",), registry=self.registry, buckets=buckets
        ).labels(self.model_name)

    def _engine_metrics(self) -> None:
        """The engine's scheduler state, tokens and events."""
        reg = self.registry
        model_name = self.model_name
        # Engine: scheduler state after the latest step.
        self._running = self._gauge("infer:num_requests_running", "Requests holding a batch slot.")
        self._waiting = self._gauge(
            "infer:num_requests_waiting", "Requests queued for a batch slot."
        )
        self._kv_usage = self._gauge(
            "infer:kv_cache_usage_perc", "Fraction of the KV cache in use (0..1)."
        )
        self._kv_bytes = self._gauge("infer:kv_cache_bytes", "Bytes of the KV cache in use.")
        # The same three under vLLM's names, which llm-d's endpoint picker, vllm-router and
        # other vLLM-compatible routers read to place requests.
        self._vllm_state = (
            self._gauge(
                "vllm:num_requests_running", "Requests holding a batch slot (vLLM's name)."
            ),
            self._gauge("vllm:num_requests_waiting", "Requests queued for a slot (vLLM's name)."),
            self._gauge(
                "vllm:kv_cache_usage_perc", "Fraction of the KV cache in use (vLLM's name)."
            ),
        )
        # vLLM's LoRA gauge, as llm-d's endpoint picker reads it: one sample whose labels
        # name the adapters running and waiting (comma-separated) and the most loaded at
        # once, its value the time it was set (the newest sample is the state).
        self._lora_info = Gauge(
            "vllm:lora_requests_info",
            "Running and waiting LoRA adapters (vLLM's gauge; the value: when it was set).",
            ("model_name", "max_lora", "running_lora_adapters", "waiting_lora_adapters"),
            registry=self.registry,
        )
        self._lora_labels: tuple[str, str] | None = None
        self._prefix_queries = self._counter(
            "infer:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self._prefix_hits = self._counter(
            "infer:prefix_cache_hits", "Prompt tokens found in the prefix cache (not computed)."
        )
        # Engine: tokens and events.
        self._prompt_tokens = self._counter("infer:prompt_tokens", "Prompt (prefill) tokens run.")
        self._generation_tokens = self._counter("infer:generation_tokens", "Tokens sampled.")
        self._preemptions = self._counter(
            "infer:num_preemptions", "Requests put back to the queue (their KV recomputed)."
        )
        self._spec_drafts = self._counter(
            "infer:spec_decode_num_drafts", "Requests' steps that verified speculative drafts."
        )
        self._spec_draft_tokens = self._counter(
            "infer:spec_decode_num_draft_tokens", "Speculative draft tokens verified."
        )
        self._spec_accepted = self._counter(
            "infer:spec_decode_num_accepted_tokens", "Speculative draft tokens accepted."
        )
        self._success = Counter(
            "infer:request_success",
            "Ended requests by finish reason (eos, stop, length, abort, error).",
            ("model_name", "finished_reason"),
            registry=reg,
        )
        self._success_by_reason = {
            reason: self._success.labels(model_name, reason) for reason in FINISH_REASONS
        }

    def _engine_histograms(self, max_num_seqs: int) -> None:
        """The engine's per-request and per-step histograms."""
        # Engine: per-request histograms.
        self._ttft = self._histogram(
            "infer:time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS
        )
        self._itl = self._histogram(
            "infer:inter_token_latency_seconds",
            "Time between a decoding request's consecutive tokens (step to step).",
            ITL_BUCKETS,
        )
        self._e2e = self._histogram(
            "infer:e2e_request_latency_seconds", "Arrival to end.", REQUEST_LATENCY_BUCKETS
        )
        self._queue = self._histogram(
            "infer:request_queue_time_seconds",
            "Arrival to first scheduled (waiting).",
            REQUEST_LATENCY_BUCKETS,
        )
        self._prefill = self._histogram(
            "infer:request_prefill_time_seconds",
            "First scheduled to first token (prefill).",
            REQUEST_LATENCY_BUCKETS,
        )
        self._decode = self._histogram(
            "infer:request_decode_time_seconds",
            "First token to end (decode).",
            REQUEST_LATENCY_BUCKETS,
        )
        self._request_prompt = self._histogram(
            "infer:request_prompt_tokens", "Prompt tokens of an ended request.", token_buckets()
        )
        self._request_generation = self._histogram(
            "infer:request_generation_tokens",
            "Generated tokens of an ended request.",
            token_buckets(),
        )
        # Engine: per-step histograms.
        self._iteration_tokens = self._histogram(
            "infer:iteration_tokens_total",
            "Tokens run in one step (prefill + decode).",
            ITERATION_TOKENS_BUCKETS,
        )
        sizes = batch_buckets(max_num_seqs)
        self._batch_prefill = self._histogram(
            "infer:batch_size_prefill", "Rows of a step running prompt tokens.", sizes
        )
        self._batch_decode = self._histogram(
            "infer:batch_size_decode", "Rows of a step decoding.", sizes
        )

    def _tenant_metrics(self) -> None:
        """Per-tenant counters (bounded label values)."""
        reg = self.registry
        # Tenants (bounded label values).
        tenant = ("model_name", "tenant")
        self._tenant_requests = Counter(
            "infer:tenant_requests", "Ended requests by tenant.", tenant, registry=reg
        )
        self._tenant_prompt = Counter(
            "infer:tenant_prompt_tokens",
            "Prompt tokens of ended requests by tenant.",
            tenant,
            registry=reg,
        )
        self._tenant_generation = Counter(
            "infer:tenant_generation_tokens",
            "Generated tokens of ended requests by tenant.",
            tenant,
            registry=reg,
        )
        self._tenant_limited = Counter(
            "infer:tenant_rate_limited",
            "API requests refused by a rate limit, by tenant.",
            tenant,
            registry=reg,
        )
        self._tenants: dict[str | None, str] = {None: NO_TENANT}
        self._tenant_children: dict[str, tuple[Counter, Counter, Counter]] = {}

    def _http_metrics(self) -> None:
        """The API's requests, rollouts' targets and rate limits."""
        reg = self.registry
        # HTTP.
        self._requests = Counter(
            "infer:requests",
            "API requests served, by route template, method and status code.",
            ("model_name", "route", "method", "code"),
            registry=reg,
        )
        self._errors = Counter(
            "infer:errors",
            "API requests answered with a status >= 400, by code.",
            ("model_name", "code"),
            registry=reg,
        )
        self._duration = Histogram(
            "infer:request_duration_seconds",
            "API request duration (start to response end), by route template.",
            ("model_name", "route"),
            registry=reg,
            buckets=HTTP_DURATION_BUCKETS,
        )
        self._active_requests = self._gauge("infer:active_requests", "API requests being served.")
        self._active_streams = self._gauge(
            "infer:active_streams", "API requests streaming a response (SSE)."
        )
        self._tokens_input = self._counter("infer:tokens_input", "Prompt tokens of API requests.")
        self._tokens_output = self._counter(
            "infer:tokens_output", "Completion tokens of API requests."
        )
        self._routes: set[str] = set()
        self._streams: set[int] = set()  # id() of the records that started a stream
        # Rollouts: each target's requests, errors and latency (a canary's health).
        target = ("model_name", "rollout", "target")
        self._rollout_requests = Counter(
            "infer:rollout_requests",
            "API requests a rollout's name sent to each target, by status code.",
            (*target, "code"),
            registry=reg,
        )
        self._rollout_duration = Histogram(
            "infer:rollout_request_duration_seconds",
            "API request duration (start to response end) per rollout target.",
            target,
            registry=reg,
            buckets=HTTP_DURATION_BUCKETS,
        )
        self._rollout_ttft = Histogram(
            "infer:rollout_time_to_first_token_seconds",
            "Time to the first token per rollout target.",
            target,
            registry=reg,
            buckets=TTFT_BUCKETS,
        )
        # Rate limits.
        self._rate_limited = Counter(
            "infer:rate_limit_dropped",
            "API requests refused by a rate limit, by limit (requests, tokens, streams, queue).",
            ("model_name", "limit"),
            registry=reg,
        )

    def _tinker_metrics(self) -> None:
        """Tinker's operations and the usage ledger's writer."""
        reg = self.registry
        # Tinker.
        self._tinker_ops = Counter(
            "infer:tinker_operations",
            "Tinker operations run, by operation and status (ok, error).",
            ("model_name", "op", "status"),
            registry=reg,
        )
        self._tinker_tokens = Counter(
            "infer:tinker_tokens",
            "Tokens processed by Tinker operations, by operation.",
            ("model_name", "op"),
            registry=reg,
        )
        self._tinker_seconds = Histogram(
            "infer:tinker_operation_seconds",
            "Tinker operation duration, by operation.",
            ("model_name", "op"),
            registry=reg,
            buckets=TINKER_SECONDS_BUCKETS,
        )
        self._pending_futures = self._gauge(
            "infer:tinker_pending_futures", "Tinker futures not yet resolved."
        )
        # The usage ledger's writer (behind: records queued; a database down: failures).
        self._usage_pending = self._gauge(
            "infer:usage_records_pending", "Usage records queued, not yet in the database."
        )
        self._usage_dropped = self._gauge(
            "infer:usage_records_dropped",
            "Usage records dropped since the start (the queue was full: the database behind).",
        )
        self._usage_failures = self._gauge(
            "infer:usage_write_failures", "Failed writes to the usage database since the start."
        )
        # A fleet's ingress: each replica's circuit breaker (a replica's id per label value,
        # as many as the fleet has had; not ``replica``: the fleet's /metrics labels each
        # sample with the process it came from under that name).
        self._breaker_open = Gauge(
            "infer:replica_breaker_open",
            "1 while a replica's circuit breaker keeps it out of routing (open or probed).",
            ("model_name", "replica_id"),
            registry=self.registry,
        )
        self._breaker_opens = Counter(
            "infer:replica_breaker_opens",
            "Times a replica's circuit breaker opened.",
            ("model_name", "replica_id"),
            registry=self.registry,
        )

    def breaker(self, replica_id: str, state: str) -> None:
        """A replica's circuit breaker is now ``state`` (``closed``, ``open``)."""
        self._breaker_open.labels(self.model_name, replica_id).set(int(state != "closed"))
        if state == "open":
            self._breaker_opens.labels(self.model_name, replica_id).inc()

    # -- engine -------------------------------------------------------------------------

    def on_step(self, stats: StepStats) -> None:
        """One engine step's statistics (the domain ``StepObserver`` port)."""
        scheduler = stats.scheduler
        self._running.set(scheduler.running)
        self._waiting.set(scheduler.waiting)
        self._kv_usage.set(scheduler.kv_usage)
        for gauge, value in zip(
            self._vllm_state,
            (scheduler.running, scheduler.waiting, scheduler.kv_usage),
            strict=True,
        ):
            gauge.set(value)
        labels = (",".join(scheduler.running_adapters), ",".join(scheduler.waiting_adapters))
        if labels != self._lora_labels:  # one sample: the current adapters
            if self._lora_labels is not None:
                self._lora_info.remove(self.model_name, str(self._max_loras), *self._lora_labels)
            self._lora_labels = labels
            self._lora_info.labels(self.model_name, str(self._max_loras), *labels).set(time.time())
        self._kv_bytes.set(scheduler.kv_usage * self._kv_cache_bytes)
        if scheduler.prefix_queried_tokens:
            self._prefix_queries.inc(scheduler.prefix_queried_tokens)
            self._prefix_hits.inc(scheduler.prefix_hit_tokens)
        if scheduler.prefill_tokens:
            self._prompt_tokens.inc(scheduler.prefill_tokens)
        if stats.sampled_tokens:
            self._generation_tokens.inc(stats.sampled_tokens)
        if stats.preempted:
            self._preemptions.inc(len(stats.preempted))
        if stats.drafted_tokens:
            self._spec_drafts.inc(stats.drafts)
            self._spec_draft_tokens.inc(stats.drafted_tokens)
            self._spec_accepted.inc(stats.accepted_tokens)
        for start in stats.started:
            self._arrivals[start.request_id] = start.arrival_s
        if stats.ran:
            self._observe_batch(stats)
        else:
            self._last_end = None
        for request_id in stats.first_tokens:
            arrival = self._arrivals.pop(request_id, None)
            if arrival is not None:
                self._ttft.observe(stats.time_s - arrival)
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
        self._iteration_tokens.observe(scheduler.prefill_tokens + scheduler.decode_tokens)
        self._batch_prefill.observe(prefill_rows)
        self._batch_decode.observe(decode_rows)
        previous = self._last_end
        # With nothing running after this step the engine goes idle (or only prefills next).
        self._last_end = stats.time_s if scheduler.running else None
        if previous is not None and decode_rows and stats.sampled_tokens:
            gap = stats.time_s - previous
            for _ in range(decode_rows):
                self._itl.observe(gap)

    def _observe_end(self, request: RequestStats) -> None:
        self._arrivals.pop(request.request_id, None)
        success = self._success_by_reason.get(request.finish_reason)
        if success is None:
            success = self._success.labels(self.model_name, request.finish_reason)
        success.inc()
        self._e2e.observe(request.finished_s - request.arrival_s)
        scheduled, first = request.scheduled_s, request.first_token_s
        if scheduled is not None:
            self._queue.observe(scheduled - request.arrival_s)
            if first is not None:
                self._prefill.observe(first - scheduled)
        if first is not None:
            self._decode.observe(request.finished_s - first)
        self._request_prompt.observe(request.prompt_tokens)
        self._request_generation.observe(request.completion_tokens)
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
                self._tenant_requests.labels(self.model_name, label),
                self._tenant_prompt.labels(self.model_name, label),
                self._tenant_generation.labels(self.model_name, label),
            )
            self._tenant_children[label] = children
        return children

    # -- HTTP ---------------------------------------------------------------------------

    def request_started(self, record: RequestRecord) -> None:
        """An API request arrived (``infer:active_requests`` + 1)."""
        self._active_requests.inc()

    def stream_started(self, record: RequestRecord) -> None:
        """``record``'s response is a stream (``infer:active_streams`` + 1 until it ends)."""
        key = id(record)
        if key not in self._streams:
            self._streams.add(key)
            self._active_streams.inc()

    def request_finished(self, record: RequestRecord) -> None:
        """An API request ended: count it by route, method and status, its duration and
        tokens; ``active_requests`` (and ``active_streams`` if it streamed) - 1."""
        self._active_requests.dec()
        key = id(record)
        if key in self._streams:
            self._streams.discard(key)
            self._active_streams.dec()
        code = "500" if record.status is None else str(record.status)
        route = self._route_label(record.route)
        method = record.method if record.method in HTTP_METHODS else OTHER
        self._requests.labels(self.model_name, route, method, code).inc()
        if record.status is None or record.status >= 400:
            self._errors.labels(self.model_name, code).inc()
        duration = self._clock() - record.started_s
        self._duration.labels(self.model_name, route).observe(duration)
        if record.rollout is not None and record.model is not None:
            labels = (self.model_name, record.rollout, record.model)
            self._rollout_requests.labels(*labels, code).inc()
            self._rollout_duration.labels(*labels).observe(duration)
            if (ttft := record.ttft_s) is not None:
                self._rollout_ttft.labels(*labels).observe(ttft)
        if record.prompt_tokens:
            self._tokens_input.inc(record.prompt_tokens)
        if record.completion_tokens:
            self._tokens_output.inc(record.completion_tokens)

    def _route_label(self, route: str) -> str:
        if route in self._routes:
            return route
        if len(self._routes) >= MAX_ROUTES:
            return OTHER
        self._routes.add(route)
        return route

    def rate_limited(self, tenant_id: str | None, limit: str) -> None:
        """A request refused by a rate limit (``limit``: requests, tokens, streams, queue)."""
        self._rate_limited.labels(self.model_name, limit).inc()
        self._tenant_limited.labels(self.model_name, self._tenant_label(tenant_id)).inc()

    # -- Tinker -------------------------------------------------------------------------

    def on_training_op(self, stats: TrainingOpStats) -> None:
        """The Tinker service's observer port: :meth:`training_op` for one operation."""
        self.training_op(stats.op, stats.tokens, stats.end_s - stats.start_s, stats.ok)

    def training_op(self, op: str, tokens: int, seconds: float, ok: bool) -> None:
        """One Tinker operation ran (``op``: forward_backward, optim_step, ...)."""
        self._tinker_ops.labels(self.model_name, op, "ok" if ok else "error").inc()
        if tokens:
            self._tinker_tokens.labels(self.model_name, op).inc(tokens)
        self._tinker_seconds.labels(self.model_name, op).observe(seconds)

    def track_pending_futures(self, fn: Callable[[], int]) -> None:
        """Report ``fn()`` as ``infer:tinker_pending_futures`` at every scrape."""
        self._pending_futures.set_function(fn)

    def track_usage(self, recorder: Any) -> None:
        """Report the usage recorder's queue, drops and failed writes at every scrape."""
        self._usage_pending.set_function(lambda: recorder.pending)
        self._usage_dropped.set_function(lambda: recorder.dropped)
        self._usage_failures.set_function(lambda: recorder.failures)

    # -- exposition ---------------------------------------------------------------------

    def render(self) -> tuple[bytes, str]:
        """The text exposition of every metric, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
