"""The console's tenants page data: ``GET /ui/api/tenants`` (admin).

Each tenant of the keys file with its faces, models, weight and limits, and its usage today
(UTC) from the usage ledger (which survives a restart): API requests under ``/v1/``
(OpenAI, Anthropic, Responses, ``/v1/generate``, the model list), their prompt and
completion tokens, the 429s it was answered and other errors; with the Tinker API, the
tokens it trained, prefilled and sampled and the checkpoints it saved today (the Tinker
usage meter's hours since midnight). Usage of tenants no longer in the keys file, and of
requests without a key (an open server), is listed apart.
"""

import time
from dataclasses import asdict
from typing import Any

from litestar import Controller, Request, get
from litestar.di import NamedDependency

from adapters.http.console.viewer import ADMIN, ConsoleViewers
from application.access.access import Access
from application.access.usage_ledger import DAY_S, UsageRecorder
from application.tinker.billing import HOUR_S, UsageMeter
from application.tinker.service import TinkerService
from domain.tenancy import Tenant
from domain.usage import UsageQuery, UsageTotals

NO_STORE = {"Cache-Control": "no-store"}
NO_TENANT = ""  # requests without a key (an open server)

Viewers = NamedDependency[ConsoleViewers]
Usage = NamedDependency[UsageRecorder]
AccessDep = NamedDependency[Access | None]
TinkerDep = NamedDependency[TinkerService | None]


def _today(totals: UsageTotals | None) -> dict[str, int]:
    if totals is None:
        return {
            "requests": 0,
            "prompt_tokens": 0,
            "completion_tokens": 0,
            "rate_limited": 0,
            "errors": 0,
        }
    return {
        "requests": totals.requests,
        "prompt_tokens": totals.prompt_tokens,
        "completion_tokens": totals.completion_tokens,
        "rate_limited": totals.rate_limited,
        "errors": totals.failed,
    }


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
        now = time.time()
        day_start = float(int(now // DAY_S) * DAY_S)
        query = UsageQuery(day_start, day_start + DAY_S, DAY_S, group_by=("tenant_id",))
        today = {row.group[0] or NO_TENANT: row for row in await usage.totals(query)}
        keyring = access.keyring if access is not None else None
        meter = tinker.usage if tinker is not None else None
        tenants = []
        for tenant in sorted(keyring.tenants if keyring else [], key=lambda t: t.id):
            tenants.append(
                {
                    **tenant_json(tenant),
                    "usage": _today(today.pop(tenant.id, None)),
                    "tinker_usage": tinker_today(meter, tenant.id, day_start),
                }
            )
        others = [
            {"id": tenant_id, "no_key": tenant_id == NO_TENANT, "usage": _today(counted)}
            for tenant_id, counted in sorted(today.items())
        ]
        return {
            "keyed": viewers.keyed,
            "viewer": viewer.tenant,
            "day_start": day_start,
            "now": now,
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
