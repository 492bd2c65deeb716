"""Who may use the admin face: an admin key (the ``admin`` face), or anyone on an open
server; the caller's tenant noted in the request's record."""

from typing import Any

from litestar.connection import ASGIConnection
from litestar.di import NamedDependency

from adapters.http.access import BEARER_HINT
from adapters.http.auth import ApiKeyGuard
from adapters.http.request_state import api_state
from application.access.access import Access
from domain.tenancy import (
    AuthenticationError,
    PermissionDeniedError,
)

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
