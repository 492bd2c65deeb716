"""The web console: ``GET /`` and ``GET /ui`` serve a page (vanilla ES modules from
``static/``, no build step, nothing from a CDN) with a chat playground, the engine's live
statistics, tenants and training runs.

:func:`console_routers` gives the routers ``create_app`` serves unless ``--no-ui``: the
public page and assets (``pages.py``) and the data endpoints behind the API keys
(``engine_events.py``, and ``/ui/api/me``). Every console response carries the strict
Content-Security-Policy of ``security.py`` (a router of the console's own adds
``middleware=[console_headers()]`` and ``guards=console_guard(access)``).
"""

from typing import Any

from litestar import Request, Router, get

from adapters.http.console.engine_events import Replicas, Timeline, engine_handlers, engine_info
from adapters.http.console.pages import page_handlers
from adapters.http.console.security import (
    CONTENT_SECURITY_POLICY,
    console_guard,
    console_headers,
)
from adapters.http.ownership import Draining
from adapters.http.request_state import api_state
from application.access.access import Access

__all__ = [
    "CONTENT_SECURITY_POLICY",
    "Replicas",
    "Timeline",
    "console_guard",
    "console_headers",
    "console_routers",
    "engine_info",
]


@get("/ui/api/me", include_in_schema=False, sync_to_thread=False)
def me(request: Request[Any, Any, Any]) -> dict[str, Any]:
    """Who the key stands for (a key check for the page): the tenant's id and faces."""
    tenant = getattr(api_state(request), "tenant", None)
    if tenant is None:
        return {"tenant": None, "faces": None}
    return {"tenant": tenant.id, "faces": sorted(tenant.faces)}


def console_routers(
    access: Access | None,
    draining: Draining,
    info: dict[str, Any],
    *,
    timeline: Timeline | None = None,
    replicas: Replicas | None = None,
) -> list[Router]:
    """The console's routers: its public page and assets, and its data behind
    ``access``'s keys. ``info``: the engine's sizes (:func:`engine_info`)."""
    headers = [console_headers()]
    return [
        Router(path="/", route_handlers=page_handlers(access), middleware=headers),
        Router(
            path="/",
            route_handlers=[me, *engine_handlers(timeline, replicas, draining, info)],
            guards=console_guard(access),
            middleware=headers,
        ),
    ]
