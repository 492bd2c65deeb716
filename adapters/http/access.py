"""Keys and limits on the inference faces (OpenAI endpoints, ``/v1/generate``).

A Litestar guard resolves the caller's tenant (``AuthenticationError`` /
``PermissionDeniedError``: 401 / 403 through the face's error table), notes it in the
request's state, record and group (the engine queues its requests as the tenant's), and
counts the request against the tenant's request limits (``RateLimitedError``: 429). The
completion service reserves tokens once the prompt is tokenized (``Caller.reserve``:
prompt + ``max_tokens`` per choice, and a stream slot). The owning middleware settles what
was reserved when the HTTP request ends, and adds the ``x-ratelimit-*`` headers to the
response. An open server (no keys) skips all of it.
"""

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler

from adapters.http.auth import ApiKeyGuard
from adapters.http.request_state import HeldLimits, api_state
from application.access.access import Access
from application.access.keys import hash_key, key_id
from domain.tenancy import AuthenticationError, PermissionDeniedError

Guard = Callable[[ASGIConnection[Any, Any, Any, Any], BaseRouteHandler], Awaitable[None]]


BEARER_HINT = "missing API key: send it as Authorization: Bearer <key>"


def inference_guard(access: Access, missing_message: str = BEARER_HINT) -> Guard:
    """The guard of the inference faces: ``Authorization: Bearer`` (or ``X-API-Key``);
    ``missing_message``: the 401's words when no key came."""
    keys = ApiKeyGuard(
        AuthenticationError,
        access=access,
        face="openai",
        forbid=PermissionDeniedError,
        missing_message=missing_message,
    )

    async def guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
        if access.open:
            return
        tenant = keys.resolve(connection)
        state = api_state(connection)
        state.tenant = tenant
        state.record.tenant_id = tenant.id
        state.record.key_id = key_id(hash_key(keys.key(connection)))
        state.group.context = dataclasses.replace(state.group.context, tenant_id=tenant.id)
        if access.quotas is not None:
            state.limits = HeldLimits(access.quotas, await access.quotas.admit(tenant))

    return guard


def guards(access: Access | None, missing_message: str = BEARER_HINT) -> list[Guard]:
    """An inference face's guards (none without ``access``)."""
    return [] if access is None else [inference_guard(access, missing_message)]


def check_model(connection: ASGIConnection[Any, Any, Any, Any], model: str) -> None:
    """``PermissionDeniedError`` when the caller's tenant may not use ``model``."""
    tenant = api_state(connection).tenant
    if tenant is not None and not tenant.allows_model(model):
        raise PermissionDeniedError(f"this API key may not use the model {model!r}")


__all__ = ["check_model", "guards", "inference_guard"]
