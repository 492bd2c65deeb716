"""A sampling session's clients: ``join_sampling_session`` (a clone's id),
``retrieve_futures`` (one long poll for all of a clone's sample completions) and
``cancel_future`` (stop a sample's work). The SDK uses them when ``/client/config`` turns
``sample_join_sampling_session`` and ``sample_use_retrieve_futures`` on (and
``/client/dynamic_config`` ``sample_cancel_enabled``)."""

from typing import Any

import msgspec
from litestar import Controller, Request, Response, post

from adapters.http.auth import Tenant
from adapters.http.tinker.codec import json as json_codec
from adapters.http.tinker.deps import Service
from adapters.http.tinker.replies import ok
from domain.tinker.errors import InvalidTrainingRequest


class _Body(msgspec.Struct, kw_only=True):
    """Unknown fields are accepted and ignored (newer SDKs add fields)."""


class FuturesTargetIn(_Body):
    sampling_session_id: str
    type: str = "sampling_session"
    cloned_sampler_id: int = 0


class RetrieveFuturesIn(_Body):
    target: FuturesTargetIn
    prev_cursor: int = 0
    timeout: float | None = None
    retrieved_request_ids: list[str] = []


class JoinSamplingSessionIn(_Body):
    sampling_session_id: str


class CancelFutureIn(_Body):
    request_id: str


class SessionFutureRoutes(Controller):
    @post("/join_sampling_session", status_code=200)
    async def join_sampling_session(
        self, request: Request[Any, Any, Any], tenant: Tenant, service: Service
    ) -> Response[bytes]:
        body = json_codec.decode(await request.body(), JoinSamplingSessionIn)
        clone = service.join_sampling_session(tenant, body.sampling_session_id)
        return ok({"type": "join_sampling_session", "client_counter": clone})

    @post("/retrieve_futures", status_code=200)
    async def retrieve_futures(
        self, request: Request[Any, Any, Any], tenant: Tenant, service: Service
    ) -> Response[bytes]:
        body = json_codec.decode(await request.body(), RetrieveFuturesIn)
        if body.target.type != "sampling_session":
            raise InvalidTrainingRequest(
                f"target.type must be 'sampling_session', not {body.target.type!r}"
            )
        found = await service.retrieve_futures(
            tenant,
            body.target.sampling_session_id,
            body.target.cloned_sampler_id,
            body.prev_cursor,
            body.timeout,
            body.retrieved_request_ids,
        )
        completions = [
            {"state": "finished" if c.ok else "failed", "request_id": c.request_id}
            for c in found.completions
        ]
        return ok({"completions": completions, "cursor": found.cursor})

    @post("/cancel_future", status_code=200)
    async def cancel_future(
        self, request: Request[Any, Any, Any], tenant: Tenant, service: Service
    ) -> Response[bytes]:
        body = json_codec.decode(await request.body(), CancelFutureIn)
        service.cancel_future(tenant, body.request_id)
        return ok({})
