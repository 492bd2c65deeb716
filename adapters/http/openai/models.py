"""``GET /v1/models`` and ``GET /v1/models/{id}``: the models the caller may use (an id may
hold ``/``: a hub id, a ``tinker://`` path), and more models listed beside them (the
embedding model, its card's ``task`` ``embed``; the others' ``generate``), under the
caller's key scopes."""

from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from litestar import Controller, Request, Response, get
from litestar.di import NamedDependency
from litestar.params import FromPath

from adapters.http.openai.replies import json_response
from adapters.http.openai.schemas import ModelCard, ModelList
from adapters.http.request_state import api_state
from adapters.http.served_models import ModelNames
from application.serving.served_models import ModelEntry
from domain.errors import ModelNotFoundError

MODELS_PATH = "/v1/models"


class ModelCards:
    """The cards of ``names`` (each with the engine's ``max_model_len``) and of
    ``other_models`` (name -> max_model_len)."""

    def __init__(
        self, names: ModelNames, max_model_len: int, other_models: Mapping[str, int] | None = None
    ) -> None:
        self.names, self.max_model_len = names, max_model_len
        self.other_models = dict(other_models or {})
        self.created = int(datetime.now(UTC).timestamp())

    def visible(self, request: Request[Any, Any, Any]) -> list[ModelCard]:
        tenant = api_state(request).tenant
        others = [
            ModelCard(name, self.created, root=name, max_model_len=max_len, task="embed")
            for name, max_len in self.other_models.items()
            if tenant is None or tenant.allows_model(name)
        ]
        return [self.card(e) for e in self.names.visible(request)] + others

    def card(self, entry: ModelEntry) -> ModelCard:
        day = entry.deprecation_date
        return ModelCard(
            entry.id,
            entry.created,
            root=entry.root,
            parent=entry.parent,
            max_model_len=self.max_model_len,
            deprecation_date=day.isoformat() if day is not None else None,
        )


Cards = NamedDependency[ModelCards]


class ModelRoutes(Controller):
    @get(MODELS_PATH)
    async def list_models(self, request: Request[Any, Any, Any], cards: Cards) -> Response[bytes]:
        return json_response(ModelList(cards.visible(request)))

    @get("/v1/models/{model_id:path}")
    async def retrieve_model(
        self, request: Request[Any, Any, Any], model_id: FromPath[Path], cards: Cards
    ) -> Response[bytes]:
        # The id as sent: the parsed path (and the parameter) fold a tinker:// path's "//".
        raw = request.scope.get("raw_path") or request.scope["path"].encode()
        wanted = unquote(raw.decode("latin-1")).removeprefix(MODELS_PATH + "/")
        found = next((c for c in cards.visible(request) if c.id == wanted), None)
        if found is None:
            raise ModelNotFoundError(f"The model `{wanted}` does not exist")
        return json_response(found)
