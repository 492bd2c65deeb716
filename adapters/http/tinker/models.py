"""Training runs (the SDK's models): create, describe, unload."""

from typing import Any

from litestar import Controller, Request, Response, post

from adapters.http.auth import Tenant
from adapters.http.tinker.codec import json as json_codec
from adapters.http.tinker.deps import Service
from adapters.http.tinker.replies import accepted, ok


class ModelRoutes(Controller):
    @post("/create_model", status_code=200)
    async def create_model(
        self, request: Request[Any, Any, Any], tenant: Tenant, service: Service
    ) -> Response[bytes]:
        body = json_codec.decode(await request.body(), json_codec.CreateModelIn)
        optimizer = json_codec.check_optimizer(body.optimizer_config) or "adamw"
        future, model_id = service.create_model(
            tenant,
            body.session_id,
            body.model_seq_id,
            body.base_model,
            json_codec.lora_spec(body.lora_config),
            body.user_metadata,
            optimizer,
        )
        return accepted(future.id, model_id)

    @post("/get_info", status_code=200)
    async def get_info(
        self, request: Request[Any, Any, Any], tenant: Tenant, service: Service
    ) -> Response[bytes]:
        body = json_codec.decode(await request.body(), json_codec.ModelIdIn)
        run, info = service.model_info(tenant, body.model_id)
        return ok(
            {
                "type": "get_info",
                "model_id": run.run_id,
                "model_data": {
                    "arch": info.arch,
                    "model_name": run.base_model,
                    "tokenizer_id": info.tokenizer_id or None,
                },
                "is_lora": True,
                "lora_rank": run.lora.rank,
                "model_name": run.base_model,
                "optimizer_config": json_codec.optimizer_config_json(run.optimizer),
            }
        )

    @post("/unload_model", status_code=200)
    async def unload_model(
        self, request: Request[Any, Any, Any], tenant: Tenant, service: Service
    ) -> Response[bytes]:
        body = json_codec.decode(await request.body(), json_codec.ModelIdIn)
        future = service.unload(tenant, body.model_id)
        return accepted(future.id, body.model_id)
