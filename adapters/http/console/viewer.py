"""Who is looking at the console's data pages (tenants, training), from the request's key.

- With a keys file, a key is required (401) and its tenant is the viewer: one allowed the
  ``admin`` face sees every tenant and every training run; another sees its own training
  runs (with the ``tinker`` face) and gets a 403 for the tenants page.
- Without a keys file (an open server) no key is needed and everyone is an admin, as on
  every other endpoint; the Tinker runs are all listed unless the Tinker API has keys of
  its own (``--tinker-api-key``): then only the runs of the key sent (401 without one).

Errors are the OpenAI face's (``AuthenticationError`` 401 ``invalid_api_key``,
``PermissionDeniedError`` 403 ``permission_error``).
"""

from dataclasses import dataclass
from typing import Any

from litestar.connection import ASGIConnection

from adapters.http.auth import ApiKeyGuard
from application.access.access import Access
from domain.tenancy import AuthenticationError, PermissionDeniedError

ADMIN = "admin"
TINKER_KEY_PREFIX = "tml-"


@dataclass(frozen=True, slots=True)
class Viewer:
    """``admin``: may see every tenant and run; ``tenant``: the keys file's tenant (None on
    an open server); ``owner``: the Tinker tenant the key stands for (its runs and
    checkpoints; None: no Tinker key); ``chats``: may use the OpenAI endpoints."""

    admin: bool
    tenant: str | None = None
    owner: str | None = None
    chats: bool = True


class ConsoleViewers:
    def __init__(self, access: Access | None, tinker_keys: frozenset[str] | None) -> None:
        self.access, self.tinker_keys = access, tinker_keys
        # The Tinker face's own guard: the owner a key stands for there.
        self._tinker = ApiKeyGuard(
            AuthenticationError,
            keys=tinker_keys,
            prefix=TINKER_KEY_PREFIX,
            access=access,
            face="tinker",
            forbid=PermissionDeniedError,
            missing_message="missing API key: send it as Authorization: Bearer <key>",
        )
        self._keys = ApiKeyGuard(
            AuthenticationError,
            access=access,
            face=ADMIN,
            forbid=PermissionDeniedError,
            missing_message="missing API key: send it as Authorization: Bearer <key>",
        )

    @property
    def keyed(self) -> bool:
        return self.access is not None and not self.access.open

    def viewer(self, connection: ASGIConnection[Any, Any, Any, Any]) -> Viewer:
        """The caller (raises ``AuthenticationError`` for a missing or unknown key on a
        server with a keys file)."""
        if self.keyed:
            assert self.access is not None
            key = self._keys.key(connection)
            if not key:
                raise AuthenticationError(self._keys.missing_message)
            tenant = self.access.tenant(key)
            if tenant is None:
                raise AuthenticationError("invalid API key")
            owner = tenant.id if tenant.allows_face("tinker") else None
            return Viewer(tenant.allows_face(ADMIN), tenant.id, owner, tenant.allows_face("openai"))
        return Viewer(True, None, self._tinker_owner(connection))

    def _tinker_owner(self, connection: ASGIConnection[Any, Any, Any, Any]) -> str | None:
        if not self._tinker.key(connection):
            return None
        try:
            return self._tinker.tenant(connection)
        except (AuthenticationError, PermissionDeniedError):
            return None

    def admin(self, connection: ASGIConnection[Any, Any, Any, Any]) -> Viewer:
        """The caller, who must be an admin (``PermissionDeniedError`` otherwise)."""
        viewer = self.viewer(connection)
        if not viewer.admin:
            raise PermissionDeniedError(
                "this API key may not see the tenants: it needs the admin face "
                '(faces = [..., "admin"] in the keys file)'
            )
        return viewer

    def training(self, connection: ASGIConnection[Any, Any, Any, Any]) -> tuple[Viewer, bool]:
        """The caller and whether every run is listed to it (else only its own: a
        ``PermissionDeniedError`` when it has no Tinker identity at all)."""
        viewer = self.viewer(connection)
        if self.keyed:
            if viewer.admin:
                return viewer, True
            if viewer.owner is None:
                raise PermissionDeniedError("this API key may not use the tinker API")
            return viewer, False
        if self.tinker_keys is None:  # an open server, the Tinker API open too
            return viewer, True
        if viewer.owner is None:
            self._tinker.tenant(connection)  # the 401 for a missing or refused key
        return viewer, False
