"""The admin face.

- ``GET /admin/replicas``: a fleet's engine replicas (id, pid, node, state, running,
  waiting, KV usage, prefix hit rate), served when the server runs replicas. Behind the API
  keys when there are any (any key; open without a keys file).
- ``/admin/tenants``: tenants (their faces, models, weight and limits) and their API keys,
  created, changed and revoked at run time in the keys file (admin keys only).
- ``/admin/rollouts``: rollouts (a model name split between served models by weight and
  tenant: canaries, moved and rolled back at run time). Admin keys only (the ``admin``
  face; open without a keys file); every change an audit line (logger ``infer.audit``).
"""

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Any

import msgspec
import structlog
from litestar import Controller, Request, Response, Router, delete, get, post, put
from litestar.connection import ASGIConnection
from litestar.di import NamedDependency
from litestar.params import FromPath

from adapters.http.access import BEARER_HINT, guards
from adapters.http.auth import ApiKeyGuard
from adapters.http.errors import (
    OPENAI_ERRORS,
    ErrorRule,
    ErrorTable,
    HTTPError,
    exception_handlers,
)
from adapters.http.openai.params import decode_body
from adapters.http.request_state import api_state, constants, provide
from application.access import Access
from application.rollouts import RolloutBook
from application.served_models import RolledBack
from application.tenant_admin import TenantAdmin, TenantNotFoundError, key_id
from domain.errors import ModelNotFoundError
from domain.rollout import (
    DEFAULT_MAX_ERROR_RATE,
    DEFAULT_MIN_REQUESTS,
    DEFAULT_WINDOW,
    RollbackPolicy,
    Rollout,
    RolloutTarget,
)
from domain.tenancy import (
    DEFAULT_FACES,
    LIMIT_FIELDS,
    AuthenticationError,
    PermissionDeniedError,
    TenantEntry,
    TenantLimits,
    checked_tenant,
)

ADMIN = "admin"
audit = structlog.get_logger("infer.audit")

Replicas = NamedDependency[Callable[[], Awaitable[list[dict[str, Any]]]]]


class AdminRoutes(Controller):
    @get("/admin/replicas")
    async def replicas(self, replicas: Replicas) -> dict[str, Any]:
        listed = await replicas()
        return {"object": "list", "data": listed}


def admin_router(
    replicas: Callable[[], Awaitable[list[dict[str, Any]]]], access: Access | None
) -> Router:
    return Router(
        path="/",
        route_handlers=[AdminRoutes],
        guards=guards(access),
        dependencies=provide({"replicas": replicas}),
    )


# --- rollouts ---------------------------------------------------------------------------


class TargetBody(msgspec.Struct, forbid_unknown_fields=True):
    model: str
    weight: float = 0.0
    tenants: list[str] = msgspec.field(default_factory=list)


class PolicyBody(msgspec.Struct, forbid_unknown_fields=True):
    max_error_rate: float = DEFAULT_MAX_ERROR_RATE
    min_requests: int = DEFAULT_MIN_REQUESTS
    window: int = DEFAULT_WINDOW


class RolloutBody(msgspec.Struct, forbid_unknown_fields=True):
    targets: list[TargetBody]
    # Absent: the default policy; null: never rolled back by itself.
    rollback: PolicyBody | msgspec.UnsetType | None = msgspec.UNSET


def _policy_body(policy: RollbackPolicy) -> PolicyBody:
    return PolicyBody(policy.max_error_rate, policy.min_requests, policy.window)


def _policy(body: RolloutBody) -> RollbackPolicy | None:
    if body.rollback is msgspec.UNSET:
        return RollbackPolicy()
    if body.rollback is None:
        return None
    assert isinstance(body.rollback, PolicyBody)
    return RollbackPolicy(
        body.rollback.max_error_rate, body.rollback.min_requests, body.rollback.window
    )


_rollout_decoder = msgspec.json.Decoder(RolloutBody)
Book = NamedDependency[RolloutBook]
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


def rollout_json(rollout: Rollout, rollbacks: list[RolledBack] | None = None) -> dict[str, Any]:
    shares, policy = rollout.shares(), rollout.rollback
    return {
        "object": "rollout",
        "name": rollout.name,
        "rollback": None if policy is None else msgspec.structs.asdict(_policy_body(policy)),
        "rolled_back": [
            {
                "target": r.target,
                "error_rate": round(r.error_rate, 4),
                "requests": r.requests,
                "at": int(r.at),
            }
            for r in rollbacks or ()
        ],
        "targets": [
            {
                "model": t.model,
                "weight": t.weight,
                "share": round(shares[t.model], 6),
                "tenants": sorted(t.tenants),
            }
            for t in rollout.targets
        ],
    }


