"""``GET /admin/audit``: the audit trail — what admins (and the server on its own) changed:
tenants, keys, rollouts, the keys file reloaded — newest first; admin keys only."""

import asyncio
from typing import Any

from litestar import Controller, Request, Router, get
from litestar.di import NamedDependency

from adapters.http import query_params
from adapters.http.admin.guard import AccessDep, admin_caller
from adapters.http.errors import OPENAI_ERRORS, exception_handlers
from adapters.http.request_state import constants
from application.access.access import Access
from application.access.audit import Audit
from domain.errors import InvalidRequestError

MAX_LIMIT = 1000
AuditDep = NamedDependency[Audit]


class AuditRoutes(Controller):
    @get("/admin/audit")
    async def audit(
        self, request: Request[Any, Any, Any], audit: AuditDep, access: AccessDep
    ) -> dict[str, Any]:
        admin_caller(request, access)
        params = request.query_params
        since, until = query_params.number(params, "since"), query_params.number(params, "until")
        limit = query_params.integer(params, "limit")
        count = 100 if limit is None else limit
        if not 1 <= count <= MAX_LIMIT:
            raise InvalidRequestError("limit", f"limit is a whole number, 1 to {MAX_LIMIT}")
        events = await asyncio.to_thread(audit.read, since=since, until=until, limit=count + 1)
        return {
            "object": "list",
            "data": [
                {
                    "at": e.at,
                    "event": e.event,
                    "actor": e.actor,
                    "subject": e.subject,
                    "details": dict(e.details),
                }
                for e in events[:count]
            ],
            "has_more": len(events) > count,
        }


def audit_router(audit: Audit, access: Access | None) -> Router:
    return Router(
        path="/",
        route_handlers=[AuditRoutes],
        dependencies=constants({"audit": audit, "access": access}),
        exception_handlers=exception_handlers(OPENAI_ERRORS),
    )
