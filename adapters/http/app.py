"""``create_app(engine, model_name) -> Litestar``: the HTTP face of an AsyncEngine.

The adapter knows no container: entrypoints build the engine and pass it in. Status codes
follow seed 000 §7: 400 malformed (bad JSON, wrong types, empty prompt), 422 invalid
values (wrong model, out-of-range parameters, unknown fields, prompt too long), 503 queue
full.
"""

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgspec
from litestar import Litestar, Request, Response, get, post
from litestar.exceptions import HTTPException
from litestar.response import ServerSentEvent
from litestar.response.sse import ServerSentEventMessage

from adapters.http.errors import (
    HTTPError,
    check_content_type,
    error_param,
    error_response,
    framework_error_response,
    generate_error,
)
from adapters.http.openai_routes import openai_routes
from adapters.http.ownership import owning_middleware, request_group
from adapters.http.schemas import DoneEvent, ErrorEvent, GenerateRequest, GenerateUsage, TokenEvent
from adapters.http.tinker_routes import tinker_router
from application.async_engine import AsyncEngine
from application.request_ids import new_request_id
from application.tinker.service import TinkerService
from domain.errors import InvalidParameterError
from domain.request import StepOutput
from domain.sampling import SamplingParams

_decoder = msgspec.json.Decoder(GenerateRequest)
_encoder = msgspec.json.Encoder()


def create_app(
    engine: AsyncEngine,
    model_name: str,
    *,
    tinker: TinkerService | None = None,
    tinker_api_keys: frozenset[str] | None = None,
) -> Litestar:
    """``tinker``: also serve the Tinker fine-tuning API under ``/api/v1``."""

    @asynccontextmanager
    async def lifespan(_: Litestar) -> AsyncIterator[None]:
        engine.start()
        if tinker is not None:
            tinker.start()
        try:
            yield
        finally:
            if tinker is not None:
                await tinker.stop()
            await engine.stop()

    @post("/v1/generate", status_code=200)
    async def generate(request: Request) -> ServerSentEvent:
        check_content_type(request)
        body = _parse(await request.body())
        if body.model != model_name:
            raise HTTPError(
                422,
                f"model {body.model!r} is not served (serving {model_name!r})",
                "invalid_request_error",
                "model",
            )
        params = _sampling_params(body)
        try:
            if isinstance(body.prompt, str):  # cheap checks first: a full engine is a 503 now
                engine.engine.check_prompt_size([body.prompt])
            engine.engine.check_params(params)
            engine.engine.check_room(1)
            prompt_ids = await engine.prepare(body.prompt, params)
            [outputs] = request_group(request).admit([new_request_id("gen")], [prompt_ids], params)
        except Exception as e:
            raise generate_error(e) from e
        return ServerSentEvent(_events(outputs))

    @get("/health")
    async def health() -> Response[bytes]:
        status = 200 if engine.healthy else 503
        return Response(
            b'{"status":"ok"}' if status == 200 else b'{"status":"engine loop down"}',
            status_code=status,
            media_type="application/json",
        )

    routers = [] if tinker is None else [tinker_router(tinker, api_keys=tinker_api_keys)]
    return Litestar(
        route_handlers=[generate, health, *openai_routes(engine, model_name), *routers],
        lifespan=[lifespan],
        middleware=[owning_middleware(engine)],
        exception_handlers={
            HTTPError: error_response,
            HTTPException: framework_error_response,
            Exception: framework_error_response,
        },
    )


def _parse(raw: bytes) -> GenerateRequest:
    try:
        return _decoder.decode(raw)
    except msgspec.ValidationError as e:
        status = 422 if "unknown field" in str(e) else 400
        raise HTTPError(status, str(e), "invalid_request_error", error_param(str(e))) from e
    except msgspec.DecodeError as e:
        raise HTTPError(400, f"malformed JSON: {e}", "invalid_request_error") from e
    except UnicodeDecodeError as e:  # a string's bytes are not UTF-8
        raise HTTPError(400, "malformed JSON: invalid UTF-8", "invalid_request_error") from e
    except RecursionError as e:  # msgspec's guard against deeply nested input
        raise HTTPError(400, "malformed JSON: nested too deeply", "invalid_request_error") from e


def _sampling_params(body: GenerateRequest) -> SamplingParams:
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    try:
        return SamplingParams(
            max_tokens=body.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k or 0,
            repetition_penalty=body.repetition_penalty,
            stop=stop,
            seed=body.seed,
        )
    except InvalidParameterError as e:
        raise HTTPError(422, str(e), "invalid_request_error", e.param) from e


async def _events(outputs: AsyncIterator[StepOutput]) -> AsyncIterator[ServerSentEventMessage]:
    async for out in outputs:
        if out.error is not None:
            yield _event("error", ErrorEvent(out.error))
            return
        if out.text_delta or not out.finished:
            assert out.token_id is not None
            yield _event("token", TokenEvent(out.text_delta, out.token_id))
        if out.finished:
            usage = GenerateUsage(
                out.prompt_tokens, out.completion_tokens, out.prompt_tokens + out.completion_tokens
            )
            yield _event("done", DoneEvent(out.finish_reason, usage))
            return


def _event(kind: str, payload: msgspec.Struct) -> ServerSentEventMessage:
    return ServerSentEventMessage(data=_encoder.encode(payload).decode(), event=kind)
