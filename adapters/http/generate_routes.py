"""The native ``POST /v1/generate`` token stream over an engine client.

Status codes: 400 malformed (bad JSON, wrong types, empty prompt), 422 invalid values
(wrong model, out-of-range parameters, unknown fields, prompt too long), 503 queue full.
``model`` is any name ``/v1/models`` lists (a LoRA adapter's runs on it).
"""

from collections.abc import AsyncIterator

import msgspec
from litestar import Request, post
from litestar.handlers import HTTPRouteHandler
from litestar.response import ServerSentEvent
from litestar.response.sse import ServerSentEventMessage

from adapters.http.access import inference_guard, reserve
from adapters.http.errors import GENERATE_ERRORS, HTTPError, check_content_type, error_param
from adapters.http.ownership import request_group, request_record
from adapters.http.schemas import DoneEvent, ErrorEvent, GenerateRequest, GenerateUsage, TokenEvent
from adapters.http.served_models import ModelNames
from adapters.http.streaming import sse_event
from application.access import Access
from application.engine_client import EngineClient
from application.request_ids import new_request_id
from application.served_models import ServedModels
from domain.errors import InvalidParameterError
from domain.request import StepOutput
from domain.sampling import SamplingParams

_decoder = msgspec.json.Decoder(GenerateRequest)


def generate_routes(
    engine: EngineClient,
    model_name: str,
    access: Access | None = None,
    names: ModelNames | None = None,
) -> list[HTTPRouteHandler]:
    """``access``: API keys and limits (None: an open server); ``names``: the models
    served (default: ``model_name`` alone)."""
    names = names or ModelNames(ServedModels([model_name], model_name))
    guards = [inference_guard(access, GENERATE_ERRORS)] if access is not None else []

    @post("/v1/generate", status_code=200, guards=guards)
    async def generate(request: Request) -> ServerSentEvent:
        check_content_type(request)
        body = _parse(await request.body())
        record = request_record(request)
        record.model, record.stream = body.model, True
        model = names.resolve(request, body.model, GENERATE_ERRORS)
        params = _sampling_params(body)
        try:
            if isinstance(body.prompt, str):  # cheap checks first: a full engine is a 503 now
                engine.check_prompt_size([body.prompt])
            engine.check_params(params)
            engine.check_room(1)
            with record.timing("tokenize"):
                prompt_ids = await engine.prepare(body.prompt, params)
            await reserve(request, len(prompt_ids) + params.max_tokens, GENERATE_ERRORS)
            [outputs] = request_group(request).admit(
                [new_request_id("gen")], [prompt_ids], params, adapter_id=model.adapter_id
            )
        except Exception as e:
            raise GENERATE_ERRORS.error(e) from e
        return ServerSentEvent(_events(outputs))

    return [generate]


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
        raise GENERATE_ERRORS.error(e) from e


async def _events(outputs: AsyncIterator[StepOutput]) -> AsyncIterator[ServerSentEventMessage]:
    async for out in outputs:
        if out.error is not None:
            yield sse_event("error", ErrorEvent(out.error))
            return
        if out.text_delta or not out.finished:
            assert out.token_id is not None
            yield sse_event("token", TokenEvent(out.text_delta, out.token_id))
        if out.finished:
            usage = GenerateUsage(
                out.prompt_tokens, out.completion_tokens, out.prompt_tokens + out.completion_tokens
            )
            yield sse_event("done", DoneEvent(out.finish_reason, usage))
            return
