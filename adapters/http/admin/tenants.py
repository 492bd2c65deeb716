"""``/admin/tenants``: tenants and their API keys created, changed and revoked at run time
(in the keys file); admin keys only."""

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec
from litestar import Controller, Request, Response, Router, delete, get, post, put
from litestar.di import NamedDependency
from litestar.params import FromPath

from adapters.http.admin.guard import AccessDep, admin_caller
from adapters.http.console.tenants import tenant_json
from adapters.http.errors import (
    OPENAI_ERRORS,
    ErrorRule,
    ErrorTable,
    HTTPError,
    exception_handlers,
)
from adapters.http.openai.params import decode_body
from adapters.http.request_state import constants
from application.access.access import Access
from application.access.tenant_admin import TenantAdmin, TenantNotFoundError, key_id
from domain.errors import InferError
from domain.tenancy import (
    DEFAULT_FACES,
    LIMIT_FIELDS,
    TenantEntry,
    TenantLimits,
    checked_tenant,
)

# --- tenants and their keys -------------------------------------------------------------


class TenantBody(msgspec.Struct, forbid_unknown_fields=True):
    """A tenant's settings, the keys file's fields but its id and keys."""

    faces: list[str] | None = None
    models: list[str] | None = None
    weight: float = 1.0
    requests_per_second: int | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent_streams: int | None = None
    max_output_tokens: int | None = None
    requests_per_day: int | None = None
    tokens_per_day: int | None = None


_tenant_decoder = msgspec.json.Decoder(TenantBody)
T = TypeVar("T")
Admin = NamedDependency[TenantAdmin | None]
NO_KEYS_FILE = (
    "tenants are kept in the keys file: start the server with --api-keys-file FILE "
    "holding an admin tenant (`infer key` prints a key and its line) to manage them here"
)
ADMIN_ERRORS = ErrorTable(
    {
        TenantNotFoundError: ErrorRule(404, "invalid_request_error", code="not_found"),
        **OPENAI_ERRORS.rules,
    }
)


def entry_json(entry: TenantEntry) -> dict[str, Any]:
    """A tenant as the console lists it, with its keys by id (never their digests)."""
    keys = [{"id": key_id(digest)} for digest in entry.keys]
    return {"object": "tenant", **tenant_json(entry.tenant), "keys": keys}


async def _call(method: Callable[..., T], *args: Any) -> T:
    """``method(*args)`` off the event loop; the keys file unreadable or unwritable (a
    read-only folder, a file broken by hand) is a 503 saying so, not a bare 500."""
    try:
        return await asyncio.to_thread(method, *args)
    except InferError:
        raise  # the caller's mistake (400, 404): answered as such
    except (OSError, ValueError) as e:  # ValueError: the store's "file does not parse"
        raise HTTPError(503, f"the keys file cannot be used: {e}", "server_error") from e


def _admin(admin: TenantAdmin | None) -> TenantAdmin:
    if admin is None:
        raise HTTPError(409, NO_KEYS_FILE, "invalid_request_error", code="keys_file_required")
    return admin


class TenantRoutes(Controller):
    path = "/admin/tenants"

    @get("/")
    async def list_tenants(
        self, request: Request[Any, Any, Any], admin: Admin, access: AccessDep
    ) -> dict[str, Any]:
        admin_caller(request, access)
        entries = await _call(_admin(admin).entries)
        return {"object": "list", "data": [entry_json(e) for e in entries]}

    @get("/{tenant_id:str}")
    async def get_tenant(
        self,
        request: Request[Any, Any, Any],
        tenant_id: FromPath[str],
        admin: Admin,
        access: AccessDep,
    ) -> dict[str, Any]:
        admin_caller(request, access)
        return entry_json(await _call(_admin(admin).entry, tenant_id))

    @put("/{tenant_id:str}", status_code=200)
    async def put_tenant(
        self,
        request: Request[Any, Any, Any],
        tenant_id: FromPath[str],
        admin: Admin,
        access: AccessDep,
    ) -> Response[dict[str, Any]]:
        actor = admin_caller(request, access)
        body = decode_body(_tenant_decoder, request, await request.body())
        limits = TenantLimits(**{name: getattr(body, name) for name in LIMIT_FIELDS})
        tenant = checked_tenant(
            tenant_id,
            DEFAULT_FACES if body.faces is None else frozenset(body.faces),
            None if body.models is None else frozenset(body.models),
            body.weight,
            limits,
        )
        entry, created = await _call(_admin(admin).put, tenant, actor)
        return Response(entry_json(entry), status_code=201 if created else 200)

    @delete("/{tenant_id:str}", status_code=200)
    async def delete_tenant(
        self,
        request: Request[Any, Any, Any],
        tenant_id: FromPath[str],
        admin: Admin,
        access: AccessDep,
    ) -> dict[str, Any]:
        actor = admin_caller(request, access)
        await _call(_admin(admin).delete, tenant_id, actor)
        return {"object": "tenant.deleted", "id": tenant_id, "deleted": True}

    @post("/{tenant_id:str}/keys", status_code=201)
    async def create_key(
        self,
        request: Request[Any, Any, Any],
        tenant_id: FromPath[str],
        admin: Admin,
        access: AccessDep,
    ) -> dict[str, Any]:
        actor = admin_caller(request, access)
        made, key = await _call(_admin(admin).add_key, tenant_id, actor)
        return {"object": "api_key", "id": made, "tenant": tenant_id, "key": key}

    @delete("/{tenant_id:str}/keys/{key:str}", status_code=200)
    async def revoke_key(
        self,
        request: Request[Any, Any, Any],
        tenant_id: FromPath[str],
        key: FromPath[str],
        admin: Admin,
        access: AccessDep,
    ) -> dict[str, Any]:
        actor = admin_caller(request, access)
        await _call(_admin(admin).revoke_key, tenant_id, key, actor)
        return {"object": "api_key.deleted", "id": key, "deleted": True}


def tenant_router(admin: TenantAdmin | None, access: Access | None) -> Router:
    """``/admin/tenants``: tenants and their keys (admin keys only; 409 without a keys
    file to keep them in)."""
    return Router(
        path="/",
        route_handlers=[TenantRoutes],
        dependencies=constants({"admin": admin, "access": access}),
        exception_handlers=exception_handlers(ADMIN_ERRORS),
    )
