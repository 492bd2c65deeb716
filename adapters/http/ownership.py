"""Engine work is owned by the HTTP request that queued it.

An ASGI middleware gives every HTTP request its :class:`OwnedRequests` group and closes it when the
request ends, however it ends: the reply sent, an error after part of the work was queued,
a client gone before its stream was ever read, a cancellation. Closing aborts every engine
request of the group still queued or running, at once. (A stream's own cleanup cannot do
this alone: a generator that never started has no ``finally`` to run.)

The group also fills in the request's :class:`RequestRecord` (tokens in and out, finish
reasons, first-token time) from the engine outputs it passes on, for the logs, metrics and
traces, and queues its requests with the record's tenant and trace context.
"""

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import structlog
from litestar import Request
from litestar.middleware import DefineMiddleware
from litestar.types import ASGIApp, Receive, Scope, Send

from application.engine_client import EngineClient, OwnedRequests
from application.quotas import Admission, Quotas
from application.request_record import RECORD_KEY, RequestRecord
from domain.request import RequestContext, StepOutput
from domain.sampling import SamplingParams

log = structlog.get_logger(__name__)
_KEY = "infer.request_group"
# Set by the access guard: the (Quotas, Admission) the request holds, settled at its end.
ADMISSION = "infer.admission"


def owning_middleware(engine: EngineClient) -> DefineMiddleware:
    """The Litestar middleware giving each HTTP request its group."""
    return DefineMiddleware(OwningMiddleware, engine=engine)


class OwningMiddleware:
    def __init__(self, app: ASGIApp, engine: EngineClient) -> None:
        self.app, self.engine = app, engine

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
            await self.app(scope, receive, send_with_limits)
        finally:  # synchronous: it runs even when the request's task is cancelled
            group.close()
            held = state.get(ADMISSION)
            if held is not None:
                await _settle(held, record.prompt_tokens + record.completion_tokens)


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
        self, request_ids: Sequence[str], prompts: Sequence[list[int]], params: SamplingParams
    ) -> list[AsyncIterator[StepOutput]]:
        streams = self._group.admit(request_ids, prompts, params)
        self._record.prompt_tokens += sum(map(len, prompts))
        return [self._recorded(stream) for stream in streams]

    def close(self) -> None:
        self._group.close()

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
