"""OpenTelemetry traces: a span per API request, the request's life in the engine inside
it, and a span per engine step linked to the requests it served.

Spans (names; GenAI semantic-convention attributes where one exists):

- ``POST /v1/completions`` (SERVER): one per API request, continuing the caller's W3C
  ``traceparent``; children ``tokenize`` (preparation off the event loop) and one
  ``engine.request`` per engine request it queued.
- ``engine.request``: arrival to finish, with ``gen_ai.request.*`` (model, max_tokens,
  temperature, top_p), ``gen_ai.usage.input_tokens`` / ``output_tokens``,
  ``gen_ai.response.finish_reasons``, ``infer.ttft_s``, ``infer.queue_time_s``, the tenant;
  children ``queue`` (arrival to first scheduled), ``prefill`` (first scheduled to first
  token, an event per prompt chunk), ``decode`` (first token to finish); an event per
  preemption.
- ``engine.step``: one per step that ran (rows, prefill tokens, decode rows, running,
  waiting, KV usage), a root span **linked** to the ``engine.request`` span of every
  request in its batch: from a slow request, the steps it shared and who else was in them.
- ``tinker.<op>``: Tinker operations (``tinker.forward_backward``, ``tinker.optim_step``,
  ``tinker.sample``, ``tinker.save_weights``, ``tinker.load_weights``...), with the model
  (run), session and tenant ids and the tokens processed.

Spans are built on the step loop from the engine's statistics (:class:`StepStats`), with
the engine clock's times converted to wall time; export runs in the SDK's batch
processor's thread, so the loop never waits on the network (a full queue drops spans).
Prompt and output text are never recorded.
"""

import os
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagate import extract, inject
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode

from application.serving.request_record import RequestRecord
from domain.observer import RequestStart, RequestStats, StepStats, TrainingOpStats

PROTOCOLS = ("http/protobuf", "grpc")
DEFAULT_SERVICE_NAME = "infer"


@dataclass(frozen=True, slots=True)
class TracingSettings:
    """Where spans go. ``endpoint``: an OTLP receiver (``http://host:4318`` — the traces
    path is added when missing — or ``grpc://host:4317``); None: the standard
    ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT`` variables;
    ``protocol``: None: ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_PROTOCOL``,
    else ``http/protobuf``; ``console``: also print spans (local debugging)."""

    endpoint: str | None = None
    protocol: str | None = None
    console: bool = False
    service_name: str | None = None

    def resolved_endpoint(self, env: Mapping[str, str] = os.environ) -> str | None:
        return (
            self.endpoint
            or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
            or None
        )

    def resolved_protocol(self, env: Mapping[str, str] = os.environ) -> str:
        endpoint = self.resolved_endpoint(env) or ""
        if endpoint.startswith("grpc://"):
            return "grpc"
        protocol = (
            self.protocol
            or env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
            or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
            or "http/protobuf"
        )
        if protocol not in PROTOCOLS:
            raise ValueError(
                f"OTLP protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}"
            )
        return protocol

    @property
    def enabled(self) -> bool:
        return self.console or self.resolved_endpoint() is not None


def otlp_exporter(endpoint: str, protocol: str) -> SpanExporter:
    """The OTLP span exporter for ``endpoint`` over ``protocol``."""
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )

        parts = urlsplit(endpoint)
        insecure = parts.scheme in ("grpc", "http")
        target = parts.netloc or endpoint
        return GrpcExporter(endpoint=target, insecure=insecure)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )

    parts = urlsplit(endpoint)
    if parts.path in ("", "/"):
        endpoint = endpoint.rstrip("/") + "/v1/traces"
    return HttpExporter(endpoint=endpoint)


def build_tracer_provider(
    settings: TracingSettings, processors: tuple[SpanProcessor, ...] = ()
) -> TracerProvider:
    """A tracer provider exporting as ``settings`` say (batch processor for OTLP), plus
    ``processors`` (tests: a simple processor over an in-memory exporter)."""
    name = settings.service_name or os.environ.get("OTEL_SERVICE_NAME") or DEFAULT_SERVICE_NAME
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    endpoint = settings.resolved_endpoint()
    if endpoint is not None:
        exporter = otlp_exporter(endpoint, settings.resolved_protocol())
        provider.add_span_processor(BatchSpanProcessor(exporter))
    if settings.console:
        # stderr, with the logs: stdout is the CLI's product
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(out=sys.stderr)))
    for processor in processors:
        provider.add_span_processor(processor)
    return provider


@dataclass
class _LiveRequest:
    span: Span
    start: RequestStart
    chunks: list[tuple[int, int]] = field(default_factory=list)  # (time ns, prompt tokens)
    preempted_ns: list[int] = field(default_factory=list)


