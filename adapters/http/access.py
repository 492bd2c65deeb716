"""Keys and limits on the inference faces (OpenAI endpoints, ``/v1/generate``).

A Litestar guard resolves the caller's tenant (401 / 403 in the face's format), notes it in
the request's record and group (the engine queues its requests as the tenant's), and counts
the request against the tenant's request limits (429). Handlers call :func:`reserve` once
the prompt is tokenized: tokens (prompt + ``max_tokens`` per choice) and a stream slot.
The owning middleware settles what was reserved when the HTTP request ends, and adds the
``x-ratelimit-*`` headers to the response. An open server (no keys) skips all of it.
"""

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

from litestar import Request
from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler

from adapters.http.auth import ApiKeyGuard
from adapters.http.errors import ErrorTable
from adapters.http.ownership import ADMISSION, request_group, request_record
from application.access import Access
from application.quotas import Admission, Quotas
from domain.tenancy import AuthenticationError, PermissionDeniedError, Tenant

TENANT_STATE = "infer.tenant"
Guard = Callable[[ASGIConnection[Any, Any, Any, Any], BaseRouteHandler], Awaitable[None]]


def inference_guard(access: Access, errors: ErrorTable) -> Guard:
    """The guard of the inference faces: ``Authorization: Bearer`` (or ``X-API-Key``)."""

    def refuse(message: str) -> Exception:
        return errors.error(AuthenticationError(message))

    def forbid(message: str) -> Exception:
        return errors.error(PermissionDeniedError(message))

    keys = ApiKeyGuard(
        refuse,
        access=access,
        face="openai",
        forbid=forbid,
        missing_message="missing API key: send it as Authorization: Bearer <key>",
    )

    async def guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
        if access.open:
            return
        tenant = keys.resolve(connection)
        state = connection.scope["state"]
        state[TENANT_STATE] = tenant
        request_record(connection).tenant_id = tenant.id  # type: ignore[arg-type]
        group = request_group(connection)  # type: ignore[arg-type]
        group.context = dataclasses.replace(group.context, tenant_id=tenant.id)
        if access.quotas is not None:
            try:
                admission = await access.quotas.admit(tenant)
            except Exception as e:
                raise errors.error(e) from e
            state[ADMISSION] = (access.quotas, admission)

    return guard


def request_tenant(request: Request[Any, Any, Any]) -> Tenant | None:
    """The caller's tenant (None on an open server)."""
    tenant: Tenant | None = request.scope["state"].get(TENANT_STATE)
    return tenant


def check_model(request: Request[Any, Any, Any], model: str, errors: ErrorTable) -> None:
    """403 when the caller's tenant may not use ``model``."""
    tenant = request_tenant(request)
    if tenant is not None and not tenant.allows_model(model):
        raise errors.error(PermissionDeniedError(f"this API key may not use the model {model!r}"))


async def reserve(request: Request[Any, Any, Any], tokens: int, errors: ErrorTable) -> None:
    """Reserve ``tokens`` and a stream slot for the request (429 when over a limit)."""
    held: tuple[Quotas, Admission] | None = request.scope["state"].get(ADMISSION)
    if held is None:
        return
    quotas, admission = held
    try:
        await quotas.reserve(admission, tokens)
    except Exception as e:
        raise errors.error(e) from e


__all__ = ["check_model", "inference_guard", "request_tenant", "reserve"]
