"""The keys file's per-tenant limits on the Tinker API.

Every call that submits work (``POST``: sessions, runs, forward/backward, optimizer steps,
saves, samples, ...) counts against the caller's ``requests_per_second`` /
``requests_per_minute``, as OpenAI requests do; polls and keep-alives do not (the SDK
polls each future and heartbeats each session, which a limit meant for work must not
starve), nor do reads sent as POST (``sessions/search``, ``join_sampling_session``). A
refused call is HTTP 429 with the ``x-ratelimit-*`` headers, which the SDK
retries with backoff. An open server (no keys file) counts nothing.

Tokens count against ``tokens_per_minute`` as on the OpenAI face: a sample reserves its
prompt + ``max_tokens`` for every sequence when it is submitted and settles when its
future finishes (what it did not use is given back); a forward/backward (or forward) is
charged its data's tokens when it is submitted. An unfinished sample holds one of the
key's ``max_concurrent_streams``. Work larger than the key's whole minute (or day) of
tokens is a 400 (retrying could never help), not a 429.
"""

import asyncio
from dataclasses import dataclass
from typing import Any

from litestar import Request
from litestar.connection import ASGIConnection
from litestar.di import NamedDependency, Provide
from litestar.handlers import BaseRouteHandler

from adapters.http.access import Guard
from adapters.http.auth import ApiKeyGuard
from adapters.http.request_state import HeldLimits
from application.access.access import Access
from application.access.keys import hash_key, key_id
from application.serving.request_record import RECORD_KEY, RequestRecord
from application.tinker.futures import Future
from domain.tinker.errors import InvalidTrainingRequest

# Calls that poll, keep a session alive, read or describe: not counted.
UNCOUNTED = frozenset(
    {
        "retrieve_future",
        "retrieve_futures",
        "session_heartbeat",
        "client/config",
        "client/dynamic_config",
        "get_server_capabilities",
        "telemetry",
        "cancel_future",
        "join_sampling_session",
        "sessions/search",
    }
)
LIMITS_KEY = "tinker_limits"  # where the guard leaves what it admitted, in the ASGI state
LIMITS = "limits"  # the name handlers declare to receive their WorkLimits


@dataclass(frozen=True, slots=True)
class WorkLimits:
    """What one work-submitting call was admitted with (``held`` None: no limits)."""

    held: HeldLimits | None = None

    async def reserve(self, what: str, tokens: int, *, stream: bool) -> None:
        """Count ``tokens`` for ``what`` (and a stream slot when ``stream``): a 400 when
        more than the key's whole minute, a 429 when the window (or the streams) is full."""
        if self.held is None:
            return
        limits = self.held.admission.tenant.limits
        for limit, unit in ((limits.tokens_per_minute, "minute"), (limits.tokens_per_day, "day")):
            if limit is not None and tokens > limit:
                raise InvalidTrainingRequest(
                    f"{what} needs {tokens} tokens, more than the {limit} tokens per {unit} "
                    "this API key may use: send less at once"
                )
        await self.held.quotas.reserve(self.held.admission, tokens, stream=stream)

    async def give_back(self) -> None:
        """The work was refused after its reservation: nothing of it is counted."""
        if self.held is not None:
            await self.held.settle(0)

    def settle_when_done(self, future: Future) -> None:
        """Settle the reservation with the tokens ``future`` used once it finishes
        (resolved, failed or cancelled)."""
        held = self.held
        if held is None:
            return

        async def settle() -> None:  # after every other hook: the tokens are counted then
            await held.settle(future.tokens)

        def done(_: Future) -> None:
            task = asyncio.get_running_loop().create_task(settle())
            _SETTLING.add(task)
            task.add_done_callback(_SETTLING.discard)

        if future.finished:
            done(future)
        else:
            future.on_done.append(done)


_SETTLING: set["asyncio.Task[None]"] = set()  # kept alive until they end
_OPEN = WorkLimits()


def request_limits(keys: ApiKeyGuard, access: Access | None) -> list[Guard]:
    """The guard counting the caller's work-submitting calls (none without quotas)."""
    quotas = access.quotas if access is not None else None
    if quotas is None:
        return []

    async def guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
        if connection.scope.get("method") != "POST":
            return
        name = connection.url.path.partition("/api/v1/")[2].strip("/")
        if name in UNCOUNTED:
            return
        tenant = keys.resolve(connection)
        state = connection.scope.setdefault("state", {})
        record = state.get(RECORD_KEY)
        if isinstance(record, RequestRecord):  # a refusal is the tenant's (the usage ledger)
            record.tenant_id = tenant.id
            record.key_id = key_id(hash_key(keys.key(connection)))
        admission = await quotas.admit(tenant)
        state[LIMITS_KEY] = WorkLimits(HeldLimits(quotas, admission))

    return [guard]


def work_limits(request: Request[Any, Any, Any]) -> WorkLimits:
    """A handler's ``limits``: what its call was admitted with."""
    limits = request.scope.get("state", {}).get(LIMITS_KEY)
    return limits if isinstance(limits, WorkLimits) else _OPEN


# A handler's ``limits: Limits``.
Limits = NamedDependency[WorkLimits]
LIMITS_DEPENDENCY = Provide(work_limits, sync_to_thread=False)
