"""Weights: save (for training, for a sampler, external), load, copy, describe."""

from typing import Any

from litestar import Controller, Request, Response, post

from adapters.http.auth import Tenant
from adapters.http.tinker.codec import json as json_codec
from adapters.http.tinker.deps import Service
from adapters.http.tinker.replies import accepted, ok
from domain.tinker.errors import UnsupportedFeatureError
from domain.tinker.values import CheckpointRef


class WeightRoutes(Controller):
    @post("/save_weights", status_code=200)
    async def save_weights(
        self, request: Request[Any, Any, Any], tenant: Tenant, service: Service
    ) -> Response[bytes]:
        body = json_codec.decode(await request.body(), json_codec.SaveWeightsIn)
        future = service.training.save(
            tenant,
            body.model_id,
            body.seq_id,
            "training",
            body.path,
            ttl_seconds=body.ttl_seconds,
            user_metadata=body.user_metadata,
            overwrite=body.overwrite,
        )
        return accepted(future.id, body.model_id)

    @post("/save_weights_for_sampler", status_code=200)
    async def save_weights_for_sampler(
        self, request: Request[Any, Any, Any], tenant: Tenant, service: Service
    ) -> Response[bytes]:
        body = json_codec.decode(await request.body(), json_codec.SaveForSamplerIn)
        future = service.save_for_sampler(
            tenant,
            body.model_id,
            body.seq_id,
            path=body.path,
            kind=body.kind,
            sampling_session_seq_id=body.sampling_session_seq_id,
            ttl_seconds=body.ttl_seconds,
            user_metadata=body.user_metadata,
        )
        return accepted(future.id, body.model_id)

    @post("/save_weights_external", status_code=200)
    async def save_weights_external(
        self, request: Request[Any, Any, Any], tenant: Tenant, service: Service
    ) -> Response[bytes]:
        body = json_codec.decode(await request.body(), json_codec.SaveExternalIn)
        if body.age_encryption_recipients:
            raise UnsupportedFeatureError("age_encryption_recipients is not supported")
        future = service.training.save(
            tenant, body.model_id, body.seq_id, "external", body.path, ttl_seconds=body.ttl_seconds
        )
        return accepted(future.id, body.model_id)

    @post("/load_weights", status_code=200)
    async def load_weights(
        self, request: Request[Any, Any, Any], tenant: Tenant, service: Service
    ) -> Response[bytes]:
        body = json_codec.decode(await request.body(), json_codec.LoadWeightsIn)
        optimizer_config = json_codec.check_optimizer(body.optimizer_config)
        future, model_id = service.load_weights(
            tenant,
            body.path,
            optimizer=body.optimizer,
            model_id=body.model_id,
            seq_id=body.seq_id,
            session_id=body.session_id,
            model_seq_id=body.model_seq_id,
            user_metadata=body.user_metadata,
            optimizer_config=optimizer_config,
        )
        return accepted(future.id, model_id)

    @post("/copy_weights", status_code=200)
    async def copy_weights(self, tenant: Tenant) -> Response[bytes]:
        raise UnsupportedFeatureError(
            "copy_weights (between projects) is not supported: this server has one project"
        )

    @post("/weights_info", status_code=200)
    async def weights_info(
        self, request: Request[Any, Any, Any], tenant: Tenant, service: Service
    ) -> Response[bytes]:
        body = json_codec.decode(await request.body(), json_codec.WeightsInfoIn)
        record = service.checkpoints.get(tenant, CheckpointRef.parse(body.tinker_path))
        return ok(
            {
                "base_model": record.base_model,
                "is_lora": True,
                "lora_rank": record.lora.rank,
                "train_unembed": record.lora.train_unembed,
                "train_mlp": record.lora.train_mlp,
                "train_attn": record.lora.train_attn,
                "optimizer_config": json_codec.optimizer_config_json(record.optimizer),
            }
        )
