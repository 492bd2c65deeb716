"""OpenAI-compatible /v1/completions and /v1/chat/completions over an engine client (the
model a request names: ``served_models.ModelNames``)."""

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, TypeVar

import msgspec
from litestar import Request, Response, post
from litestar.handlers import HTTPRouteHandler
from litestar.response import ServerSentEvent

from adapters.http.access import inference_guard, reserve
from adapters.http.errors import OPENAI_ERRORS, HTTPError, check_content_type, error_param
from adapters.http.openai_params import (
    Prompt,
    chat_top_logprobs,
    chat_unsupported,
    check_stream_options,
    choices,
    completion_logprobs,
    parse_messages,
    parse_prompts,
    refuse,
    sampling,
)
from adapters.http.openai_replies import (
    Echo,
    chat_choice,
    chat_chunks,
    collect,
    completion_choice,
    completion_chunks,
    json_response,
    total_usage,
)
from adapters.http.openai_schemas import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
)
from adapters.http.openai_structured import field_error, structured_output
from adapters.http.openai_tools import ChatTools, constrain, tool_request, tool_texts
from adapters.http.ownership import request_group, request_record
from adapters.http.served_models import ModelNames
from adapters.http.streaming import sse, unless_disconnected
from application.access import Access
from application.engine_client import EngineClient, OwnedRequests
from application.request_ids import new_request_id
from application.request_record import RequestRecord
from application.served_models import ServedModels
from application.tool_parsers import FORMATS
from domain.errors import InvalidParameterError
from domain.ports import STRUCTURED_PARAM
from domain.request import StepOutput
from domain.sampling import SamplingParams

T = TypeVar("T")
COMPLETION_DEFAULT_MAX_TOKENS = 16  # the legacy endpoint's documented default
_encoder = msgspec.json.Encoder()
_completion_decoder = msgspec.json.Decoder(CompletionRequest)
_chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)
# A chat without max_tokens may run to the end of the context; under a tokens-per-minute
# limit it reserves this many output tokens (its real use is counted at the end).
UNSET_MAX_TOKENS_RESERVE = 256


