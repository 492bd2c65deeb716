"""The OpenAI Responses API (docs/responses.md): ``POST /v1/responses`` over the same
completion service as chat completions, and the stored responses' routes.

``params`` turns the body into chat completions' job (one copy of rendering, tools,
constraints and limits), ``replies`` writes the response object or its events from the
choice's one split (``application/chat_output``), ``history`` keeps finished responses per
tenant (``application/responses``' store port). The router shares the OpenAI face's guard,
request dependencies and error table.
"""

from collections.abc import Mapping

from litestar import Router

from adapters.http.access import guards
from adapters.http.errors import OPENAI_ERRORS, exception_handlers
from adapters.http.openai.tools import ToolReplies
from adapters.http.request_state import provide
from adapters.http.responses.controllers import ResponseRoutes
from adapters.http.responses.history import ResponseHistory
from adapters.http.served_models import ModelNames
from application.access.access import Access
from application.serving.completions import CompletionService
from domain.responses import ResponseStore


def responses_router(
    completions: CompletionService,
    names: ModelNames,
    *,
    store: ResponseStore | None = None,
    access: Access | None = None,
) -> Router:
    """``/v1/responses`` over ``completions`` serving ``names``; ``store``: where finished
    responses are kept (None: none are, ``store`` reads false); ``access``: keys and
    limits (None: an open server)."""
    served: Mapping[str, object] = {
        "completions": completions,
        "names": names,
        "tool_calls": ToolReplies(completions.chats.format),
        "history": ResponseHistory(store),
    }
    return Router(
        path="/",
        route_handlers=[ResponseRoutes],
        guards=guards(access),
        dependencies=provide(served),
        exception_handlers=exception_handlers(OPENAI_ERRORS),
    )


__all__ = ["responses_router"]
