"""The native ``POST /v1/generate`` token stream over an engine client.

Status codes: 400 malformed (bad JSON, wrong types, empty prompt), 422 invalid values
(wrong model, out-of-range parameters, unknown fields, prompt too long), 503 queue full.
``model`` is any name ``/v1/models`` lists (a LoRA adapter's runs on it). The request runs
through the completion service, as a one-prompt completion; its errors map through
``GENERATE_ERRORS``, the router's exception handlers.
"""

from collections.abc import AsyncIterator
from typing import Any

import msgspec
from litestar import Controller, Request, Router, post
from litestar.di import NamedDependency
from litestar.response import ServerSentEvent
from litestar.response.sse import ServerSentEventMessage

from adapters.http.access import guards
from adapters.http.errors import (
    GENERATE_ERRORS,
    HTTPError,
    check_content_type,
    decode_json,
    error_param,
    exception_handlers,
)
from adapters.http.request_state import RequestCaller, provide
from adapters.http.schemas import DoneEvent, ErrorEvent, GenerateRequest, GenerateUsage, TokenEvent
from adapters.http.served_models import ModelNames
from adapters.http.streaming import sse_event
from application.access.access import Access
from application.serving.completions import CompletionService, PromptJob
from domain.request import StepOutput
from domain.sampling import SamplingParams

_decoder = msgspec.json.Decoder(GenerateRequest)


class GenerateRoutes(Controller):
    @post("/v1/generate", status_code=200)
    async def generate(
        self,
        request: Request[Any, Any, Any],
        caller: RequestCaller,
        completions: NamedDependency[CompletionService],
        names: NamedDependency[ModelNames],
    ) -> ServerSentEvent:
        check_content_type(request)
        body = decode_json(_decoder, await request.body(), _invalid)
        caller.record.model, caller.record.stream = body.model, True
        model = names.resolve(request, body.model)
        job = PromptJob(
            params=_sampling_params(body),
            prompts=[body.prompt],
            adapter_id=model.adapter_id,
            id_prefix="gen",
        )
        [outputs] = (await completions.complete(job, caller)).streams
        return ServerSentEvent(_events(outputs))


def generate_router(
    completions: CompletionService, names: ModelNames, access: Access | None = None
) -> Router:
    """``access``: API keys and limits (None: an open server)."""
    return Router(
        path="/",
        route_handlers=[GenerateRoutes],
        guards=guards(access),
        dependencies=provide({"completions": completions, "names": names}),
        exception_handlers=exception_handlers(GENERATE_ERRORS),
    )


def _invalid(message: str) -> HTTPError:
    status = 422 if "unknown field" in message else 400
    return HTTPError(status, message, "invalid_request_error", error_param(message))


def _sampling_params(body: GenerateRequest) -> SamplingParams:
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    return SamplingParams(
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k or 0,
        repetition_penalty=body.repetition_penalty,
        stop=stop,
        seed=body.seed,
    )


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
