"""Sampling: sampling sessions and ``asample``."""

from typing import Any

from litestar import Controller, Request, Response, get, post
from litestar.params import FromPath

from adapters.http.auth import Tenant
from adapters.http.tinker.codec import json as json_codec
from adapters.http.tinker.deps import Service
from adapters.http.tinker.limits import Limits
from adapters.http.tinker.replies import ok
from domain.tinker.errors import InvalidTrainingRequest


class SamplingRoutes(Controller):
    @post("/create_sampling_session", status_code=200)
    async def create_sampling_session(
        self, request: Request[Any, Any, Any], tenant: Tenant, service: Service
    ) -> Response[bytes]:
        body = json_codec.decode(await request.body(), json_codec.CreateSamplingSessionIn)
        sampler = service.create_sampler(
            tenant,
            body.session_id,
            body.sampling_session_seq_id,
            base_model=body.base_model,
            model_path=body.model_path,
        )
        return ok({"type": "create_sampling_session", "sampling_session_id": sampler.id})

    @get("/samplers/{sampler_id:str}")
    async def get_sampler(
        self, sampler_id: FromPath[str], tenant: Tenant, service: Service
    ) -> Response[bytes]:
        sampler = service.sampling.get(tenant, sampler_id)
        return ok(
            {
                "sampler_id": sampler.id,
                "base_model": sampler.source.base_model,
                "model_path": sampler.model_path,
            }
        )

    @post("/asample", status_code=200)
    async def asample(
        self, request: Request[Any, Any, Any], tenant: Tenant, service: Service, limits: Limits
    ) -> Response[bytes]:
        body = json_codec.decode(await request.body(), json_codec.SampleIn)
        targets = json_codec.prompt_targets(body.target_prompt_logprobs)
        target = service.sample_target(
            tenant,
            sampler_id=body.sampling_session_id,
            base_model=body.base_model,
            model_path=body.model_path,
        )
        prompt = json_codec.prompt_tokens(body.prompt)
        record = bool(body.record_stability_info)
        if record and body.sampling_session_id is None:
            raise InvalidTrainingRequest(
                "record_stability_info needs a sampling session (sampling_session_id): "
                "recorded sequences belong to its session"
            )
        room = max(1, target.max_context_length - len(prompt))  # max_tokens left out: all
        params = json_codec.sample_params(body.sampling_params, room)
        # The key's tokens (prompt + max_tokens per sequence) and a stream, until it ends.
        reserved = len(prompt) + params.max_tokens * max(1, body.num_samples)
        what = "this sample (prompt + max_tokens × num_samples)"
        await limits.reserve(what, reserved, stream=True)
        try:
            future = service.sampling.sample(
                tenant,
                target.source,
                prompt,
                params,
                body.num_samples,
                prompt_logprobs=bool(body.prompt_logprobs),
                prompt_logprobs_last_n=body.prompt_logprobs_last_n,
                topk_prompt=body.topk_prompt_logprobs,
                topk_sample=body.topk_sample_logprobs,
                target_prompt=targets,
                prompt_alt_k=body.prompt_alt_tokens_k,
            )
        except BaseException:
            await limits.give_back()
            raise
        limits.settle_when_done(future)
        ids = service.sequence_ids(
            tenant,
            future,
            prompt,
            body.num_samples,
            record_in=body.sampling_session_id if record else None,
        )
        service.track_sample(  # retrieve_futures, usage, the tokens it used
            tenant,
            future,
            sampler_id=body.sampling_session_id,
            seq_id=body.seq_id,
            base_model=target.source.base_model,
            prompt_tokens=len(prompt),
        )
        return ok({"request_id": future.id, "sample_sequence_ids": ids})
