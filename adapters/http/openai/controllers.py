"""``/v1/completions`` and ``/v1/chat/completions``: the body parsed into a job
(``params.py``), one call to the completion service, the streams as SSE chunks or one
JSON body (``replies.py``). Errors raise as they come; the router maps them."""

from collections.abc import AsyncIterator
from typing import Any

import msgspec
from litestar import Controller, Request, Response, post
from litestar.response import ServerSentEvent

from adapters.http.errors import PROMPT_FIELD
from adapters.http.openai.deps import Completions, Inputs, Names, ToolCalls
from adapters.http.openai.params import chat_job, completion_job, decode_body
from adapters.http.openai.replies import ChatReply, CompletionReply, Echo, collect_all
from adapters.http.openai.schemas import ChatCompletionRequest, CompletionRequest
from adapters.http.request_state import RequestCaller
from adapters.http.served_models import ModelNames
from adapters.http.streaming import sse
from application.engine.request_ids import new_request_id
from application.serving.completions import Caller
from application.serving.served_models import ModelEntry
from domain.request import StepOutput

_completion_decoder = msgspec.json.Decoder(CompletionRequest)
_chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)
Reply = Response[bytes] | ServerSentEvent


class CompletionRoutes(Controller):
    @post("/v1/completions", status_code=200)
    async def completions(
        self,
        request: Request[Any, Any, Any],
        caller: RequestCaller,
        completions: Completions,
        inputs: Inputs,
        names: Names,
    ) -> Reply:
        body = decode_body(_completion_decoder, request, await request.body())
        model = _model(request, caller, names, body)
        job = completion_job(body, model.adapter_id)
        started = await completions.complete(job, caller)
        echoes = []
        if body.echo:  # the prompt before each choice's text (token ids, truncated: decoded)
            for prompt, ids in zip(job.prompts, started.prompts, strict=True):
                if not isinstance(prompt, str) or job.truncate_prompt_tokens is not None:
                    prompt = await inputs.detokenize(ids)
                echoes.append(Echo(prompt, ids))
        reply = CompletionReply(
            new_request_id("cmpl"),
            model.id,
            inputs.token_texts,
            job.n,
            job.params.logprobs,
            echoes,
            prompts=started.prompts,
            token_ids=bool(body.return_token_ids),
            prompt_logprobs=None if body.stream else body.prompt_logprobs,
            continuous_usage=_continuous_usage(body),
        )
        return await _answer(request, body, started.streams, reply)

    @post("/v1/chat/completions", status_code=200, opt={PROMPT_FIELD: "messages"})
    async def chat_completions(
        self,
        request: Request[Any, Any, Any],
        caller: RequestCaller,
        completions: Completions,
        inputs: Inputs,
        names: Names,
        tool_calls: ToolCalls,
    ) -> Reply:
        body = decode_body(_chat_decoder, request, await request.body())
        model = _model(request, caller, names, body)
        job = chat_job(body, model.adapter_id)
        started = await completions.chat(job, caller)
        reply = ChatReply(
            new_request_id("chatcmpl"),
            model.id,
            inputs.token_texts,
            job.params.logprobs,
            tool_calls,
            job.tools,
            started.reasoning,
            prompt=started.prompts[0],
            token_ids=bool(body.return_token_ids),
            prompt_logprobs=None if body.stream else body.prompt_logprobs,
            continuous_usage=_continuous_usage(body),
        )
        return await _answer(request, body, started.streams, reply)


def _continuous_usage(body: CompletionRequest | ChatCompletionRequest) -> bool:
    """vLLM's ``continuous_usage_stats``: with ``include_usage`` only, as in vLLM."""
    options = body.stream_options
    return bool(options and options.include_usage and options.continuous_usage_stats)


def _model(
    request: Request[Any, Any, Any],
    caller: Caller,
    names: ModelNames,
    body: CompletionRequest | ChatCompletionRequest,
) -> ModelEntry:
    """The model the body names, once what the body says is noted in the request's record
    (logs, metrics, traces)."""
    record = caller.record
    record.model, record.user, record.stream = body.model, body.user, bool(body.stream)
    return names.resolve(request, body.model)


async def _answer(
    request: Request[Any, Any, Any],
    body: CompletionRequest | ChatCompletionRequest,
    streams: list[AsyncIterator[StepOutput]],
    reply: CompletionReply | ChatReply,
) -> Reply:
    """SSE chunks (a usage chunk last with ``include_usage``), or the whole body once every
    choice finished."""
    if body.stream:
        usage = bool(body.stream_options and body.stream_options.include_usage)
        return sse(reply.chunks(streams, usage))
    return reply.body(await collect_all(request, streams))
