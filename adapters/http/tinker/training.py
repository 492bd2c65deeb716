"""Training steps: forward/backward (JSON or protobuf), forward, optimizer step."""

from collections.abc import Callable
from typing import Any

from litestar import Controller, Request, Response, post

from adapters.http.auth import Tenant
from adapters.http.tinker.codec import json as json_codec
from adapters.http.tinker.codec import proto as proto_codec
from adapters.http.tinker.deps import Service
from adapters.http.tinker.limits import Limits, WorkLimits
from adapters.http.tinker.replies import PROTOBUF, accepted
from application.tinker.futures import Future
from domain.tinker.checks import data_tokens
from domain.tinker.errors import UnsupportedFeatureError
from domain.tinker.values import Datum


class TrainingRoutes(Controller):
    @post("/forward_backward", status_code=200)
    async def forward_backward(
        self, request: Request[Any, Any, Any], tenant: Tenant, service: Service, limits: Limits
    ) -> Response[bytes]:
        raw = await request.body()
        if request.headers.get("content-encoding", "").lower() == "zstd":
            raise UnsupportedFeatureError("zstd bodies are not enabled (client config off)")
        if PROTOBUF in request.headers.get("content-type", ""):
            model_id, seq_id, data, loss_fn, config, forward_only = (
                proto_codec.forward_backward_proto(raw)
            )
        else:
            body = json_codec.decode(raw, json_codec.ForwardBackwardIn)
            model_id, seq_id = body.model_id, body.seq_id
            data = json_codec.forward_backward_json(body)
            loss_fn = body.forward_backward_input.loss_fn
            config = dict(body.forward_backward_input.loss_fn_config or {})
            forward_only = False
        future = await _submit(
            limits,
            data,
            lambda: service.training.forward_backward(
                tenant, model_id, seq_id, data, loss_fn, config, forward_only=forward_only
            ),
        )
        return accepted(future.id, model_id)

    @post("/forward", status_code=200)
    async def forward(
        self, request: Request[Any, Any, Any], tenant: Tenant, service: Service, limits: Limits
    ) -> Response[bytes]:
        body = json_codec.decode(await request.body(), json_codec.ForwardBackwardIn)
        fbi = body.forward_backward_input
        data = json_codec.forward_backward_json(body)
        future = await _submit(
            limits,
            data,
            lambda: service.training.forward_backward(
                tenant,
                body.model_id,
                body.seq_id,
                data,
                fbi.loss_fn,
                dict(fbi.loss_fn_config or {}),
                forward_only=True,
            ),
        )
        return accepted(future.id, body.model_id)

    @post("/optim_step", status_code=200)
    async def optim_step(
        self, request: Request[Any, Any, Any], tenant: Tenant, service: Service
    ) -> Response[bytes]:
        body = json_codec.decode(await request.body(), json_codec.OptimStepIn)
        future = service.training.optim_step(
            tenant, body.model_id, body.seq_id, json_codec.optim_params(body)
        )
        return accepted(future.id, body.model_id)


async def _submit(limits: WorkLimits, data: list[Datum], submit: Callable[[], Future]) -> Future:
    """A forward(/backward) submitted once its data's tokens are counted against the key's
    tokens per minute (given back when it is refused)."""
    await limits.reserve("this forward_backward", data_tokens(data), stream=False)
    try:
        return submit()
    except BaseException:
        await limits.give_back()
        raise