class RolloutRoutes(Controller):
    path = "/admin/rollouts"

    @get("/")
    async def list_rollouts(
        self, request: Request[Any, Any, Any], book: Book, access: AccessDep
    ) -> dict[str, Any]:
        admin_caller(request, access)
        listed = [rollout_json(r, book.rollbacks(r.name)) for r in book.rollouts()]
        return {"object": "list", "data": listed}

    @get("/{name:str}")
    async def get_rollout(
        self,
        request: Request[Any, Any, Any],
        name: FromPath[str],
        book: Book,
        access: AccessDep,
    ) -> dict[str, Any]:
        admin_caller(request, access)
        for rollout in book.rollouts():
            if rollout.name == name:
                return rollout_json(rollout, book.rollbacks(name))
        raise ModelNotFoundError(f"no rollout named {name!r}")

    @put("/{name:str}", status_code=200)
    async def put_rollout(
        self,
        request: Request[Any, Any, Any],
        name: FromPath[str],
        book: Book,
        access: AccessDep,
    ) -> dict[str, Any]:
        actor = admin_caller(request, access)
        body = decode_body(_rollout_decoder, request, await request.body())
        rollout = Rollout(
            name,
            tuple(RolloutTarget(t.model, t.weight, frozenset(t.tenants)) for t in body.targets),
            _policy(body),
        )
        before = await asyncio.to_thread(book.set, rollout)
        audit.info(
            "rollout set",
            rollout=name,
            targets={t.model: t.weight for t in rollout.targets},
            pinned={t.model: sorted(t.tenants) for t in rollout.targets if t.tenants},
            before=None if before is None else {t.model: t.weight for t in before.targets},
            actor=actor,
        )
        return rollout_json(rollout)

    @delete("/{name:str}", status_code=200)
    async def delete_rollout(
        self,
        request: Request[Any, Any, Any],
        name: FromPath[str],
        book: Book,
        access: AccessDep,
    ) -> dict[str, Any]:
        actor = admin_caller(request, access)
        removed = await asyncio.to_thread(book.remove, name)
        if removed is None:
            raise ModelNotFoundError(f"no rollout named {name!r}")
        audit.info("rollout removed", rollout=name, actor=actor)
        return {"object": "rollout.deleted", "name": name, "deleted": True}


def rollout_router(book: RolloutBook, access: Access | None) -> Router:
    """``/admin/rollouts``: list, read, set (``PUT``: create, move weights, pin tenants,
    roll back) and remove the rollouts ``book`` serves and stores; admin keys only (open without
    keys), answers and errors in OpenAI's format, each change an audit line."""
    return Router(
        path="/",
        route_handlers=[RolloutRoutes],
        dependencies=constants({"book": book, "access": access}),
        exception_handlers=exception_handlers(OPENAI_ERRORS),
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
    requests_per_day: int | None = None
    tokens_per_day: int | None = None


_tenant_decoder = msgspec.json.Decoder(TenantBody)
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


def tenant_json(entry: TenantEntry) -> dict[str, Any]:
    tenant = entry.tenant
    return {
        "object": "tenant",
        "id": tenant.id,
        "faces": sorted(tenant.faces),
        "admin": tenant.allows_face(ADMIN),
        "models": None if tenant.models is None else sorted(tenant.models),
        "weight": tenant.weight,
        "limits": asdict(tenant.limits),
        "keys": [{"id": key_id(digest)} for digest in entry.keys],
    }


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
        entries = await asyncio.to_thread(_admin(admin).entries)
        return {"object": "list", "data": [tenant_json(e) for e in entries]}

    @get("/{tenant_id:str}")
    async def get_tenant(
        self,
        request: Request[Any, Any, Any],
        tenant_id: FromPath[str],
        admin: Admin,
        access: AccessDep,
    ) -> dict[str, Any]:
        admin_caller(request, access)
        return tenant_json(await asyncio.to_thread(_admin(admin).entry, tenant_id))

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
        entry, created = await asyncio.to_thread(_admin(admin).put, tenant, actor)
        return Response(tenant_json(entry), status_code=201 if created else 200)

    @delete("/{tenant_id:str}", status_code=200)
    async def delete_tenant(
        self,
        request: Request[Any, Any, Any],
        tenant_id: FromPath[str],
        admin: Admin,
        access: AccessDep,
    ) -> dict[str, Any]:
        actor = admin_caller(request, access)
        await asyncio.to_thread(_admin(admin).delete, tenant_id, actor)
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
        made, key = await asyncio.to_thread(_admin(admin).add_key, tenant_id, actor)
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
        await asyncio.to_thread(_admin(admin).revoke_key, tenant_id, key, actor)
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
