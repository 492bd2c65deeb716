"""The OpenAI face (docs/openai.md): ``/v1/completions``,
``/v1/chat/completions``, ``/v1/models``, ``/v1/embeddings`` and vLLM's ``/tokenize`` /
``/detokenize``, as Litestar controllers over the application's services.

One controller per resource (``controllers`` for the two completion endpoints, ``models``,
``tokenize``, ``embeddings``); handlers parse the wire (``schemas``, ``params``,
``structured``, ``tools``), make one service call and write the reply (``replies``).
Every route shares the inference guard (keys and limits), the dependencies below
(``deps``), and ``OPENAI_ERRORS`` registered as the router's exception handlers.
"""

from collections.abc import Mapping

from litestar import Router

from adapters.http.access import guards
from adapters.http.errors import OPENAI_ERRORS, exception_handlers
from adapters.http.openai.controllers import CompletionRoutes
from adapters.http.openai.embeddings import EmbeddingRoutes
from adapters.http.openai.models import ModelCards, ModelRoutes
from adapters.http.openai.tokenize import TokenizeRoutes
from adapters.http.openai.tools import ToolReplies
from adapters.http.request_state import provide
from adapters.http.served_models import ModelNames
from application.access.access import Access
from application.serving.completions import CompletionService
from application.serving.embeddings import EmbeddingService


def openai_router(
    completions: CompletionService,
    names: ModelNames,
    *,
    access: Access | None = None,
    embeddings: EmbeddingService | None = None,
) -> Router:
    """The face over ``completions`` (its input processor tokenizes and renders for the
    other routes) serving ``names``; ``access``: keys and limits (None: an open server);
    ``embeddings``: also serve ``/v1/embeddings`` (and list its model)."""
    inputs = completions.inputs
    cards = ModelCards(
        names,
        inputs.max_model_len,
        {} if embeddings is None else {embeddings.model_name: embeddings.max_tokens},
    )
    served: Mapping[str, object] = {
        "completions": completions,
        "inputs": inputs,
        "names": names,
        "tool_calls": ToolReplies(completions.chats.format),
        "cards": cards,
        **({} if embeddings is None else {"embeddings": embeddings}),
    }
    return Router(
        path="/",
        route_handlers=[
            CompletionRoutes,
            ModelRoutes,
            TokenizeRoutes,
            *([] if embeddings is None else [EmbeddingRoutes]),
        ],
        guards=guards(access),
        dependencies=provide(served),
        exception_handlers=exception_handlers(OPENAI_ERRORS),
    )


__all__ = ["openai_router"]
