"""Training steps: forward/backward (JSON or protobuf), forward, optimizer step."""

from typing import Any

from litestar import Controller, Request, Response, post

from adapters.http.auth import Tenant
from adapters.http.tinker import codec
from adapters.http.tinker.deps import Service
from adapters.http.tinker.replies import PROTOBUF, accepted
from domain.training import UnsupportedFeatureError


class TrainingRoutes(Controller):
    @post("/forward_backward", status_code=200)
    async def forward_backward(
        self, request: Request[Any, Any, Any], tenant: Tenant, service: Service
    ) -> Response[bytes]:
        raw = await request.body()
        if request.headers.get("content-encoding", "").lower() == "zstd":
            raise UnsupportedFeatureError("zstd bodies are not enabled (client config off)")
        if PROTOBUF in request.headers.get("content-type", ""):
            model_id, seq_id, data, loss_fn, config, forward_only = codec.forward_backward_proto(
                raw
            )
        else:
            body = codec.decode(raw, codec.ForwardBackwardIn)
            model_id, seq_id = body.model_id, body.seq_id
            data = codec.forward_backward_json(body)
            loss_fn = body.forward_backward_input.loss_fn
            config = dict(body.forward_backward_input.loss_fn_config or {})
            forward_only = False
        future = service.training.forward_backward(
            tenant, model_id, seq_id, data, loss_fn, config, forward_only=forward_only
        )
        return accepted(future.id, model_id)

    @post("/forward", status_code=200)
    async def forward(
        self, request: Request[Any, Any, Any], tenant: Tenant, service: Service
    ) -> Response[bytes]:
        body = codec.decode(await request.body(), codec.ForwardBackwardIn)
        fbi = body.forward_backward_input
        future = service.training.forward_backward(
            tenant,
            body.model_id,
            body.seq_id,
            codec.forward_backward_json(body),
            fbi.loss_fn,
            dict(fbi.loss_fn_config or {}),
            forward_only=True,
        )
        return accepted(future.id, body.model_id)

    @post("/optim_step", status_code=200)
    async def optim_step(
        self, request: Request[Any, Any, Any], tenant: Tenant, service: Service
    ) -> Response[bytes]:
        body = codec.decode(await request.body(), codec.OptimStepIn)
        future = service.training.optim_step(
            tenant, body.model_id, body.seq_id, codec.optim_params(body)
        )
        return accepted(future.id, body.model_id)
