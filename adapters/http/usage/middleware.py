"""Every API request under ``/v1/`` recorded in the usage ledger when it ends: one
:class:`~domain.usage.UsageRecord` per request (its tenant, model, route, status, tokens and
latency; never its text), and per Tinker API call refused or failed (``/api/v1/``, 4xx /
5xx: the 429s the console counts), through the
:class:`~application.access.usage_ledger.UsageRecorder`, which stores them in the
background. The usage API over the ledger is :mod:`adapters.http.usage.routes`."""

import asyncio
import time

from litestar.middleware import DefineMiddleware
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from application.access.usage_ledger import UsageRecorder
from application.serving.request_record import RECORD_KEY, RequestRecord
from domain.usage import COMPLETIONS, EMBEDDINGS, UsageRecord

RECORDED_PREFIX = "/v1/"
# The Tinker API: its refusals and failures only (its SDK polls futures all the time; its
# work is metered by the Tinker usage meter).
TINKER_PREFIX, TINKER = "/api/v1/", "tinker"
OTHER = "other"  # what a request that used no model's tokens is recorded as (a model list)
# The routes whose tokens are a completion's (OpenAI's "completions" usage) or an embedding's.
_KIND_OF_ROUTE = {
    "/v1/chat/completions": COMPLETIONS,
    "/v1/completions": COMPLETIONS,
    "/v1/responses": COMPLETIONS,
    "/v1/messages": COMPLETIONS,
    "/v1/generate": COMPLETIONS,
    "/v1/embeddings": EMBEDDINGS,
}


def kind_of(method: str, path: str) -> str:
    kind = _KIND_OF_ROUTE.get(path)
    return kind if kind is not None and method == "POST" else OTHER


class UsageMiddleware:
    """Records every request under ``/v1/`` when it ends, with its status and the tenant,
    model and tokens its record holds (the faces fill the record in)."""

    def __init__(self, app: ASGIApp, recorder: UsageRecorder) -> None:
        self.app, self.recorder = app, recorder

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"] if scope["type"] == "http" else ""
        tinker = path.startswith(TINKER_PREFIX)
        if not (path.startswith(RECORDED_PREFIX) or tinker):
            await self.app(scope, receive, send)
            return
        status: int | None = None
        started = time.monotonic()

        async def send_counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        except asyncio.CancelledError:  # the client went away first
            if status is None:
                status = 499
            raise
        except BaseException:
            if status is None:
                status = 500
            raise
        finally:
            if not (tinker and status is not None and status < 400):
                self._record(scope, path, tinker, status, started)

    def _record(
        self, scope: Scope, path: str, tinker: bool, status: int | None, started: float
    ) -> None:
        record = scope.get("state", {}).get(RECORD_KEY)
        if not isinstance(record, RequestRecord):
            record = RequestRecord(started_s=started)
        self.recorder.record(
            UsageRecord(
                ended_s=time.time(),
                request_id=record.request_id,
                tenant_id=record.tenant_id,
                model=record.model,
                route=path[:200],
                kind=TINKER if tinker else kind_of(str(scope.get("method", "")), path),
                status=499 if status is None else status,
                prompt_tokens=record.prompt_tokens,
                cached_tokens=record.cached_tokens,
                completion_tokens=record.completion_tokens,
                latency_ms=round((time.monotonic() - record.started_s) * 1000, 3),
                key_id=record.key_id,
            )
        )


def usage_middleware(recorder: UsageRecorder) -> DefineMiddleware:
    return DefineMiddleware(UsageMiddleware, recorder=recorder)
