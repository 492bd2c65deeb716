"""``retrieve_future``: the long poll for a request's result (JSON or protobuf)."""

from typing import Any

from litestar import Controller, Request, Response, post

from adapters.http.auth import Tenant
from adapters.http.tinker.codec import json as json_codec
from adapters.http.tinker.codec import proto as proto_codec
from adapters.http.tinker.deps import Service
from adapters.http.tinker.replies import PROTOBUF, ok, result_json
from domain.tinker.batch import ForwardBackwardResult
from domain.tinker.values import TinkerSampleResult


class FutureRoutes(Controller):
    @post("/retrieve_future", status_code=200)
    async def retrieve_future(
        self, request: Request[Any, Any, Any], tenant: Tenant, service: Service
    ) -> Response[bytes]:
        """A failed future answers ``{"error", "category"}`` with 200, as the SDK expects."""
        body = json_codec.decode(await request.body(), json_codec.RetrieveFutureIn)
        future = await service.futures.wait(tenant, body.request_id, service.long_poll_s)
        if not future.finished:
            state, reason = service.queue_state(tenant, future)
            reply = {"type": "try_again", "request_id": future.id, "queue_state": state}
            return ok(reply if reason is None else {**reply, "queue_state_reason": reason})
        if future.error is not None:
            return ok({"error": str(future.error), "category": future.error.category})
        proto = PROTOBUF in request.headers.get("accept", "")
        result = future.result
        if isinstance(result, ForwardBackwardResult):
            if proto:
                return Response(
                    proto_codec.forward_backward_output_proto(result), media_type=PROTOBUF
                )
            return ok(json_codec.forward_backward_output_json(result))
        if isinstance(result, TinkerSampleResult):
            if proto:
                return Response(proto_codec.sample_response_proto(result), media_type=PROTOBUF)
            return ok(json_codec.sample_response_json(result))
        return ok(result_json(future.kind, result))
