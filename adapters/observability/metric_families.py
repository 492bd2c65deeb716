"""The families of :class:`~adapters.observability.metrics.Metrics`, each registered in the
instance's ``CollectorRegistry`` (in the order of the exposition), named ``infer:...`` (and
vLLM's ``vllm:...`` where routers read those) with a ``model_name`` label; the buckets of
their histograms.

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

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

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

FINISH_REASONS = ("eos", "stop", "length", "abort", "error")


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


class MetricFamilies:
    """Every metric of the server in ``registry`` (see the module), in the order of the
    exposition; those labelled by ``model_name`` only are its child for ``model_name``,
    the others the family (labelled as they are recorded)."""

    def __init__(self, model_name: str, registry: CollectorRegistry, max_num_seqs: int) -> None:
        self.model_name = model_name
        self.registry = registry
        self._engine_metrics()
        self._engine_histograms(max_num_seqs)
        self._tenant_metrics()
        self._http_metrics()
        self._tinker_metrics()

    def _gauge(self, name: str, doc: str) -> Gauge:
        return self._gauges(name, doc).labels(self.model_name)

    def _counter(self, name: str, doc: str) -> Counter:
        return self._counters(name, doc).labels(self.model_name)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return self._histograms(name, doc, (), buckets).labels(self.model_name)

    def _counters(self, name: str, doc: str, *labels: str) -> Counter:
        """A counter family labelled by ``model_name`` and ``labels``."""
        return Counter(name, doc, ("model_name", *labels), registry=self.registry)

    def _gauges(self, name: str, doc: str, *labels: str) -> Gauge:
        """A gauge family labelled by ``model_name`` and ``labels``."""
        return Gauge(name, doc, ("model_name", *labels), registry=self.registry)

    def _histograms(
        self, name: str, doc: str, labels: tuple[str, ...], buckets: tuple[float, ...]
    ) -> Histogram:
        """A histogram family labelled by ``model_name`` and ``labels``."""
        return Histogram(
            name, doc, ("model_name", *labels), registry=self.registry, buckets=buckets
        )

    def _engine_metrics(self) -> None:
        """The engine's scheduler state, tokens and events."""
        # Engine: scheduler state after the latest step.
        self.running = self._gauge("infer:num_requests_running", "Requests holding a batch slot.")
        self.waiting = self._gauge(
            "infer:num_requests_waiting", "Requests queued for a batch slot."
        )
        self.kv_usage = self._gauge(
            "infer:kv_cache_usage_perc", "Fraction of the KV cache in use (0..1)."
        )
        self.kv_bytes = self._gauge("infer:kv_cache_bytes", "Bytes of the KV cache in use.")
        # The same three under vLLM's names, which llm-d's endpoint picker, vllm-router and
        # other vLLM-compatible routers read to place requests.
        self.vllm_state = (
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
        self.lora_info = self._gauges(
            "vllm:lora_requests_info",
            "Running and waiting LoRA adapters (vLLM's gauge; the value: when it was set).",
            "max_lora",
            "running_lora_adapters",
            "waiting_lora_adapters",
        )
        self.prefix_queries = self._counter(
            "infer:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = self._counter(
            "infer:prefix_cache_hits", "Prompt tokens found in the prefix cache (not computed)."
        )
        # Engine: tokens and events.
        self.prompt_tokens = self._counter("infer:prompt_tokens", "Prompt (prefill) tokens run.")
        self.generation_tokens = self._counter("infer:generation_tokens", "Tokens sampled.")
        self.preemptions = self._counter(
            "infer:num_preemptions", "Requests put back to the queue (their KV recomputed)."
        )
        self.spec_drafts = self._counter(
            "infer:spec_decode_num_drafts", "Requests' steps that verified speculative drafts."
        )
        self.spec_draft_tokens = self._counter(
            "infer:spec_decode_num_draft_tokens", "Speculative draft tokens verified."
        )
        self.spec_accepted = self._counter(
            "infer:spec_decode_num_accepted_tokens", "Speculative draft tokens accepted."
        )
        self.success = self._counters(
            "infer:request_success",
            "Ended requests by finish reason (eos, stop, length, abort, error).",
            "finished_reason",
        )
        self.success_by_reason = {
            reason: self.success.labels(self.model_name, reason) for reason in FINISH_REASONS
        }

    def _engine_histograms(self, max_num_seqs: int) -> None:
        """The engine's per-request and per-step histograms."""
        # Engine: per-request histograms.
        self.ttft = self._histogram(
            "infer:time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS
        )
        self.itl = self._histogram(
            "infer:inter_token_latency_seconds",
            "Time between a decoding request's consecutive tokens (step to step).",
            ITL_BUCKETS,
        )
        self.e2e = self._histogram(
            "infer:e2e_request_latency_seconds", "Arrival to end.", REQUEST_LATENCY_BUCKETS
        )
        self.queue = self._histogram(
            "infer:request_queue_time_seconds",
            "Arrival to first scheduled (waiting).",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prefill = self._histogram(
            "infer:request_prefill_time_seconds",
            "First scheduled to first token (prefill).",
            REQUEST_LATENCY_BUCKETS,
        )
        self.decode = self._histogram(
            "infer:request_decode_time_seconds",
            "First token to end (decode).",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_prompt = self._histogram(
            "infer:request_prompt_tokens", "Prompt tokens of an ended request.", token_buckets()
        )
        self.request_generation = self._histogram(
            "infer:request_generation_tokens",
            "Generated tokens of an ended request.",
            token_buckets(),
        )
        # Engine: per-step histograms.
        self.iteration_tokens = self._histogram(
            "infer:iteration_tokens_total",
            "Tokens run in one step (prefill + decode).",
            ITERATION_TOKENS_BUCKETS,
        )
        sizes = batch_buckets(max_num_seqs)
        self.batch_prefill = self._histogram(
            "infer:batch_size_prefill", "Rows of a step running prompt tokens.", sizes
        )
        self.batch_decode = self._histogram(
            "infer:batch_size_decode", "Rows of a step decoding.", sizes
        )

    def _tenant_metrics(self) -> None:
        """Per-tenant counters (bounded label values)."""
        self.tenant_requests = self._counters(
            "infer:tenant_requests", "Ended requests by tenant.", "tenant"
        )
        self.tenant_prompt = self._counters(
            "infer:tenant_prompt_tokens", "Prompt tokens of ended requests by tenant.", "tenant"
        )
        self.tenant_generation = self._counters(
            "infer:tenant_generation_tokens",
            "Generated tokens of ended requests by tenant.",
            "tenant",
        )
        self.tenant_limited = self._counters(
            "infer:tenant_rate_limited",
            "API requests refused by a rate limit, by tenant.",
            "tenant",
        )

    def _http_metrics(self) -> None:
        """The API's requests, rollouts' targets and rate limits."""
        # HTTP.
        self.requests = self._counters(
            "infer:requests",
            "API requests served, by route template, method and status code.",
            "route",
            "method",
            "code",
        )
        self.errors = self._counters(
            "infer:errors", "API requests answered with a status >= 400, by code.", "code"
        )
        self.duration = self._histograms(
            "infer:request_duration_seconds",
            "API request duration (start to response end), by route template.",
            ("route",),
            HTTP_DURATION_BUCKETS,
        )
        self.active_requests = self._gauge("infer:active_requests", "API requests being served.")
        self.active_streams = self._gauge(
            "infer:active_streams", "API requests streaming a response (SSE)."
        )
        self.tokens_input = self._counter("infer:tokens_input", "Prompt tokens of API requests.")
        self.tokens_output = self._counter(
            "infer:tokens_output", "Completion tokens of API requests."
        )
        # Rollouts: each target's requests, errors and latency (a canary's health).
        target = ("rollout", "target")
        self.rollout_requests = self._counters(
            "infer:rollout_requests",
            "API requests a rollout's name sent to each target, by status code.",
            *target,
            "code",
        )
        self.rollout_duration = self._histograms(
            "infer:rollout_request_duration_seconds",
            "API request duration (start to response end) per rollout target.",
            target,
            HTTP_DURATION_BUCKETS,
        )
        self.rollout_ttft = self._histograms(
            "infer:rollout_time_to_first_token_seconds",
            "Time to the first token per rollout target.",
            target,
            TTFT_BUCKETS,
        )
        # Rate limits.
        self.rate_limited = self._counters(
            "infer:rate_limit_dropped",
            "API requests refused by a rate limit, by limit (requests, tokens, streams, queue).",
            "limit",
        )

    def _tinker_metrics(self) -> None:
        """Tinker's operations and the usage ledger's writer."""
        # Tinker.
        self.tinker_ops = self._counters(
            "infer:tinker_operations",
            "Tinker operations run, by operation and status (ok, error).",
            "op",
            "status",
        )
        self.tinker_tokens = self._counters(
            "infer:tinker_tokens", "Tokens processed by Tinker operations, by operation.", "op"
        )
        self.tinker_seconds = self._histograms(
            "infer:tinker_operation_seconds",
            "Tinker operation duration, by operation.",
            ("op",),
            TINKER_SECONDS_BUCKETS,
        )
        self.pending_futures = self._gauge(
            "infer:tinker_pending_futures", "Tinker futures not yet resolved."
        )
        # The usage ledger's writer (behind: records queued; a database down: failures).
        self.usage_pending = self._gauge(
            "infer:usage_records_pending", "Usage records queued, not yet in the database."
        )
        self.usage_dropped = self._gauge(
            "infer:usage_records_dropped",
            "Usage records dropped since the start (the queue was full: the database behind).",
        )
        self.usage_failures = self._gauge(
            "infer:usage_write_failures", "Failed writes to the usage database since the start."
        )
        # A fleet's ingress: each replica's circuit breaker (a replica's id per label value,
        # as many as the fleet has had; not ``replica``: the fleet's /metrics labels each
        # sample with the process it came from under that name).
        self.breaker_open = self._gauges(
            "infer:replica_breaker_open",
            "1 while a replica's circuit breaker keeps it out of routing (open or probed).",
            "replica_id",
        )
        self.breaker_opens = self._counters(
            "infer:replica_breaker_opens", "Times a replica's circuit breaker opened.", "replica_id"
        )
