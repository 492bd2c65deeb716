"""API keys: who is calling, as one Litestar dependency per face.

An :class:`ApiKeyGuard` is configured per face: the headers a key may come in, the prefix
keys must have, the keys accepted (None: any key with the prefix, each its own tenant),
and how the face answers a refused key (its error format). Handlers that declare a
``tenant`` parameter get the caller's tenant id, a hash of the key: the raw key goes no
further than this module. Resources belong to the tenant that made them; the services
check that, answering another tenant as if the resource did not exist.
"""

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from litestar import Request
from litestar.connection import ASGIConnection
from litestar.di import NamedDependency, Provide

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
        key = self.key(connection)
        if not key:
            raise self.refuse(self.missing_message)
        if self.keys is not None:
            if key not in self.keys:
                raise self.refuse("invalid API key")
        elif not key.startswith(self.prefix):
            raise self.refuse(f"API keys start with {self.prefix!r}")
        return tenant_id(key)

    def dependency(self) -> Provide:
        """The Litestar dependency giving handlers their ``tenant`` (register it as
        ``dependencies={TENANT: guard.dependency()}`` on a router or controller)."""

        def tenant(request: Request[Any, Any, Any]) -> str:
            return self.tenant(request)

        return Provide(tenant, sync_to_thread=False)
