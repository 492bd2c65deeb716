"""The Anthropic face (docs/anthropic.md): the Messages API, ``POST /v1/messages`` and
``POST /v1/messages/count_tokens``, for the ``anthropic`` SDKs and Claude Code.

A message request is translated into the chat it asks for (``params``) and run by the
same completion service as ``/v1/chat/completions`` — one copy of rendering, tools,
grammar and limits; its choice is split by :mod:`application.serving.chat_output` and written as
content blocks or Anthropic's events (``replies``). Keys come in ``x-api-key`` (or
``Authorization: Bearer``) under the inference guard, with the same keys file, scopes
and limits as the OpenAI face; every error is in Anthropic's format (``errors``).
"""

from litestar import Router

from adapters.http.access import guards
from adapters.http.anthropic.controllers import MessageRoutes
from adapters.http.anthropic.errors import ANTHROPIC_HANDLERS
from adapters.http.request_state import provide
from adapters.http.served_models import ModelNames
from application.access.access import Access
from application.serving.completions import CompletionService

MISSING_KEY = "missing API key: send it in the x-api-key header"


def anthropic_router(
    completions: CompletionService, names: ModelNames, *, access: Access | None = None
) -> Router:
    """The Messages face over ``completions`` serving ``names``; ``access``: keys and
    limits (None: an open server)."""
    return Router(
        path="/",
        route_handlers=[MessageRoutes],
        guards=guards(access, MISSING_KEY),
        dependencies=provide({"completions": completions, "names": names}),
        exception_handlers=ANTHROPIC_HANDLERS,  # type: ignore[arg-type]
    )


__all__ = ["anthropic_router"]
