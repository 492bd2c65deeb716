"""Engine work is owned by the HTTP request that queued it.

An ASGI middleware gives every HTTP request its :class:`OwnedRequests` group and closes it when the
request ends, however it ends: the reply sent, an error after part of the work was queued,
a client gone before its stream was ever read, a cancellation. Closing aborts every engine
request of the group still queued or running, at once. (A stream's own cleanup cannot do
this alone: a generator that never started has no ``finally`` to run.)

The group also fills in the request's :class:`RequestRecord` (tokens in and out, finish
reasons, first-token time) from the engine outputs it passes on, for the logs, metrics and
traces, and queues its requests with the record's tenant and trace context.

The middleware also ends API requests early (every path but the probes ``/health``,
``/ready``, ``/metrics``): at ``request_timeout_s`` (the OpenAI endpoints and
``/v1/generate``), and when the server's drain runs out of time (:class:`Draining`). A
request with no response yet is cancelled and answered in its face's error format (504
``timeout``, 503); a stream gets an error event and its engine requests are aborted. While
draining, new API requests get 503 with ``Retry-After``.
"""

import asyncio
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog
from litestar import Request
from litestar.middleware import DefineMiddleware
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from adapters.http.errors import HTTPError
from application.engine_client import EngineClient, OwnedRequests
from application.quotas import Admission, Quotas
from application.request_record import RECORD_KEY, RequestRecord
from domain.request import RequestContext, StepOutput
from domain.sampling import SamplingParams

log = structlog.get_logger(__name__)
_KEY = "infer.request_group"
# Set by the access guard: the (Quotas, Admission) the request holds, settled at its end.
ADMISSION = "infer.admission"
# Not API work: served while draining, never timed out.
PROBES = frozenset({"/health", "/ready", "/metrics"})


@dataclass(frozen=True)
class Ending:
    """Why the server ends a request: its answer (no response started yet), or the error
    event of its stream. ``kind``: the OpenAI-schema error type (Tinker's is ``server``)."""

    status: int
    message: str
    kind: str
    headers: Mapping[str, str] = field(default_factory=dict)

    def error(self, path: str) -> HTTPError:
        kind = "server" if path.startswith("/api/") else self.kind
        return HTTPError(self.status, self.message, kind, headers=self.headers)


SHUTTING_DOWN = Ending(
    503, "the server is shutting down; retry", "server_error", {"Retry-After": "1"}
)


