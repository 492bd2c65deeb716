"""Traces: the API request's SERVER span continues the caller's trace; engine requests
are its children with their life (queue, prefill, decode) and GenAI attributes; engine
steps are root spans linked to the requests they served; no text is recorded."""

from typing import Any

import pytest
from litestar.testing import TestClient
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from adapters.fake import ByteTokenizer
from adapters.fake.runner import reply_script
from adapters.http import create_app
from adapters.observability.http import ObservedApp
from adapters.observability.tracing import Tracing, TracingSettings, build_tracer_provider
from domain.observer import TrainingOpStats
from domain.speculation import SpeculativeConfig
from tests.fakes import fake_async_engine

REPLY = "Paris is the capital."
PROMPT_TOKENS = len(ByteTokenizer().encode("Hi"))
OUTPUT_TOKENS = len(REPLY) + 1  # the reply, then EOS
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


@pytest.fixture
def traced() -> Any:
    exporter = InMemorySpanExporter()
    provider = build_tracer_provider(TracingSettings(), (SimpleSpanProcessor(exporter),))
    tracing = Tracing(provider, "fake")
    engine = fake_async_engine(script=reply_script(ByteTokenizer(), REPLY), observer=tracing)
    app = ObservedApp(create_app(engine, "fake"), tracing=tracing)
    with TestClient(app=app) as client:  # type: ignore[arg-type]
        yield client, exporter
    provider.shutdown()


