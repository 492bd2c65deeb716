"""Structured logs: JSON lines, one canonical line per API request with its numbers (never
its text), the request id and trace ids on every line written inside the request, and
uvicorn's loggers routed through the same pipeline."""

import io
import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from litestar.testing import TestClient
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from adapters.fake import ByteTokenizer
from adapters.fake.runner import reply_script
from adapters.http import create_app
from adapters.observability.http import ObservedApp
from adapters.observability.logging import configure_logging
from adapters.observability.tracing import Tracing, TracingSettings, build_tracer_provider
from tests.fakes import fake_async_engine
from tests.support.json_logs import json_log_stream

REPLY = "The secret reply."
PROMPT = "my private prompt"


@pytest.fixture
def log_stream() -> Iterator[io.StringIO]:
    with json_log_stream() as stream:
        yield stream


def _lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]


def _app(tracing: Tracing | None = None) -> ObservedApp:
    engine = fake_async_engine(script=reply_script(ByteTokenizer(), REPLY), observer=tracing)
    return ObservedApp(create_app(engine, "fake"), tracing=tracing)


def test_one_canonical_json_line_per_request_with_numbers_and_no_text(log_stream) -> None:
    with TestClient(app=_app()) as client:  # type: ignore[arg-type]
        response = client.post(
            "/v1/chat/completions",
            json={
                "model": "fake",
                "messages": [{"role": "user", "content": PROMPT}],
                "user": "user-7",
                "max_tokens": 64,
            },
            headers={"x-request-id": "abc-123"},
        )
        assert response.status_code == 200, response.text
        usage = response.json()["usage"]
        client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
    text = log_stream.getvalue()
    assert PROMPT not in text and REPLY not in text
    requests = [line for line in _lines(log_stream) if line["event"] == "request"]
    assert len(requests) == 2
    ok, refused = requests
    assert ok["request_id"] == "abc-123" and ok["logger"] == "infer.request"
    assert (ok["method"], ok["route"], ok["status"]) == ("POST", "/v1/chat/completions", 200)
    assert ok["tokens_in"] == usage["prompt_tokens"]
    assert ok["tokens_out"] == usage["completion_tokens"]
    assert (ok["finish_reason"], ok["user"], ok["model"], ok["stream"]) == (
        "eos",
        "user-7",
        "fake",
        False,
    )
    assert ok["latency_ms"] >= ok["ttft_ms"] >= 0
    assert ok["level"] == "info" and "timestamp" in ok
    assert (refused["status"], refused["tokens_in"], refused["ttft_ms"]) == (404, 0, None)
    assert refused["request_id"] != ok["request_id"]


def test_lines_inside_a_request_carry_its_request_and_trace_ids(log_stream) -> None:
    exporter = InMemorySpanExporter()
    provider = build_tracer_provider(TracingSettings(), (SimpleSpanProcessor(exporter),))
    with TestClient(app=_app(Tracing(provider, "fake"))) as client:  # type: ignore[arg-type]
        client.post(
            "/v1/completions",
            json={"model": "fake", "prompt": "Hi", "stream": True, "max_tokens": 8},
        )
    [line] = [line for line in _lines(log_stream) if line["event"] == "request"]
    [server] = [s for s in exporter.get_finished_spans() if s.name == "POST /v1/completions"]
    assert line["trace_id"] == format(server.context.trace_id, "032x")
    assert line["span_id"] == format(server.context.span_id, "016x")
    assert line["stream"] is True and line["tokens_out"] == 8


def test_standard_library_and_uvicorn_records_go_through_the_pipeline(log_stream) -> None:
    logging.getLogger("uvicorn.error").warning("port %d busy", 8000)
    logging.getLogger("some.library").info("hello")
    lines = _lines(log_stream)
    assert {"event": "port 8000 busy", "level": "warning", "logger": "uvicorn.error"}.items() <= (
        lines[0].items()
    )
    assert lines[1]["logger"] == "some.library"


def test_a_bad_level_or_format_is_refused() -> None:
    with pytest.raises(ValueError, match="log level"):
        configure_logging("loud", "json")
    with pytest.raises(ValueError, match="log format"):
        configure_logging("info", "xml")


def test_a_key_reload_writes_an_audit_line(log_stream) -> None:
    from application.access.access import Access
    from application.access.keys import Keyring, hash_key
    from domain.tenancy import Tenant

    access = Access(Keyring([(hash_key("a"), Tenant("alice")), (hash_key("b"), Tenant("bob"))]))
    access.replace(Keyring([(hash_key("c"), Tenant("carol")), (hash_key("b"), Tenant("bob"))]), "k")
    [line] = [line for line in _lines(log_stream) if line["logger"] == "infer.audit"]
    assert line["event"] == "api keys reloaded"
    assert (line["added"], line["removed"], line["tenants"], line["source"]) == (
        ["carol"],
        ["alice"],
        2,
        "k",
    )


class _Records:
    """RequestMetrics that keeps the finished records."""

    def __init__(self) -> None:
        self.finished: list[Any] = []

    def request_started(self, record: Any) -> None: ...

    def stream_started(self, record: Any) -> None: ...

    def request_finished(self, record: Any) -> None:
        self.finished.append(record)


async def test_a_handler_cancelled_before_answering_is_a_499_not_a_500() -> None:
    """A client that goes away mid long poll: its request is counted as closed by the
    client, not as a server error; a handler that fails is still a 500."""
    import asyncio

    async def cancelled(scope: Any, receive: Any, send: Any) -> None:
        raise asyncio.CancelledError

    async def failing(scope: Any, receive: Any, send: Any) -> None:
        raise RuntimeError("bug")

    scope = {"type": "http", "method": "POST", "path": "/api/v1/retrieve_future", "headers": []}
    cases = [(cancelled, asyncio.CancelledError, 499), (failing, RuntimeError, 500)]
    for app, error, status in cases:
        records = _Records()
        with pytest.raises(error):
            await ObservedApp(app, metrics=records, log_requests=False)(dict(scope), None, None)
        assert [r.status for r in records.finished] == [status]
