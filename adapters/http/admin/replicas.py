"""``GET /admin/replicas``: a fleet's engine replicas (each with its circuit breaker's
state), served when the server runs them; with the fault hook on (tests and chaos runs:
``INFER_FAULT_INJECTION=1``), ``POST /admin/replicas/{id}/fault`` ``{"fail": true}`` makes
a replica fail every call until ``{"fail": false}`` (admin keys only)."""

from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from litestar import Controller, Request, Router, get, post
from litestar.di import NamedDependency

from adapters.http.access import guards
from adapters.http.admin.guard import AccessDep, admin_caller
from adapters.http.errors import OPENAI_ERRORS, HTTPError, exception_handlers
from adapters.http.openai.params import decode_body
from adapters.http.request_state import provide
from application.access.access import Access

ReplicaList = Callable[[], Awaitable[list[dict[str, Any]]]]
Fault = Callable[[str, bool], Awaitable[str]]
Replicas = NamedDependency[ReplicaList]
Faults = NamedDependency[Fault | None]


class FaultBody(msgspec.Struct, forbid_unknown_fields=True):
    fail: bool


_fault = msgspec.json.Decoder(FaultBody)


class AdminRoutes(Controller):
    @get("/admin/replicas")
    async def replicas(self, replicas: Replicas) -> dict[str, Any]:
        listed = await replicas()
        return {"object": "list", "data": listed}

    @post("/admin/replicas/{replica_id:str}/fault", status_code=200)
    async def fault(
        self, request: Request[Any, Any, Any], replica_id: str, faults: Faults, access: AccessDep
    ) -> dict[str, Any]:
        admin_caller(request, access)
        if faults is None:
            raise HTTPError(
                404,
                "the fault hook is off (INFER_FAULT_INJECTION=1 turns it on)",
                "invalid_request_error",
            )
        body = decode_body(_fault, request, await request.body())
        try:
            done = await faults(replica_id, body.fail)
        except Exception as e:
            raise HTTPError(
                404, f"no replica {replica_id!r} took it: {e}"[:300], "invalid_request_error"
            ) from e
        return {"object": "replica.fault", "id": done, "fail": body.fail}


def admin_router(
    replicas: ReplicaList, access: Access | None, faults: Fault | None = None
) -> Router:
    return Router(
        path="/",
        route_handlers=[AdminRoutes],
        guards=guards(access),
        dependencies=provide({"replicas": replicas, "faults": faults, "access": access}),
        exception_handlers=exception_handlers(OPENAI_ERRORS),
    )
