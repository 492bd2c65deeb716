"""``/v1/completions`` and ``/v1/chat/completions``: the body parsed into a job
(``params.py``), one call to the completion service, the streams as SSE chunks or one
JSON body (``replies.py``). Errors raise as they come; the router maps them."""

import time
from typing import Any

import msgspec
from litestar import Controller, Request, Response, post
from litestar.response import ServerSentEvent

from adapters.http.errors import PROMPT_FIELD
from adapters.http.openai.deps import Completions, Inputs, Names, ToolCalls
from adapters.http.openai.params import chat_job, completion_job, decode_body
from adapters.http.openai.replies import (
    Echo,
    chat_choice,
    chat_chunks,
    collect_all,
    completion_choice,
    completion_chunks,
    json_response,
    total_usage,
)
from adapters.http.openai.schemas import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
)
from adapters.http.request_state import RequestCaller
from adapters.http.served_models import ModelNames
from adapters.http.streaming import sse
from application.completions import Caller
from application.request_ids import new_request_id
from application.served_models import ModelEntry

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
        if body.echo:  # the prompt before each choice's text (token ids: decoded)
            for prompt, ids in zip(job.prompts, started.prompts, strict=True):
                text = prompt if isinstance(prompt, str) else await inputs.detokenize(prompt)
                echoes.append(Echo(text, ids))
        reply_id, n, logprobs = new_request_id("cmpl"), job.n, job.params.logprobs
        if body.stream:
            return sse(
                completion_chunks(
                    reply_id,
                    model.id,
                    started.streams,
                    _usage(body),
                    texts=inputs.token_texts,
                    n=n,
                    logprobs=logprobs,
                    echoes=echoes,
                )
            )
        outputs = await collect_all(request, started.streams)
        replies = [
            completion_choice(
                i, out, inputs.token_texts, logprobs, echoes[i // n] if echoes else None
            )
            for i, out in enumerate(outputs)
        ]
        return json_response(
            Completion(reply_id, int(time.time()), model.id, replies, total_usage(outputs, n))
        )

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
        reply_id, top_logprobs = new_request_id("chatcmpl"), job.params.logprobs
        if body.stream:
            return sse(
                chat_chunks(
                    reply_id,
                    model.id,
                    started.streams,
                    _usage(body),
                    texts=inputs.token_texts,
                    top_logprobs=top_logprobs,
                    tools=[tool_calls.stream(job.tools) for _ in started.streams],
                )
            )
        outputs = await collect_all(request, started.streams)
        replies = [
            chat_choice(
                j,
                out,
                inputs.token_texts,
                top_logprobs,
                tool_calls.reply(job.tools, out.text, out.finish_reason),
            )
            for j, out in enumerate(outputs)
        ]
        return json_response(
            ChatCompletion(
                reply_id, int(time.time()), model.id, replies, total_usage(outputs, job.n)
            )
        )


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


def _usage(body: CompletionRequest | ChatCompletionRequest) -> bool:
    """A stream ends with a usage chunk."""
    return bool(body.stream_options and body.stream_options.include_usage)