def _by_name(spans: list[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


def test_a_completion_is_traced_from_the_callers_span_through_the_engine(traced) -> None:
    client, exporter = traced
    response = client.post(
        "/v1/completions",
        json={"model": "fake", "prompt": "Hi", "max_tokens": 64, "temperature": 0.5},
        headers={"traceparent": TRACEPARENT, "x-request-id": "req-42"},
    )
    assert response.status_code == 200, response.text
    assert response.headers["x-request-id"] == "req-42"
    spans = exporter.get_finished_spans()

    [server] = _by_name(spans, "POST /v1/completions")
    assert server.kind == SpanKind.SERVER
    assert format(server.context.trace_id, "032x") == TRACE_ID
    assert server.parent is not None and format(server.parent.span_id, "016x") == PARENT_ID
    assert server.attributes["http.response.status_code"] == 200
    assert server.attributes["infer.request_id"] == "req-42"
    assert server.attributes["gen_ai.usage.output_tokens"] == OUTPUT_TOKENS

    [tokenize] = _by_name(spans, "tokenize")
    assert tokenize.parent.span_id == server.context.span_id

    [request] = _by_name(spans, "engine.request")
    assert request.context.trace_id == server.context.trace_id
    assert request.parent.span_id == server.context.span_id
    attributes = request.attributes
    assert attributes["gen_ai.request.model"] == "fake"
    assert attributes["gen_ai.request.max_tokens"] == 64
    assert attributes["gen_ai.request.temperature"] == 0.5
    assert attributes["gen_ai.usage.input_tokens"] == PROMPT_TOKENS
    assert attributes["gen_ai.usage.output_tokens"] == OUTPUT_TOKENS
    assert attributes["gen_ai.response.finish_reasons"] == ("eos",)
    assert attributes["infer.ttft_s"] >= 0 and attributes["infer.queue_time_s"] >= 0

    life = {s.name: s for s in spans if s.parent and s.parent.span_id == request.context.span_id}
    assert set(life) == {"queue", "prefill", "decode"}
    assert life["queue"].end_time <= life["prefill"].start_time + 1
    assert life["prefill"].end_time <= life["decode"].start_time + 1
    assert [e.name for e in life["prefill"].events] == ["prefill chunk"]
    assert request.start_time <= life["queue"].start_time
    assert life["decode"].end_time <= request.end_time

    steps = _by_name(spans, "engine.step")
    assert len(steps) == OUTPUT_TOKENS  # one token a step
    for step in steps:
        assert step.parent is None  # a root: steps serve many traces
        assert [link.context.span_id for link in step.links] == [request.context.span_id]
    assert steps[0].attributes["infer.step.prefill_tokens"] == PROMPT_TOKENS
    assert steps[-1].attributes["infer.step.decode_rows"] == 1

    # No prompt or output text anywhere.
    for span in spans:
        for value in (span.attributes or {}).values():
            assert value != "Hi" and REPLY not in str(value)


def test_one_step_span_links_every_request_it_served(traced) -> None:
    client, exporter = traced
    response = client.post(
        "/v1/completions", json={"model": "fake", "prompt": ["a", "b", "c"], "max_tokens": 4}
    )
    assert response.status_code == 200, response.text
    spans = exporter.get_finished_spans()
    requests = {s.context.span_id for s in _by_name(spans, "engine.request")}
    assert len(requests) == 3
    shared = [s for s in _by_name(spans, "engine.step") if len(s.links) == 3]
    assert shared and all({link.context.span_id for link in s.links} == requests for s in shared)
    [server] = _by_name(spans, "POST /v1/completions")
    # Without a caller's traceparent, the server span starts the trace.
    assert server.parent is None


def test_errors_and_unknown_routes_are_traced_with_their_status(traced) -> None:
    client, exporter = traced
    assert client.post("/v1/completions", json={"model": "nope", "prompt": "x"}).status_code == 404
    assert client.get("/no/such/route").status_code == 404
    names = [
        (s.name, s.attributes["http.response.status_code"])
        for s in exporter.get_finished_spans()
        if s.kind == SpanKind.SERVER
    ]
    assert ("POST /v1/completions", 404) in names
    assert ("GET /no/such/route", 404) in names
    assert not _by_name(exporter.get_finished_spans(), "engine.request")


def test_a_bad_request_id_is_replaced_and_a_trace_tag_echoed(traced) -> None:
    client, _ = traced
    response = client.get(
        "/v1/models", headers={"x-request-id": "x" * 500, "x-request-trace": "mytag-1"}
    )
    assert len(response.headers["x-request-id"]) == 32
    assert response.headers["x-request-trace"] == "mytag-1"


def test_settings_pick_the_exporter_from_flags_and_the_standard_variables() -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}
    assert TracingSettings().resolved_endpoint(env) == "http://collector:4318"
    assert TracingSettings().resolved_protocol(env) == "http/protobuf"
    env["OTEL_EXPORTER_OTLP_PROTOCOL"] = "grpc"
    assert TracingSettings().resolved_protocol(env) == "grpc"
    assert TracingSettings(endpoint="grpc://jaeger:4317").resolved_protocol({}) == "grpc"
    assert TracingSettings().resolved_endpoint({}) is None
    with pytest.raises(ValueError, match="protocol"):
        TracingSettings(protocol="thrift").resolved_protocol({})


def test_a_tinker_operation_becomes_a_span_with_its_ids() -> None:
    exporter = InMemorySpanExporter()
    provider = build_tracer_provider(TracingSettings(), (SimpleSpanProcessor(exporter),))
    tracing = Tracing(provider, "fake")
    tracing.on_training_op(
        TrainingOpStats("ForwardBackward", "tenant-a", 10.0, 10.5, True, 96, "s1:train:0", "s1")
    )
    tracing.on_training_op(TrainingOpStats("OptimStep", "tenant-a", 11.0, 11.1, False))
    fb, optim = exporter.get_finished_spans()
    assert fb.name == "tinker.forward_backward" and optim.name == "tinker.optim_step"
    assert fb.attributes["infer.tinker.model_id"] == "s1:train:0"
    assert fb.attributes["infer.tinker.session_id"] == "s1"
    assert fb.attributes["infer.tinker.tokens"] == 96
    assert fb.end_time - fb.start_time == pytest.approx(0.5e9, rel=1e-3)
    assert not optim.status.is_ok


def test_a_speculated_request_carries_its_acceptance_in_its_span() -> None:
    exporter = InMemorySpanExporter()
    provider = build_tracer_provider(TracingSettings(), (SimpleSpanProcessor(exporter),))
    tracing = Tracing(provider, "fake")
    spec = SpeculativeConfig(prompt_lookup_min=2, prompt_lookup_max=4)
    engine = fake_async_engine(
        script=reply_script(ByteTokenizer(), REPLY), observer=tracing, speculative_config=spec
    )
    app = ObservedApp(create_app(engine, "fake"), tracing=tracing)
    with TestClient(app=app) as client:  # type: ignore[arg-type]
        body = {"model": "fake", "prompt": f"Repeat: {REPLY}", "max_tokens": 64}
        assert client.post("/v1/completions", json=body).json()["choices"][0]["text"] == REPLY
    provider.shutdown()
    [request] = _by_name(exporter.get_finished_spans(), "engine.request")
    drafted = request.attributes["infer.spec.draft_tokens"]
    accepted = request.attributes["infer.spec.accepted_tokens"]
    assert 0 < accepted <= drafted
    assert request.attributes["infer.spec.acceptance_rate"] == accepted / drafted
    assert request.attributes["gen_ai.usage.output_tokens"] == OUTPUT_TOKENS
