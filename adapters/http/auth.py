"""API keys: who is calling, as one Litestar dependency per face.

An :class:`ApiKeyGuard` is configured per face: the headers a key may come in, and either
an :class:`~application.access.access.Access` whose keyring maps keys to tenants (with the faces
each may use: another face is a 403), or the prefix keys must have and the keys accepted
(None: any key with the prefix, each its own tenant, whose id is a hash of the key). How
the face answers a refused key (401) or a forbidden face (403) is its own error format.
Handlers that declare a ``tenant`` parameter get the caller's tenant id: the raw key goes
no further than this module. Resources belong to the tenant that made them; the services
check that, answering another tenant as if the resource did not exist.
"""

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from litestar import Request
from litestar.connection import ASGIConnection
from litestar.di import NamedDependency, Provide

from adapters.http.request_state import api_state
from application.access.access import Access
from domain.tenancy import Tenant as TenantRecord

BEARER = "Bearer "
TENANT = "tenant"  # the name handlers declare to receive the tenant id
Tenant = NamedDependency[str]  # a handler's ``tenant: Tenant``


def tenant_id(key: str) -> str:
    """The tenant an API key stands for (a hash: ids are logged and stored, keys never)."""
    return hashlib.sha256(key.encode()).hexdigest()[:24]


@dataclass(frozen=True, slots=True)
class ApiKeyGuard:
    """``refuse(message)``: the exception a refused request raises (401 in the face's
    error format). ``headers``: where a key is looked for, in order (lower case);
    ``bearer``: then ``Authorization: Bearer <key>``."""

    refuse: Callable[[str], Exception]
    keys: frozenset[str] | None = None
    prefix: str = ""
    headers: tuple[str, ...] = ("x-api-key",)
    bearer: bool = True
    missing_message: str = "missing API key: send it in the X-API-Key header"
    # With a keyring (``access`` not open), keys are its tenants' and ``keys`` / ``prefix``
    # are not used; ``face``: what tenants must be allowed; ``forbid``: the 403.
    access: Access | None = None
    face: str = ""
    forbid: Callable[[str], Exception] | None = None

    def key(self, connection: ASGIConnection[Any, Any, Any, Any]) -> str:
        """The key the request carries ("" when none)."""
        for name in self.headers:
            if key := connection.headers.get(name, ""):
                return key
        auth = connection.headers.get("authorization", "")
        if self.bearer and auth.startswith(BEARER):
            return auth[len(BEARER) :]
        return ""

    def tenant(self, connection: ASGIConnection[Any, Any, Any, Any]) -> str:
        """The caller's tenant id; raises ``refuse(...)`` for a missing or refused key."""
        return self.resolve(connection).id

    def resolve(self, connection: ASGIConnection[Any, Any, Any, Any]) -> TenantRecord:
        """The caller's tenant; raises ``refuse(...)`` for a missing or refused key and
        ``forbid(...)`` for a tenant not allowed on this face."""
        key = self.key(connection)
        if not key:
            raise self.refuse(self.missing_message)
        if self.access is not None and not self.access.open:
            tenant = self.access.tenant(key)
            if tenant is None:
                raise self.refuse("invalid API key")
            if not tenant.allows_face(self.face):
                forbid = self.forbid or self.refuse
                raise forbid(f"this API key may not use the {self.face} API")
            return tenant
        if self.keys is not None:
            if key not in self.keys:
                raise self.refuse("invalid API key")
        elif not key.startswith(self.prefix):
            raise self.refuse(f"API keys start with {self.prefix!r}")
        return TenantRecord(tenant_id(key))

    def dependency(self) -> Provide:
        """The Litestar dependency giving handlers their ``tenant`` (register it as
        ``dependencies={TENANT: guard.dependency()}`` on a router or controller)."""

        def tenant(request: Request[Any, Any, Any]) -> str:
            tenant_id = self.tenant(request)
            # None where the face is served without the owning middleware (tests).
            record = getattr(api_state(request), "record", None)
            if record is not None:
                record.tenant_id = tenant_id
            return tenant_id

        return Provide(tenant, sync_to_thread=False)
