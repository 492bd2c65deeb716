"""Who may use the admin face: an admin key (the ``admin`` face), or anyone on an open
server; the caller's tenant noted in the request's record."""

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from litestar.connection import ASGIConnection
from litestar.di import NamedDependency

from adapters.http.access import BEARER_HINT
from adapters.http.auth import ApiKeyGuard
from adapters.http.errors import HTTPError
from adapters.http.request_state import api_state
from application.access.access import Access
from domain.errors import InferError
from domain.tenancy import (
    AuthenticationError,
    PermissionDeniedError,
)

T = TypeVar("T")
ADMIN = "admin"
AccessDep = NamedDependency[Access | None]


def admin_caller(
    connection: ASGIConnection[Any, Any, Any, Any], access: Access | None
) -> str | None:
    """The admin tenant calling (None: an open server, where anyone is an admin); 401 for
    a missing or unknown key, 403 for a key without the ``admin`` face."""
    if access is None or access.open:
        return None
    guard = ApiKeyGuard(
        AuthenticationError,
        access=access,
        face=ADMIN,
        forbid=PermissionDeniedError,
        missing_message=BEARER_HINT,
    )
    tenant = guard.resolve(connection)
    state = api_state(connection)
    if getattr(state, "record", None) is not None:
        state.record.tenant_id = tenant.id
    return tenant.id


async def stored(what: str, method: Callable[..., T], *args: Any) -> T:
    """An admin change made off the event loop; its store down is a 503 saying so (what is
    in memory keeps serving), the caller's mistakes stay 4xx."""
    try:
        return await asyncio.to_thread(method, *args)
    except InferError:
        raise
    except Exception as e:
        raise HTTPError(503, f"{what} cannot be stored now: {e}", "server_error") from e
