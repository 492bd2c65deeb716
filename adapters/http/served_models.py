"""Model names on the inference faces (:mod:`application.served_models` on the wire).

:class:`ModelNames` answers which model a request's ``model`` names (404 in OpenAI's
format, ``model_not_found``, when none), whether the caller's key may use it (403), and
holds what the request needs until its HTTP exchange ends: the LoRA adapter pinned in the
engine, and for a name being retired the RFC 9745 / RFC 8594 headers
``Deprecation: @<epoch>`` and ``Sunset: <HTTP-date>`` (both the name's deprecation date,
the day it stops being served). ``GET /v1/models`` and ``GET /v1/models/{id}`` list what
the caller may use.

Keys' model scopes: a key allowed the base model's id may use all its names (aliases, the
pinned version) and its own Tinker checkpoints; one allowed only an alias, that alias;
LoRA modules are allowed by their own names.
"""

from collections.abc import Callable, Mapping
from contextlib import ExitStack
from datetime import UTC, date, datetime, time
from email.utils import format_datetime
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import msgspec
from litestar import Request, Response, get
from litestar.connection import ASGIConnection
from litestar.handlers import HTTPRouteHandler
from litestar.middleware import DefineMiddleware
from litestar.params import FromPath
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from adapters.http.access import inference_guard, request_tenant
from adapters.http.errors import OPENAI_ERRORS, ErrorTable
from adapters.http.openai_schemas import ModelCard, ModelList
from application.access import Access
from application.engine_client import EngineClient
from application.served_models import ModelEntry, ServedModels
from domain.errors import ModelNotFoundError
from domain.tenancy import PermissionDeniedError

_HOLD = "infer.model_hold"
MODELS_PATH = "/v1/models"
_encoder = msgspec.json.Encoder()
# The caller's Tinker tenant (raises when its key is not a Tinker key).
Owner = Callable[[ASGIConnection[Any, Any, Any, Any]], str]


class _Hold:
    """What one HTTP request holds on its model until it ends."""

    def __init__(self) -> None:
        self.pins = ExitStack()
        self.headers: list[tuple[bytes, bytes]] = []


class ModelNames:
    """``models`` on one app; ``owner``: the caller's Tinker tenant (None: no Tinker API,
    so no ``tinker://`` models)."""

    def __init__(self, models: ServedModels, owner: Owner | None = None) -> None:
        self.models, self._owner = models, owner

    def owner(self, request: ASGIConnection[Any, Any, Any, Any]) -> str | None:
        if self._owner is None:
            return None
        try:
            return self._owner(request)
        except Exception:  # no Tinker key: no checkpoint of its own
            return None

    def resolve(
        self, request: Request[Any, Any, Any], requested: str | None, errors: ErrorTable
    ) -> ModelEntry:
        """The model ``requested`` names (None: the base model), usable by the caller;
        its adapter stays loaded, and the reply carries its deprecation, until the HTTP
        request ends."""
        try:
            entry = self.models.resolve(requested, self.owner(request))
        except ModelNotFoundError as e:
            raise errors.error(e, "model") from e
        tenant = request_tenant(request)
        if tenant is not None and not entry.allowed(tenant.allows_model):
            denied = PermissionDeniedError(f"this API key may not use the model {entry.id!r}")
            raise errors.error(denied)
        hold: _Hold = request.scope["state"][_HOLD]  # model_names_middleware is installed
        try:
            hold.pins.enter_context(self.models.use(entry))
        except Exception as e:
            raise errors.error(e, "model") from e
        if entry.deprecation_date is not None:
            hold.headers = deprecation_headers(entry.deprecation_date)
        return entry

    def visible(self, request: Request[Any, Any, Any]) -> list[ModelEntry]:
        """The models the caller may use."""
        tenant = request_tenant(request)
        entries = self.models.entries(self.owner(request))
        return [e for e in entries if tenant is None or e.allowed(tenant.allows_model)]


def deprecation_headers(day: date) -> list[tuple[bytes, bytes]]:
    """RFC 9745's ``Deprecation`` (a structured date: ``@`` + seconds since the epoch) and
    RFC 8594's ``Sunset`` (an HTTP-date), both at the start of ``day`` (UTC)."""
    moment = datetime.combine(day, time(0), tzinfo=UTC)
    return [
        (b"deprecation", f"@{int(moment.timestamp())}".encode()),
        (b"sunset", format_datetime(moment, usegmt=True).encode()),
    ]


class _HoldingMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        hold = _Hold()
        # A state of its own (the server's may be shared between requests).
        scope["state"] = {**scope.get("state", {}), _HOLD: hold}

        async def send_with_headers(message: Message) -> None:
            if hold.headers and message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *hold.headers]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_headers)
        finally:  # after the owning middleware closed the request's engine work
            hold.pins.close()


def model_names_middleware() -> DefineMiddleware:
    """Install outside the owning middleware: adapters are unpinned only once the
    request's engine work was aborted or finished."""
    return DefineMiddleware(_HoldingMiddleware)


def models_routes(
    engine: EngineClient,
    names: ModelNames,
    access: Access | None = None,
    other_models: Mapping[str, int] | None = None,
) -> list[HTTPRouteHandler]:
    """``GET /v1/models`` and ``GET /v1/models/{id}`` (an id may hold ``/``: a hub id, a
    ``tinker://`` path). ``other_models``: more models listed (the embedding model), name
    -> max_model_len, under the caller's key scopes."""
    guards = [inference_guard(access, OPENAI_ERRORS)] if access is not None else []
    created = int(datetime.now(UTC).timestamp())

    def visible(request: Request[Any, Any, Any]) -> list[ModelCard]:
        tenant = request_tenant(request)
        others = [
            ModelCard(name, created, root=name, max_model_len=max_len)
            for name, max_len in (other_models or {}).items()
            if tenant is None or tenant.allows_model(name)
        ]
        return [card(e) for e in names.visible(request)] + others

    def card(entry: ModelEntry) -> ModelCard:
        day = entry.deprecation_date
        return ModelCard(
            entry.id,
            entry.created,
            root=entry.root,
            parent=entry.parent,
            max_model_len=engine.max_seq_len,
            deprecation_date=day.isoformat() if day is not None else None,
        )

    @get(MODELS_PATH, guards=guards)
    async def list_models(request: Request[Any, Any, Any]) -> Response[bytes]:
        cards = ModelList(visible(request))
        return Response(_encoder.encode(cards), media_type="application/json")

    @get("/v1/models/{model_id:path}", guards=guards)
    async def retrieve_model(
        request: Request[Any, Any, Any], model_id: FromPath[Path]
    ) -> Response[bytes]:
        # The id as sent: the parsed path (and the parameter) fold a tinker:// path's "//".
        raw = request.scope.get("raw_path") or request.scope["path"].encode()
        wanted = unquote(raw.decode("latin-1")).removeprefix(MODELS_PATH + "/")
        found = next((c for c in visible(request) if c.id == wanted), None)
        if found is None:
            missing = ModelNotFoundError(f"The model `{wanted}` does not exist")
            raise OPENAI_ERRORS.error(missing, "model")
        return Response(_encoder.encode(found), media_type="application/json")

    return [list_models, retrieve_model]


__all__ = ["ModelNames", "deprecation_headers", "model_names_middleware", "models_routes"]
