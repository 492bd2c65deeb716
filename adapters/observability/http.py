"""The outermost ASGI middleware: one :class:`RequestRecord` per API request, its id and
server span, and at its end the metrics and the canonical log line.

It wraps the whole HTTP app (routing included, so a 404 is counted and logged too):

- the request id: the client's ``X-Request-Id`` when it is a sane token (at most 128
  printable characters), else a new one; echoed in the response's ``X-Request-Id``, as is
  ``X-Request-Trace`` (a client's own trace tag); bound to every log line written while
  the request is served;
- with tracing, the SERVER span, current while the request is served (log lines carry its
  trace and span ids);
- with metrics, the request counters and gauges;
- one canonical log line per request (``event="request"``): request_id, tenant_id, model,
  method, route, status, latency_ms, ttft_ms, tokens_in, tokens_out, finish_reason, user,
  stream. Never the prompt or the output.
"""

import asyncio
import contextlib
import re
import time
import uuid
from collections.abc import Callable
from typing import Any, Protocol

import structlog

from adapters.observability.tracing import Tracing
from application.serving.request_record import RECORD_KEY, RequestRecord

_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")
# The status logged for a request whose handler was cancelled before it answered: the
# client went away (nginx's 499), not a server error.
CLIENT_CLOSED = 499
access_log = structlog.get_logger("infer.request")

ASGIApp = Callable[..., Any]


class RequestMetrics(Protocol):
    def request_started(self, record: RequestRecord) -> None: ...
    def stream_started(self, record: RequestRecord) -> None: ...
    def request_finished(self, record: RequestRecord) -> None: ...


class ObservedApp:
    def __init__(
        self,
        app: ASGIApp,
        *,
        tracing: Tracing | None = None,
        metrics: RequestMetrics | None = None,
        log_requests: bool = True,
    ) -> None:
        self.app, self.tracing, self.metrics = app, tracing, metrics
        self.log_requests = log_requests

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        given = headers.get("x-request-id", "")
        request_id = given if _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        record = RequestRecord(request_id=request_id, method=scope["method"], route=scope["path"])
        scope["state"] = {**scope.get("state", {}), RECORD_KEY: record}
        echoed = [(b"x-request-id", request_id.encode())]
        trace_tag = headers.get("x-request-trace", "")
        if _REQUEST_ID.fullmatch(trace_tag):
            echoed.append((b"x-request-trace", trace_tag.encode()))

        async def send_observed(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), *echoed]}
                if _is_event_stream(message) and self.metrics is not None:
                    record.stream = True
                    self.metrics.stream_started(record)
            await send(message)

        if self.metrics is not None:
            self.metrics.request_started(record)
        bound = structlog.contextvars.bound_contextvars(request_id=request_id)
        with bound, self._span(record, headers):
            try:
                await self.app(scope, receive, send_observed)
            except asyncio.CancelledError:  # the client went away (or the server stopped)
                if record.status is None:
                    record.status = CLIENT_CLOSED
                raise
            except BaseException:
                if record.status is None:
                    record.status = 500
                raise
            finally:  # inside the span: the log line carries its trace and span ids
                record.route = scope.get("path_template") or scope["path"]
                if self.metrics is not None:
                    self.metrics.request_finished(record)
                if self.log_requests:
                    _log(record)

    def _span(self, record: RequestRecord, headers: dict[str, str]) -> Any:
        if self.tracing is None:
            return contextlib.nullcontext()
        return self.tracing.server_span(record, headers)


def _headers(scope: dict[str, Any]) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}


def _is_event_stream(message: dict[str, Any]) -> bool:
    for name, value in message.get("headers", ()):
        if name.lower() == b"content-type":
            return bool(value.startswith(b"text/event-stream"))
    return False


def _log(record: RequestRecord) -> None:
    ttft = record.ttft_s
    access_log.info(
        "request",
        tenant_id=record.tenant_id,
        model=record.model,
        method=record.method,
        route=record.route,
        status=record.status,
        latency_ms=round((time.monotonic() - record.started_s) * 1000, 1),
        ttft_ms=None if ttft is None else round(ttft * 1000, 1),
        tokens_in=record.prompt_tokens,
        tokens_out=record.completion_tokens,
        finish_reason=",".join(record.finish_reasons) or None,
        user=record.user,
        stream=record.stream,
    )