class Tracing:
    """The tracing adapter: a step observer (engine spans) and the server-span context the
    HTTP middleware opens per API request. ``clock``: the engine's (monotonic) clock, whose
    readings the statistics carry."""

    def __init__(self, provider: TracerProvider, model_name: str) -> None:
        self.provider = provider
        self.model_name = model_name
        self.tracer = provider.get_tracer("infer")
        # Engine-clock seconds (time.monotonic) -> wall-clock nanoseconds.
        self._offset_ns = time.time_ns() - time.monotonic_ns()
        self._live: dict[str, _LiveRequest] = {}

    def shutdown(self) -> None:
        """Flush what is queued and stop exporting."""
        self.provider.shutdown()

    def _ns(self, seconds: float) -> int:
        return int(seconds * 1e9) + self._offset_ns

    # -- the API request --------------------------------------------------------------

    @contextmanager
    def server_span(self, record: RequestRecord, headers: Mapping[str, str]) -> Iterator[Span]:
        """The SERVER span of one API request, current while it is served; continues the
        caller's ``traceparent``; the record gets the trace context engine requests are
        queued with. Its attributes come from the record when the request ends."""
        parent = extract(dict(headers))
        name = f"{record.method} {record.route}"
        start_ns = self._ns(record.started_s)
        span = self.tracer.start_span(name, parent, SpanKind.SERVER, start_time=start_ns)
        span.set_attribute("http.request.method", record.method)
        span.set_attribute("url.path", record.route)
        if record.request_id:
            span.set_attribute("infer.request_id", record.request_id)
        if trace_tag := headers.get("x-request-trace"):
            span.set_attribute("infer.request_trace", trace_tag)
        token = otel_context.attach(trace.set_span_in_context(span))
        carrier: dict[str, str] = {}
        inject(carrier)
        record.trace = tuple(sorted(carrier.items()))
        try:
            yield span
        except BaseException as e:
            span.record_exception(e)
            raise
        finally:
            otel_context.detach(token)
            self._end_server_span(span, record)

    def _end_server_span(self, span: Span, record: RequestRecord) -> None:
        span.update_name(f"{record.method} {record.route}")
        span.set_attribute("http.route", record.route)
        status = record.status if record.status is not None else 500
        span.set_attribute("http.response.status_code", status)
        if status >= 500:
            span.set_status(Status(StatusCode.ERROR))
        if record.tenant_id is not None:
            span.set_attribute("infer.tenant_id", record.tenant_id)
        if record.model is not None:
            span.set_attribute("gen_ai.request.model", record.model)
        if record.prompt_tokens or record.completion_tokens:
            span.set_attribute("gen_ai.usage.input_tokens", record.prompt_tokens)
            span.set_attribute("gen_ai.usage.output_tokens", record.completion_tokens)
        if record.finish_reasons:
            span.set_attribute("gen_ai.response.finish_reasons", record.finish_reasons)
        if record.ttft_s is not None:
            span.set_attribute("infer.ttft_s", record.ttft_s)
        context = trace.set_span_in_context(span)
        for name, start_s, end_s in record.timings:
            child = self.tracer.start_span(name, context, start_time=self._ns(start_s))
            child.end(end_time=self._ns(end_s))
        span.end()

    # -- the engine -------------------------------------------------------------------

    def on_step(self, stats: StepStats) -> None:
        for start in stats.started:
            self._start_request(start)
        if stats.ran and stats.start_s is not None:
            self._step_span(stats, stats.start_s)
        for request_id in stats.preempted:
            if (live := self._live.get(request_id)) is not None:
                live.preempted_ns.append(self._ns(stats.time_s))
        for ended in stats.finished:
            self._end_request(ended)

    def _start_request(self, start: RequestStart) -> None:
        parent = extract(dict(start.context.trace)) if start.context.trace else None
        params = start.params
        attributes: dict[str, Any] = {
            "gen_ai.system": "infer",
            "gen_ai.operation.name": "text_completion",
            "gen_ai.request.model": self.model_name,
            "gen_ai.request.max_tokens": params.max_tokens,
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p,
            "gen_ai.usage.input_tokens": start.prompt_tokens,
            "infer.request_id": start.request_id,
            "infer.priority": start.context.priority,
        }
        if params.seed is not None:
            attributes["gen_ai.request.seed"] = params.seed
        if start.context.tenant_id is not None:
            attributes["infer.tenant_id"] = start.context.tenant_id
        if start.adapter_id is not None:
            attributes["infer.adapter_id"] = start.adapter_id
        span = self.tracer.start_span(
            "engine.request",
            parent or otel_context.Context(),
            attributes=attributes,
            start_time=self._ns(start.arrival_s),
        )
        self._live[start.request_id] = _LiveRequest(span, start)

    def _step_span(self, stats: StepStats, start_s: float) -> None:
        links = []
        prefill_rows = decode_rows = 0
        end_ns = self._ns(stats.time_s)
        for row in stats.rows:
            live = self._live.get(row.request_id)
            if row.prefill_tokens:
                prefill_rows += 1
                if live is not None:
                    live.chunks.append((end_ns, row.prefill_tokens))
            if row.decode_tokens:
                decode_rows += 1
            if live is not None:
                links.append(
                    Link(
                        live.span.get_span_context(),
                        {"prefill_tokens": row.prefill_tokens, "decode_tokens": row.decode_tokens},
                    )
                )
        scheduler = stats.scheduler
        span = self.tracer.start_span(
            "engine.step",
            otel_context.Context(),  # a root: a step serves many traces
            links=links,
            start_time=self._ns(start_s),
            attributes={
                "infer.step.rows": len(stats.rows),
                "infer.step.prefill_rows": prefill_rows,
                "infer.step.prefill_tokens": scheduler.prefill_tokens,
                "infer.step.decode_rows": decode_rows,
                "infer.step.decode_tokens": scheduler.decode_tokens,
                "infer.step.sampled_tokens": stats.sampled_tokens,
                "infer.step.time_s": stats.time_s - start_s,
                "infer.scheduler.running": scheduler.running,
                "infer.scheduler.waiting": scheduler.waiting,
                "infer.kv_cache.usage": scheduler.kv_usage,
            },
        )
        span.end(end_time=end_ns)

    def _end_request(self, stats: RequestStats) -> None:
        live = self._live.pop(stats.request_id, None)
        if live is None:
            return
        span = live.span
        context = trace.set_span_in_context(span)
        end_ns = self._ns(stats.finished_s)
        scheduled_ns = self._ns(stats.scheduled_s) if stats.scheduled_s is not None else end_ns
        self._child("queue", context, self._ns(stats.arrival_s), scheduled_ns)
        if stats.scheduled_s is not None:
            first_ns = self._ns(stats.first_token_s) if stats.first_token_s is not None else end_ns
            prefill = self.tracer.start_span("prefill", context, start_time=scheduled_ns)
            for at_ns, tokens in live.chunks:
                prefill.add_event("prefill chunk", {"tokens": tokens}, timestamp=at_ns)
            prefill.end(end_time=max(first_ns, scheduled_ns))
            if stats.first_token_s is not None:
                decode = self.tracer.start_span("decode", context, start_time=first_ns)
                decode.set_attribute("gen_ai.usage.output_tokens", stats.completion_tokens)
                decode.end(end_time=max(end_ns, first_ns))
        for at_ns in live.preempted_ns:
            span.add_event("preempted", timestamp=at_ns)
        span.set_attribute("gen_ai.usage.input_tokens", stats.prompt_tokens)
        span.set_attribute("gen_ai.usage.output_tokens", stats.completion_tokens)
        span.set_attribute("gen_ai.response.finish_reasons", [stats.finish_reason])
        if stats.first_token_s is not None:
            span.set_attribute("infer.ttft_s", stats.first_token_s - stats.arrival_s)
        if stats.scheduled_s is not None:
            span.set_attribute("infer.queue_time_s", stats.scheduled_s - stats.arrival_s)
        if stats.preemptions:
            span.set_attribute("infer.preemptions", stats.preemptions)
        if stats.drafted_tokens:  # speculative decoding: its drafts, and those accepted
            span.set_attribute("infer.spec.draft_tokens", stats.drafted_tokens)
            span.set_attribute("infer.spec.accepted_tokens", stats.accepted_tokens)
            span.set_attribute(
                "infer.spec.acceptance_rate", stats.accepted_tokens / stats.drafted_tokens
            )
        if stats.finish_reason == "error":
            span.set_status(Status(StatusCode.ERROR, "the engine step failed"))
        span.end(end_time=end_ns)

    def _child(self, name: str, context: otel_context.Context, start_ns: int, end_ns: int) -> None:
        child = self.tracer.start_span(name, context, start_time=start_ns)
        child.end(end_time=max(end_ns, start_ns))

    # -- Tinker -----------------------------------------------------------------------

    def on_training_op(self, stats: TrainingOpStats) -> None:
        """A ``tinker.<op>`` span (a root) for one Tinker operation that ran."""
        attributes: dict[str, Any] = {
            "infer.tinker.op": stats.op,
            "infer.tenant_id": stats.tenant_id,
            "infer.tinker.tokens": stats.tokens,
        }
        if stats.run_id is not None:
            attributes["infer.tinker.model_id"] = stats.run_id
        if stats.session_id is not None:
            attributes["infer.tinker.session_id"] = stats.session_id
        span = self.tracer.start_span(
            f"tinker.{_snake(stats.op)}",
            otel_context.Context(),
            attributes=attributes,
            start_time=self._ns(stats.start_s),
        )
        if not stats.ok:
            span.set_status(Status(StatusCode.ERROR))
        span.end(end_time=self._ns(max(stats.end_s, stats.start_s)))


def _snake(name: str) -> str:
    """``ForwardBackward`` -> ``forward_backward``."""
    return "".join(f"_{c.lower()}" if c.isupper() and i else c.lower() for i, c in enumerate(name))
