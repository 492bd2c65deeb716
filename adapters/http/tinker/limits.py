"""The keys file's per-tenant request limits on the Tinker API.

Every call that submits work (``POST``: sessions, runs, forward/backward, optimizer steps,
saves, samples, ...) counts against the caller's ``requests_per_second`` /
``requests_per_minute``, as OpenAI requests do; polls and keep-alives do not (the SDK
polls each future and heartbeats each session, which a limit meant for work must not
starve), nor do reads sent as POST (``sessions/search``, ``join_sampling_session``). A
refused call is HTTP 429 with the ``x-ratelimit-*`` headers, which the SDK
retries with backoff. An open server (no keys file) counts nothing.
"""

from typing import Any

from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler

from adapters.http.access import Guard
from adapters.http.auth import ApiKeyGuard
from application.access import Access

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
        await quotas.admit(keys.resolve(connection))

    return [guard]