class InFlight:
    """An API request being served, and how to end it early."""

    def __init__(self, group: OwnedRequests, task: "asyncio.Task[Any]") -> None:
        self.group, self.task = group, task
        self.started = False  # the response's start went out
        self.ending: Ending | None = None

    def watch(self, send: Send) -> Send:
        async def watched(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.started = True
            await send(message)

        return watched

    def end(self, why: Ending) -> None:
        """A response under way (a stream) ends with an error event, its engine requests
        aborted; a request not answered yet is cancelled, then answered ``why``."""
        if self.ending is not None:
            return
        self.ending = why
        if self.started:
            self.group.fail(why.message)
        else:
            self.task.cancel()


class Draining:
    """The server's drain (begun on SIGTERM / SIGINT): new API requests get 503 and
    ``/ready`` 503; ``end_all`` ends the API requests still in flight."""

    def __init__(self) -> None:
        self.active = False
        self.flights: set[InFlight] = set()

    def begin(self) -> None:
        self.active = True

    @property
    def in_flight(self) -> int:
        return len(self.flights)

    def end_all(self) -> None:
        for flight in list(self.flights):
            flight.end(SHUTTING_DOWN)


def owning_middleware(
    engine: EngineClient, draining: Draining | None = None, request_timeout_s: float = 0.0
) -> DefineMiddleware:
    """The Litestar middleware giving each HTTP request its group (``request_timeout_s``
    0: no deadline)."""
    return DefineMiddleware(
        OwningMiddleware,
        engine=engine,
        draining=draining or Draining(),
        request_timeout_s=request_timeout_s,
    )


class OwningMiddleware:
    def __init__(
        self, app: ASGIApp, engine: EngineClient, draining: Draining, request_timeout_s: float
    ) -> None:
        self.app, self.engine, self.draining = app, engine, draining
        self.timed_out = Ending(504, f"request timed out after {request_timeout_s:g} s", "timeout")
        self.request_timeout_s = request_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.get("state", {})
        record = state.get(RECORD_KEY)
        if not isinstance(record, RequestRecord):
            record = RequestRecord()
        context = RequestContext(tenant_id=record.tenant_id, trace=record.trace)
        group = RecordingGroup(self.engine.group(context), record)
        # A state of its own (the server's may be shared between requests).
        state = scope["state"] = {**state, _KEY: group, RECORD_KEY: record}

        async def send_with_limits(message: Any) -> None:
            held = state.get(ADMISSION)
            if held is not None and message["type"] == "http.response.start":
                headers = [*message.get("headers", ()), *ratelimit_headers(held[1])]
                message = {**message, "headers": headers}
            await send(message)

        try:
            if scope["path"] in PROBES:
                await self.app(scope, receive, send)
            else:
                await self._serve_api(scope, receive, send_with_limits, group)
        finally:  # synchronous: it runs even when the request's task is cancelled
            group.close()
            held = state.get(ADMISSION)
            if held is not None:
                await _settle(held, record.prompt_tokens + record.completion_tokens)

    async def _serve_api(
        self, scope: Scope, receive: Receive, send: Send, group: OwnedRequests
    ) -> None:
        if self.draining.active:
            raise SHUTTING_DOWN.error(scope["path"])
        task = asyncio.current_task()
        assert task is not None
        flight = InFlight(group, task)
        deadline = None
        if self.request_timeout_s and scope["path"].startswith("/v1/"):
            loop = asyncio.get_running_loop()
            deadline = loop.call_later(self.request_timeout_s, flight.end, self.timed_out)
        self.draining.flights.add(flight)
        try:
            await self.app(scope, receive, flight.watch(send))
        except asyncio.CancelledError:
            if flight.ending is None or task.uncancel():
                raise  # not ours, or cancelled again since
            raise flight.ending.error(scope["path"]) from None
        finally:
            if deadline is not None:
                deadline.cancel()
            self.draining.flights.discard(flight)


def request_group(request: Request) -> OwnedRequests:
    """The group of the HTTP request being served."""
    state = request.scope["state"]
    assert _KEY in state, "owning_middleware is not installed"
    group: OwnedRequests = state[_KEY]
    return group


def request_record(request: Request) -> RequestRecord:
    """The record of the HTTP request being served."""
    record: RequestRecord = request.scope["state"][RECORD_KEY]
    return record


class RecordingGroup:
    """An :class:`OwnedRequests` group that notes what its streams carry in a record."""

    def __init__(self, group: OwnedRequests, record: RequestRecord) -> None:
        self._group, self._record = group, record

    @property
    def context(self) -> RequestContext:
        return self._group.context

    @context.setter
    def context(self, context: RequestContext) -> None:
        self._group.context = context

    def admit(
        self,
        request_ids: Sequence[str],
        prompts: Sequence[list[int]],
        params: SamplingParams,
        n: int = 1,
        *,
        adapter_id: str | None = None,
    ) -> list[AsyncIterator[StepOutput]]:
        streams = self._group.admit(request_ids, prompts, params, n, adapter_id=adapter_id)
        self._record.prompt_tokens += sum(map(len, prompts))  # once per prompt, whatever n
        return [self._recorded(stream) for stream in streams]

    def close(self) -> None:
        self._group.close()

    def fail(self, error: str) -> None:
        self._group.fail(error)

    async def _recorded(self, stream: AsyncIterator[StepOutput]) -> AsyncIterator[StepOutput]:
        record = self._record
        try:
            async for output in stream:
                if output.token_id is not None and record.first_token_s is None:
                    record.first_token_s = time.monotonic()
                if output.finished:
                    record.completion_tokens += output.completion_tokens
                    record.finish_reasons.append(output.finish_reason or "error")
                yield output
        finally:
            await stream.aclose()  # type: ignore[attr-defined]


async def _settle(held: tuple[Quotas, Admission], used_tokens: int) -> None:
    """Give back what the request reserved and did not use (even when cancelled)."""
    quotas, admission = held
    try:
        await asyncio.shield(quotas.settle(admission, used_tokens))
    except Exception:  # the counters' store is down: the window will reset on its own
        log.exception("settling a request's rate limits failed")


def ratelimit_headers(admission: Admission) -> list[tuple[bytes, bytes]]:
    """OpenAI's ``x-ratelimit-*`` headers for the limits the request was counted in."""
    headers = []
    for suffix, state in (("requests", admission.requests), ("tokens", admission.tokens)):
        if state is not None:
            headers += [
                (f"x-ratelimit-limit-{suffix}".encode(), str(state.limit).encode()),
                (f"x-ratelimit-remaining-{suffix}".encode(), str(state.remaining).encode()),
                (f"x-ratelimit-reset-{suffix}".encode(), f"{state.reset_s:.3f}s".encode()),
            ]
    return headers