def openai_routes(
    engine: EngineClient,
    model_name: str,
    access: Access | None = None,
    names: ModelNames | None = None,
    tool_parser: str = "hermes",
) -> list[HTTPRouteHandler]:
    """``access``: API keys and limits (None: an open server); ``names``: the models served
    (default: ``model_name`` alone); ``tool_parser``: the format the model writes tool
    calls in (a name in ``application.tool_parsers.FORMATS``)."""
    names = names or ModelNames(ServedModels([model_name], model_name))
    chat_tools = ChatTools(FORMATS[tool_parser])
    guards = [inference_guard(access, OPENAI_ERRORS)] if access is not None else []

    @post("/v1/completions", status_code=200, guards=guards)
    async def completions(request: Request) -> Response[bytes] | ServerSentEvent:
        body = decode_body(_completion_decoder, request, await request.body())
        record = _note(request, body.model, body.user, body.stream)
        model = names.resolve(request, body.model, OPENAI_ERRORS)
        check_stream_options(body)
        n = choices(body)
        refuse(
            ("best_of", body.best_of not in (None, 1, n)),  # best_of == n: n choices, all shown
            ("suffix", body.suffix is not None),
        )
        logprobs = completion_logprobs(body)
        max_tokens = COMPLETION_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        params = sampling(
            body,
            max_tokens,
            "max_tokens",
            logprobs=logprobs,
            prompt_logprobs=logprobs if body.echo else None,
        )
        prompts = parse_prompts(body.prompt)
        texts = [p for p in prompts if isinstance(p, str)]
        _precheck(engine, params, [[t] for t in texts], len(prompts), "prompt", n)
        with record.timing("tokenize"):
            prepared = [
                await _prepare(engine, prompt, params, "prompt", _structured_field(body))
                for prompt in prompts
            ]
        echoes = []
        if body.echo:  # the prompt before each choice's text
            echoes = [await _echo(engine, p, i) for p, i in zip(prompts, prepared, strict=True)]
        await _reserve(request, prepared, params, n=n)
        group = _prioritized(request, body.priority, None)
        streams = _admit(group, "cmpl", prepared, params, "prompt", n, model.adapter_id)
        reply_id = new_request_id("cmpl")
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            return sse(
                completion_chunks(
                    reply_id,
                    model.id,
                    streams,
                    usage,
                    texts=engine.token_texts,
                    n=n,
                    logprobs=logprobs,
                    echoes=echoes,
                )
            )
        outputs = await unless_disconnected(request, asyncio.gather(*(collect(s) for s in streams)))
        replies = [
            completion_choice(
                i, out, engine.token_texts, logprobs, echoes[i // n] if echoes else None
            )
            for i, out in enumerate(outputs)
        ]
        return json_response(
            Completion(reply_id, int(time.time()), model.id, replies, total_usage(outputs, n))
        )

    @post("/v1/chat/completions", status_code=200, guards=guards)
    async def chat_completions(request: Request) -> Response[bytes] | ServerSentEvent:
        body = decode_body(_chat_decoder, request, await request.body())
        record = _note(request, body.model, body.user, body.stream)
        model = names.resolve(request, body.model, OPENAI_ERRORS)
        check_stream_options(body)
        tools = tool_request(body)
        refuse(*chat_unsupported(body))
        n, top_logprobs = choices(body), chat_top_logprobs(body)
        messages = parse_messages(body.messages)
        # The limits that do not depend on max_tokens, before the template runs.
        checked = sampling(body, max(1, body.min_tokens or 0), "max_tokens")
        texts = [*(m["content"] for m in messages), *tool_texts(tools)]
        _precheck(engine, checked, [texts], 1, "messages", n)
        with record.timing("render_chat"):
            messages, rendered_tools = await chat_tools.prepare(engine, messages, tools)
            prompt = await _render(engine, messages, rendered_tools)
        if body.max_completion_tokens is not None:
            max_tokens, field = body.max_completion_tokens, "max_completion_tokens"
        elif body.max_tokens is not None:
            max_tokens, field = body.max_tokens, "max_tokens"
        else:  # as much as the context leaves (at least one token: a full context is a 400)
            max_tokens, field = max(engine.max_seq_len - len(prompt), 1), "max_tokens"
        params = constrain(sampling(body, max_tokens, field, logprobs=top_logprobs), tools)
        with record.timing("tokenize"):
            constrained_by = "tools" if tools and tools.constrained else _structured_field(body)
            prepared = await _prepare(engine, prompt, params, "messages", constrained_by)
        explicit = body.max_completion_tokens is not None or body.max_tokens is not None
        await _reserve(request, [prepared], params, explicit, n)
        group = _prioritized(request, body.priority, body.metadata)
        streams = _admit(group, "chatcmpl", [prepared], params, "messages", n, model.adapter_id)
        reply_id = new_request_id("chatcmpl")
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            return sse(
                chat_chunks(
                    reply_id,
                    model.id,
                    streams,
                    usage,
                    texts=engine.token_texts,
                    top_logprobs=top_logprobs,
                    tools=[chat_tools.stream(tools) for _ in streams],
                )
            )
        outputs = await unless_disconnected(request, asyncio.gather(*(collect(s) for s in streams)))
        replies = [
            chat_choice(
                j,
                out,
                engine.token_texts,
                top_logprobs,
                chat_tools.reply(tools, out.text, out.finish_reason),
            )
            for j, out in enumerate(outputs)
        ]
        return json_response(
            ChatCompletion(reply_id, int(time.time()), model.id, replies, total_usage(outputs, n))
        )

    return [completions, chat_completions]


async def _reserve(
    request: Request,
    prepared: list[list[int]],
    params: SamplingParams,
    explicit: bool = True,
    n: int = 1,
) -> None:
    """Reserve the tokens the request may use under its tenant's limits: prompts +
    max_tokens for each of their ``n`` choices; a chat without a max_tokens reserves its
    prompt + at most ``UNSET_MAX_TOKENS_RESERVE`` per choice (its real use is counted when
    it ends)."""
    out = params.max_tokens if explicit else min(params.max_tokens, UNSET_MAX_TOKENS_RESERVE)
    tokens = sum(len(p) for p in prepared) + out * len(prepared) * n
    await reserve(request, tokens, OPENAI_ERRORS)


def _prioritized(
    request: Request, priority: int | None, metadata: dict[str, str] | None
) -> OwnedRequests:
    """The request's group, its requests at ``priority`` (vLLM's field) or
    ``metadata.priority``: as in vLLM, a lower value runs earlier (default 0), and may
    preempt a running request of a higher value when the batch is full."""
    group = request_group(request)
    if priority is None and metadata and "priority" in metadata:
        try:
            priority = int(metadata["priority"])
        except ValueError:
            raise HTTPError(
                400, "metadata.priority must be an integer", "invalid_request_error", "metadata"
            ) from None
    if priority is not None:
        if not -(2**31) <= priority < 2**31:
            raise HTTPError(
                400, "priority must be a 32-bit integer", "invalid_request_error", "priority"
            )
        # The scheduler runs a higher context priority first.
        group.context = dataclasses.replace(group.context, priority=-priority)
    return group


def _note(
    request: Request, model: str | None, user: str | None, stream: bool | None
) -> RequestRecord:
    """Note what the body says in the request's record (logs, metrics, traces)."""
    record = request_record(request)
    record.model, record.user, record.stream = model, user, bool(stream)
    return record


def decode_body(decoder: msgspec.json.Decoder[T], request: Request, raw: bytes) -> T:
    check_content_type(request)
    try:
        return decoder.decode(raw)
    except msgspec.ValidationError as e:
        message = str(e)
        if "unknown field" in message:
            field = message.split("`")[1] if "`" in message else None
            raise HTTPError(
                400,
                f"Unrecognized request argument supplied: {field}",
                "invalid_request_error",
                field,
            ) from e
        raise HTTPError(400, message, "invalid_request_error", error_param(message)) from e
    except msgspec.DecodeError as e:
        raise HTTPError(400, f"malformed JSON: {e}", "invalid_request_error") from e
    except UnicodeDecodeError as e:  # a string's bytes are not UTF-8
        raise HTTPError(400, "malformed JSON: invalid UTF-8", "invalid_request_error") from e
    except RecursionError as e:  # msgspec's guard against deeply nested input
        raise HTTPError(400, "malformed JSON: nested too deeply", "invalid_request_error") from e


async def _echo(engine: EngineClient, prompt: Prompt, prompt_ids: list[int]) -> Echo:
    """What ``echo`` puts first: the prompt's text (token ids: decoded) and its ids."""
    text = prompt if isinstance(prompt, str) else await engine.detokenize(prompt)
    return Echo(text, prompt_ids)


async def _render(
    engine: EngineClient,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    try:
        return await engine.render_chat(messages, tools)
    except InvalidParameterError as e:
        raise OPENAI_ERRORS.error(e, "messages") from e


def _precheck(
    engine: EngineClient,
    params: SamplingParams,
    prompts: Sequence[Sequence[str]],
    count: int,
    field: str,
    n: int = 1,
) -> None:
    """What is cheap to check before any tokenizing: the stop-string limits, each prompt's
    size (a prompt is a list of texts: a chat's messages), and room for ``count`` prompts
    of ``n`` choices (a full engine answers 503 at once)."""
    try:
        engine.check_params(params)
        for texts in prompts:
            engine.check_prompt_size(texts, field)
        engine.check_room(count, n)
    except Exception as e:
        raise OPENAI_ERRORS.error(e, field) from e


async def _prepare(
    engine: EngineClient,
    prompt: Prompt,
    params: SamplingParams,
    field: str,
    structured_field: str = STRUCTURED_PARAM,
) -> list[int]:
    """A prompt's token ids, validated, off the event loop (errors name ``field``, or
    ``structured_field`` for the output constraint)."""
    try:
        return await engine.prepare(prompt, params)
    except InvalidParameterError as e:
        if e.param == STRUCTURED_PARAM:
            raise field_error(e, structured_field) from e
        raise OPENAI_ERRORS.error(e, field) from e
    except Exception as e:
        raise OPENAI_ERRORS.error(e, field) from e


def _structured_field(body: CompletionRequest | ChatCompletionRequest) -> str:
    """The field the body's output constraint came from."""
    found = structured_output(body)
    return found[1] if found else STRUCTURED_PARAM


def _admit(
    group: OwnedRequests,
    prefix: str,
    prompts: Sequence[list[int]],
    params: SamplingParams,
    field: str,
    n: int = 1,
    adapter_id: str | None = None,
) -> list[AsyncIterator[StepOutput]]:
    """Queue ``n`` choices of every prepared prompt, or nothing, on LoRA adapter
    ``adapter_id`` (None: the base model); the HTTP request's group owns them (its end,
    however it comes, aborts those still running)."""
    request_ids = [new_request_id(prefix) for _ in range(len(prompts) * n)]
    try:
        return group.admit(request_ids, prompts, params, n, adapter_id=adapter_id)
    except Exception as e:
        raise OPENAI_ERRORS.error(e, field) from e
