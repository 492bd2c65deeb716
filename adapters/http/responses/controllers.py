"""``/v1/responses``: a response created (the body as a chat job, ``params.py``; one call
to the completion service; the reply whole or as events, ``replies.py``), and the stored
responses read, listed, deleted (``history.py``)."""

from typing import Any

import msgspec
from litestar import Controller, Request, Response, delete, get, post
from litestar.params import FromPath, FromQuery
from litestar.response import ServerSentEvent

from adapters.http.errors import OPENAI_ERRORS, PROMPT_FIELD, HTTPError
from adapters.http.openai.params import decode_body
from adapters.http.openai.replies import json_response
from adapters.http.request_state import RequestCaller
from adapters.http.responses.deps import Completions, History, Names, ToolCalls
from adapters.http.responses.history import tenant_of
from adapters.http.responses.params import renamed, response_turn
from adapters.http.responses.replies import event_stream, response_body, response_events
from adapters.http.responses.schemas import (
    DeletedResponse,
    InputItemList,
    ResponseObject,
    ResponseRequest,
)
from adapters.http.streaming import unless_disconnected
from application.serving.chat_output import ChoiceError, collect_choice
from domain.errors import InvalidParameterError

_decoder = msgspec.json.Decoder(ResponseRequest)
_encoder = msgspec.json.Encoder()
Reply = Response[bytes] | ServerSentEvent
MAX_LIST_LIMIT = 100


class ResponseRoutes(Controller):
    @post("/v1/responses", status_code=200, opt={PROMPT_FIELD: "input"})
    async def create(
        self,
        request: Request[Any, Any, Any],
        caller: RequestCaller,
        completions: Completions,
        names: Names,
        tool_calls: ToolCalls,
        history: History,
    ) -> Reply:
        body = decode_body(_decoder, request, await request.body())
        record = caller.record
        record.model, record.user, record.stream = body.model, body.user, bool(body.stream)
        model = names.resolve(request, body.model)
        tenant = tenant_of(request)
        previous = await history.previous(tenant, body.previous_response_id)
        turn = response_turn(body, model.adapter_id, model.id, previous, history.stores(body.store))
        try:
            started = await completions.chat(turn.job, caller)
        except InvalidParameterError as e:  # named as chat's body has it: as ours has it
            error = OPENAI_ERRORS.error(e, "input")
            raise (renamed(error) if isinstance(error, HTTPError) else error) from e
        [stream] = started.streams
        tools = turn.job.tools
        parser, parallel = tool_calls.parser(tools), tools is None or tools.parallel

        async def keep(response: ResponseObject) -> None:
            await history.keep(tenant, response, turn.conversation)

        if body.stream:
            events = response_events(
                turn.skeleton, stream, started.reasoning, parser, parallel, keep
            )
            return event_stream(events)
        try:
            result = await unless_disconnected(
                request, collect_choice(stream, started.reasoning, parser, parallel)
            )
        except ChoiceError as e:
            raise HTTPError(500, str(e), "server_error") from e
        response = response_body(turn.skeleton, result)
        await keep(response)
        return json_response(response)

    @get("/v1/responses/{response_id:str}")
    async def retrieve(
        self, request: Request[Any, Any, Any], response_id: FromPath[str], history: History
    ) -> Response[bytes]:
        stored = await history.find(tenant_of(request), response_id)
        return _json(stored.response)

    @delete("/v1/responses/{response_id:str}", status_code=200)
    async def remove(
        self, request: Request[Any, Any, Any], response_id: FromPath[str], history: History
    ) -> Response[bytes]:
        await history.delete(tenant_of(request), response_id)
        return json_response(DeletedResponse(response_id))

    @post("/v1/responses/{response_id:str}/cancel", status_code=200)
    async def cancel(
        self, request: Request[Any, Any, Any], response_id: FromPath[str], history: History
    ) -> Response[bytes]:
        """Only background responses can be cancelled (OpenAI's rule); this server runs
        none, so a stored response is a 400 and an unknown one a 404."""
        await history.find(tenant_of(request), response_id)
        raise HTTPError(
            400,
            "Only responses created with background=true can be cancelled.",
            "invalid_request_error",
            None,
        )

    @get("/v1/responses/{response_id:str}/input_items")
    async def input_items(
        self,
        request: Request[Any, Any, Any],
        response_id: FromPath[str],
        history: History,
        limit: FromQuery[int] = 20,
        order: FromQuery[str] = "desc",
        after: FromQuery[str | None] = None,
    ) -> Response[bytes]:
        """The conversation the response answered (previous responses' items included;
        ``instructions`` are not items), ``desc`` (newest first) by default."""
        if not 1 <= limit <= MAX_LIST_LIMIT:
            raise HTTPError(
                400, f"limit must be in [1, {MAX_LIST_LIMIT}]", "invalid_request_error", "limit"
            )
        if order not in ("asc", "desc"):
            raise HTTPError(400, "order must be asc or desc", "invalid_request_error", "order")
        items = (await history.find(tenant_of(request), response_id)).conversation
        items = items[::-1] if order == "desc" else list(items)
        if after is not None:
            ids = [item.get("id") for item in items]
            if after not in ids:
                raise HTTPError(400, f"no item with id '{after}'", "invalid_request_error", "after")
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        first, last = (page[0]["id"], page[-1]["id"]) if page else (None, None)
        return json_response(InputItemList(page, first, last, len(items) > limit))


def _json(data: Any) -> Response[bytes]:
    return Response(_encoder.encode(data), media_type="application/json")
