"""``create_custom_loss``: a loss the SDK traced (``ServiceClient.create_custom_loss`` with
``custom_loss_server_side``), checked and stored for its session.

The body is Tinker's ``CreateCustomLossRequest``; it is read up to
``domain.tinker.custom_loss.MAX_BODY_BYTES`` and no further. The answer is a future that resolves
to ``{"type": "create_custom_loss", "loss_id"}``, which the SDK then sends as
``forward_backward(data, "custom", {"loss_id": ...})``.
"""

from typing import Any

import msgspec
from litestar import Controller, Request, Response, post

from adapters.http.auth import Tenant
from adapters.http.tinker.codec import json as json_codec
from adapters.http.tinker.deps import Service
from adapters.http.tinker.replies import ok
from domain.tinker.custom_loss import MAX_BODY_BYTES, RawNode
from domain.tinker.errors import InvalidTrainingRequest


class _In(msgspec.Struct, kw_only=True):
    """Unknown fields are accepted and ignored (newer SDKs add fields)."""


class CustomLossNodeIn(_In):
    op: str
    name: str
    target: str
    args: list[Any] = []
    kwargs: dict[str, Any] = {}


class CustomLossGraphIn(_In):
    nodes: list[CustomLossNodeIn]
    format: int = 1


class CustomLossInputIn(_In):
    name: str
    rank: int


class CreateCustomLossIn(_In):
    session_id: str
    custom_loss_seq_id: int
    name: str
    inputs: list[CustomLossInputIn]
    graph: CustomLossGraphIn


async def bounded_body(request: Request[Any, Any, Any], limit: int) -> bytes:
    """The request body, refused (400) once it passes ``limit`` bytes."""
    too_big = InvalidTrainingRequest(
        f"create_custom_loss: the request body exceeds {limit} bytes (a custom loss graph "
        "is limited in size)"
    )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


class CustomLossRoutes(Controller):
    @post("/create_custom_loss", status_code=200)
    async def create_custom_loss(
        self, request: Request[Any, Any, Any], tenant: Tenant, service: Service
    ) -> Response[bytes]:
        body = json_codec.decode(await bounded_body(request, MAX_BODY_BYTES), CreateCustomLossIn)
        nodes = [RawNode(n.op, n.name, n.target, n.args, n.kwargs) for n in body.graph.nodes]
        future = service.create_custom_loss(
            tenant,
            body.session_id,
            body.custom_loss_seq_id,
            body.name,
            [(i.name, i.rank) for i in body.inputs],
            nodes,
            body.graph.format,
        )
        return ok({"request_id": future.id})
