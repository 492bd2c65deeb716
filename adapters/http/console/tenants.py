"""The console's tenants page data: ``GET /ui/api/tenants`` (admin), and the middleware that
counts each tenant's use of the inference faces today (:class:`~application.tenant_usage.
TenantUsage`).

Each tenant of the keys file with its faces, models, weight and limits, and its usage today
(UTC): API requests under ``/v1/`` (OpenAI, Anthropic, Responses, ``/v1/generate``), their
prompt and completion tokens, the 429s it was answered and other errors; with the Tinker
API, the tokens it trained, prefilled and sampled and the checkpoints it saved today (the
Tinker usage meter's hours since midnight). Usage of tenants no longer in the keys file, and
of requests without a key (an open server), is listed apart.
"""

import time
from dataclasses import asdict
from typing import Any

from litestar import Controller, Request, get
from litestar.di import NamedDependency
from litestar.middleware import DefineMiddleware
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from adapters.http.console.viewer import ADMIN, ConsoleViewers
from application.access import Access
from application.request_record import RECORD_KEY, RequestRecord
from application.tenant_usage import NO_TENANT, TenantUsage, UsageToday
from application.tinker.service import TinkerService
from application.tinker.usage import HOUR_S, UsageMeter
from domain.tenancy import Tenant

# The paths whose requests are counted: the inference faces.
COUNTED_PREFIX = "/v1/"
NO_STORE = {"Cache-Control": "no-store"}

Viewers = NamedDependency[ConsoleViewers]
Usage = NamedDependency[TenantUsage]
AccessDep = NamedDependency[Access | None]
TinkerDep = NamedDependency[TinkerService | None]


class UsageMiddleware:
    """Counts every request under ``/v1/`` when it ends, for its tenant (the request
    record's, which the inference guard fills in), with its status and tokens."""

    def __init__(self, app: ASGIApp, usage: TenantUsage) -> None:
        self.app, self.usage = app, usage

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(COUNTED_PREFIX):
            await self.app(scope, receive, send)
            return
        status: int | None = None

        async def send_counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            record = scope.get("state", {}).get(RECORD_KEY)
            if isinstance(record, RequestRecord):
                self.usage.record(
                    record.tenant_id, status, record.prompt_tokens, record.completion_tokens
                )
            else:
                self.usage.record(None, status)


def usage_middleware(usage: TenantUsage) -> DefineMiddleware:
    return DefineMiddleware(UsageMiddleware, usage=usage)


class TenantRoutes(Controller):
    @get("/tenants", response_headers=NO_STORE)
    async def tenants(
        self,
        request: Request[Any, Any, Any],
        viewers: Viewers,
        usage: Usage,
        access: AccessDep,
        tinker: TinkerDep,
    ) -> dict[str, Any]:
        viewer = viewers.admin(request)
        day_start, today = usage.today()
        keyring = access.keyring if access is not None else None
        meter = tinker.usage if tinker is not None else None
        tenants = []
        for tenant in sorted(keyring.tenants if keyring else [], key=lambda t: t.id):
            tenants.append(
                {
                    **tenant_json(tenant),
                    "usage": asdict(today.pop(tenant.id, UsageToday())),
                    "tinker_usage": tinker_today(meter, tenant.id, day_start),
                }
            )
        others = [
            {"id": tenant_id, "no_key": tenant_id == NO_TENANT, "usage": asdict(counted)}
            for tenant_id, counted in sorted(today.items())
        ]
        return {
            "keyed": viewers.keyed,
            "viewer": viewer.tenant,
            "day_start": day_start,
            "now": time.time(),
            "tinker": tinker is not None,
            "tenants": tenants,
            "others": others,
        }


def tenant_json(tenant: Tenant) -> dict[str, Any]:
    return {
        "id": tenant.id,
        "faces": sorted(tenant.faces),
        "admin": tenant.allows_face(ADMIN),
        "models": None if tenant.models is None else sorted(tenant.models),
        "weight": tenant.weight,
        "limits": asdict(tenant.limits),
    }


def tinker_today(meter: UsageMeter | None, owner: str, day_start: float) -> dict[str, int] | None:
    """What ``owner`` did on the Tinker API since ``day_start`` (None: no Tinker API)."""
    if meter is None:
        return None
    end = (int(time.time() // HOUR_S) + 1) * HOUR_S
    totals = {"training": 0, "sampling_prefill": 0, "sampling_sample": 0, "checkpoint": 0}
    for event in meter.events(owner, day_start, end):
        totals[event.key.kind] = totals.get(event.key.kind, 0) + event.quantity
    return {
        "trained_tokens": totals["training"],
        "prefill_tokens": totals["sampling_prefill"],
        "sampled_tokens": totals["sampling_sample"],
        "checkpoints_saved": totals["checkpoint"],
    }
