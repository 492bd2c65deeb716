"""Engine work is owned by the HTTP request that queued it.

An ASGI middleware gives every HTTP request its :class:`OwnedRequests` group and closes it when the
request ends, however it ends: the reply sent, an error after part of the work was queued,
a client gone before its stream was ever read, a cancellation. Closing aborts every engine
request of the group still queued or running, at once. (A stream's own cleanup cannot do
this alone: a generator that never started has no ``finally`` to run.)

The group also fills in the request's :class:`RequestRecord` (tokens in and out, finish
reasons, first-token time) from the engine outputs it passes on, for the logs, metrics and
traces, and queues its requests with the record's tenant and trace context. The
middleware sets up the request's state (:class:`~adapters.http.request_state.ApiState`)
with both, and at the end settles what the request reserved under its limits and unpins
its model (after its engine work was aborted or finished); the response gets the limits'
``x-ratelimit-*`` headers and the model name's deprecation headers.

The middleware also ends API requests early (every path but the probes ``/health``,
``/ready``, ``/metrics``): at ``request_timeout_s`` (the OpenAI endpoints and
``/v1/generate``), and when the server's drain runs out of time (:class:`Draining`). A
request with no response yet is cancelled and answered in its face's error format (504
``timeout``, 503); a stream gets an error event and its engine requests are aborted. While
draining, new API requests get 503 with ``Retry-After``.
"""

import asyncio
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from litestar.middleware import DefineMiddleware
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from adapters.http.errors import HTTPError
from adapters.http.request_state import ApiState
from application.engine.engine_client import EngineClient, OwnedRequests
from application.serving.generation import OUTPUT_CAP_HEADER
from application.serving.request_record import RECORD_KEY, RequestRecord
from domain.request import AdmitCall, RequestContext, StepOutput

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
        # A state of its own (the server's may be shared between requests).
        scope["state"] = own = {**scope.get("state", {})}
        record = own.get(RECORD_KEY)  # ObservedApp's
        if not isinstance(record, RequestRecord):
            record = RequestRecord()
        context = RequestContext(tenant_id=record.tenant_id, trace=record.trace)
        group = RecordingGroup(self.engine.group(context), record)
        state = ApiState.open(own, group, record)

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                limits = state.limits.headers() if state.limits is not None else []
                if record.output_cap is not None:  # the cap that cut what was asked
                    limits.append((OUTPUT_CAP_HEADER.encode(), str(record.output_cap).encode()))
                if added := [*limits, *state.hold.headers]:
                    message = {**message, "headers": [*message.get("headers", ()), *added]}
            await send(message)

        try:
            if scope["path"] in PROBES:
                await self.app(scope, receive, send)
            else:
                await self._serve_api(scope, receive, send_with_headers, group)
        finally:  # synchronous: it runs even when the request's task is cancelled
            group.close()
            if state.limits is not None:
                await state.limits.settle(record.prompt_tokens + record.completion_tokens)
            state.hold.pins.close()

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

    def admit(self, call: AdmitCall) -> list[AsyncIterator[StepOutput]]:
        streams = self._group.admit(call)
        self._record.prompt_tokens += sum(map(len, call.prompts))  # once per prompt, whatever n
        # A prompt's cached tokens once, from its first choice's stream.
        return [self._recorded(stream, i % call.n == 0) for i, stream in enumerate(streams)]

    def close(self) -> None:
        self._group.close()

    def fail(self, error: str) -> None:
        self._group.fail(error)

    async def _recorded(
        self, stream: AsyncIterator[StepOutput], counts_prompt: bool
    ) -> AsyncIterator[StepOutput]:
        record = self._record
        try:
            async for output in stream:
                if output.token_id is not None and record.first_token_s is None:
                    record.first_token_s = time.monotonic()
                if output.finished:
                    record.completion_tokens += output.completion_tokens
                    if counts_prompt:
                        record.cached_tokens += output.cached_tokens
                    record.finish_reasons.append(output.finish_reason or "error")
                yield output
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
