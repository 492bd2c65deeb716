"""``GET /admin/replicas``: a fleet's engine replicas, served when the server runs them."""

from collections.abc import Awaitable, Callable
from typing import Any

from litestar import Controller, Router, get
from litestar.di import NamedDependency

from adapters.http.access import guards
from adapters.http.request_state import provide
from application.access.access import Access

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
