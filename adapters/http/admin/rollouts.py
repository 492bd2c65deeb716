"""``/admin/rollouts``: rollouts listed, read, set (created, moved, pinned, rolled back)
and removed; admin keys only; each change an audit line."""

from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import unquote

import msgspec
from litestar import Controller, Request, Router, delete, get, put
from litestar.di import NamedDependency
from litestar.params import FromPath

from adapters.http.admin.guard import AccessDep, admin_caller, stored
from adapters.http.errors import OPENAI_ERRORS, exception_handlers
from adapters.http.openai.params import decode_body
from adapters.http.request_state import constants
from application.access.access import Access
from application.serving.rollouts import RolledBack, RolloutBook
from domain.errors import ModelNotFoundError
from domain.rollout import (
    DEFAULT_MAX_ERROR_RATE,
    DEFAULT_MIN_REQUESTS,
    DEFAULT_WINDOW,
    RollbackPolicy,
    Rollout,
    RolloutTarget,
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
T = TypeVar("T")
ROLLOUTS_PATH = "/admin/rollouts"
Book = NamedDependency[RolloutBook]


def rollout_json(
    rollout: Rollout,
    rollbacks: list[RolledBack] | None = None,
    health: dict[str, tuple[int, int]] | None = None,
) -> dict[str, Any]:
    """``health``: each target's recent (requests, failed) on this server."""
    shares, policy, health = rollout.shares(), rollout.rollback, health or {}
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
                "recent": _recent(health.get(t.model, (0, 0))),
            }
            for t in rollout.targets
        ],
    }


def _name(request: Request[Any, Any, Any]) -> str:
    """The rollout's name as sent (it may hold ``/``, as model names do: ``org/model``)."""
    raw = request.scope.get("raw_path") or request.scope["path"].encode()
    return unquote(raw.decode("latin-1")).removeprefix(ROLLOUTS_PATH + "/")


def _recent(counts: tuple[int, int]) -> dict[str, Any]:
    requests, failed = counts
    rate = round(failed / requests, 4) if requests else None
    return {"requests": requests, "failed": failed, "error_rate": rate}


class RolloutRoutes(Controller):
    path = ROLLOUTS_PATH

    @get("/")
    async def list_rollouts(
        self, request: Request[Any, Any, Any], book: Book, access: AccessDep
    ) -> dict[str, Any]:
        admin_caller(request, access)
        listed = [
            rollout_json(r, book.rollbacks(r.name), book.health(r.name)) for r in book.rollouts()
        ]
        return {"object": "list", "data": listed}

    @get("/{name:path}")
    async def get_rollout(
        self,
        request: Request[Any, Any, Any],
        name: FromPath[Path],
        book: Book,
        access: AccessDep,
    ) -> dict[str, Any]:
        admin_caller(request, access)
        wanted = _name(request)
        for rollout in book.rollouts():
            if rollout.name == wanted:
                return rollout_json(rollout, book.rollbacks(wanted), book.health(wanted))
        raise ModelNotFoundError(f"no rollout named {wanted!r}")

    @put("/{name:path}", status_code=200)
    async def put_rollout(
        self,
        request: Request[Any, Any, Any],
        name: FromPath[Path],
        book: Book,
        access: AccessDep,
    ) -> dict[str, Any]:
        actor = admin_caller(request, access)
        body = decode_body(_rollout_decoder, request, await request.body())
        rollout = Rollout(
            _name(request),
            tuple(RolloutTarget(t.model, t.weight, frozenset(t.tenants)) for t in body.targets),
            _policy(body),
        )
        await stored("the rollouts", book.set, rollout, actor)
        return rollout_json(rollout)

    @delete("/{name:path}", status_code=200)
    async def delete_rollout(
        self,
        request: Request[Any, Any, Any],
        name: FromPath[Path],
        book: Book,
        access: AccessDep,
    ) -> dict[str, Any]:
        actor = admin_caller(request, access)
        wanted = _name(request)
        removed = await stored("the rollouts", book.remove, wanted, actor)
        if removed is None:
            raise ModelNotFoundError(f"no rollout named {wanted!r}")
        return {"object": "rollout.deleted", "name": wanted, "deleted": True}


def rollout_router(book: RolloutBook, access: Access | None) -> Router:
    """``/admin/rollouts``: list, read, set (``PUT``: create, move weights, pin tenants,
    roll back) and remove the rollouts ``book`` serves and stores; admin keys only (open
    without keys), answers and errors in OpenAI's format, each change an audit line."""
    return Router(
        path="/",
        route_handlers=[RolloutRoutes],
        dependencies=constants({"book": book, "access": access}),
        exception_handlers=exception_handlers(OPENAI_ERRORS),
    )
