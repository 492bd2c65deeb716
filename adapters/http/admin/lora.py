"""vLLM's runtime LoRA endpoints: ``POST /v1/load_lora_adapter`` ``{lora_name, lora_path}``
serves a PEFT adapter folder as a model from now on (listed in ``/v1/models`` at once, a
possible rollout target), ``POST /v1/unload_lora_adapter`` ``{lora_name}`` stops serving
it (requests running on it finish). Admin keys only (open without keys), answers as vLLM's
(plain text), errors in OpenAI's format naming the field, each change stored and audited
(:class:`~application.serving.lora_adapters.AdapterBook`)."""

from typing import Any, TypeVar

import msgspec
from litestar import Controller, Request, Response, Router, get, post
from litestar.di import NamedDependency

from adapters.http.admin.guard import AccessDep, admin_caller, stored
from adapters.http.errors import OPENAI_ERRORS, exception_handlers
from adapters.http.openai.params import decode_body
from adapters.http.request_state import constants
from application.access.access import Access
from application.serving.lora_adapters import AdapterBook

T = TypeVar("T")
Book = NamedDependency[AdapterBook]


class LoadBody(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str
    lora_path: str


class UnloadBody(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's, ignored: adapters are named


_load = msgspec.json.Decoder(LoadBody)
_unload = msgspec.json.Decoder(UnloadBody)


class LoraRoutes(Controller):
    @post("/v1/load_lora_adapter", status_code=200)
    async def load(
        self, request: Request[Any, Any, Any], book: Book, access: AccessDep
    ) -> Response[str]:
        actor = admin_caller(request, access)
        body = decode_body(_load, request, await request.body())
        await stored("the LoRA adapters", book.load, body.lora_name, body.lora_path, actor)
        text = f"Success: LoRA adapter '{body.lora_name}' added successfully."
        return Response(text, media_type="text/plain")

    @post("/v1/unload_lora_adapter", status_code=200)
    async def unload(
        self, request: Request[Any, Any, Any], book: Book, access: AccessDep
    ) -> Response[str]:
        actor = admin_caller(request, access)
        body = decode_body(_unload, request, await request.body())
        await stored("the LoRA adapters", book.unload, body.lora_name, actor)
        text = f"Success: LoRA adapter '{body.lora_name}' removed successfully."
        return Response(text, media_type="text/plain")

    @get("/admin/lora_adapters")
    async def listed(
        self, request: Request[Any, Any, Any], book: Book, access: AccessDep
    ) -> dict[str, Any]:
        admin_caller(request, access)
        data = [{"object": "lora_adapter", "name": a.name, "path": a.path} for a in book.adapters()]
        return {"object": "list", "data": data}


def lora_router(book: AdapterBook, access: Access | None) -> Router:
    """The runtime LoRA endpoints over ``book`` (see the module)."""
    return Router(
        path="/",
        route_handlers=[LoraRoutes],
        dependencies=constants({"book": book, "access": access}),
        exception_handlers=exception_handlers(OPENAI_ERRORS),
    )
