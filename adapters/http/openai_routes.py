"""OpenAI-compatible /v1/models, /v1/completions and /v1/chat/completions over an engine
client."""

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, TypeVar

import msgspec
from litestar import Request, Response, get, post
from litestar.handlers import HTTPRouteHandler
from litestar.response import ServerSentEvent

from adapters.http.access import check_model, inference_guard, request_tenant, reserve
from adapters.http.errors import OPENAI_ERRORS, HTTPError, check_content_type, error_param
from adapters.http.openai_schemas import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatMessageOut,
    Completion,
    CompletionChoice,
    CompletionRequest,
    ModelCard,
    ModelList,
    Usage,
)
from adapters.http.ownership import request_group, request_record
from adapters.http.streaming import merge_streams, sse, unless_disconnected
from application.access import Access
from application.engine_client import EngineClient, OwnedRequests
from application.request_ids import new_request_id
from application.request_record import RequestRecord
from domain.errors import InvalidParameterError
from domain.request import StepOutput
from domain.sampling import SamplingParams

T = TypeVar("T")
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "abort": "stop"}
COMPLETION_DEFAULT_MAX_TOKENS = 16  # the legacy endpoint's documented default
_encoder = msgspec.json.Encoder()
_completion_decoder = msgspec.json.Decoder(CompletionRequest)
_chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)
Prompt = str | list[int]
# A chat without max_tokens may run to the end of the context; under a tokens-per-minute
# limit it reserves this many output tokens (its real use is counted at the end).
UNSET_MAX_TOKENS_RESERVE = 256


def openai_routes(
    engine: EngineClient, model_name: str, access: Access | None = None
) -> list[HTTPRouteHandler]:
    """``access``: API keys and limits (None: an open server)."""
    created = int(time.time())
    guards = [inference_guard(access, OPENAI_ERRORS)] if access is not None else []

    @get("/v1/models", guards=guards)
    async def models(request: Request) -> Response[bytes]:
        tenant = request_tenant(request)
        cards = [] if tenant and not tenant.allows_model(model_name) else [model_name]
        return _json(
            ModelList(
                [
                    ModelCard(name, created, root=name, max_model_len=engine.max_seq_len)
                    for name in cards
                ]
            )
        )

    @post("/v1/completions", status_code=200, guards=guards)
    async def completions(request: Request) -> Response[bytes] | ServerSentEvent:
        body = decode_body(_completion_decoder, request, await request.body())
        record = _note(request, body.model, body.user, body.stream)
        check_served_model(body.model, model_name)
        check_model(request, model_name, OPENAI_ERRORS)
        _check_stream_options(body)
        _refuse(
            ("best_of", body.best_of not in (None, 1)),
            ("echo", bool(body.echo)),
            ("suffix", body.suffix is not None),
            # Completions' logprobs is a count (0 included: the chosen token's); unsupported.
            ("logprobs", body.logprobs is not None),
            *_common_unsupported(body),
        )
        max_tokens = COMPLETION_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        params = _sampling(body, max_tokens, "max_tokens")
        prompts = _prompts(body.prompt)
        texts = [p for p in prompts if isinstance(p, str)]
        _precheck(engine, params, [[t] for t in texts], len(prompts), "prompt")
        with record.timing("tokenize"):
            prepared = [await _prepare(engine, prompt, params, "prompt") for prompt in prompts]
        await _reserve(request, prepared, params)
        group = _prioritized(request, body.priority, None)
        streams = _admit(group, "cmpl", prepared, params, "prompt")
        reply_id = new_request_id("cmpl")
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            return sse(_completion_chunks(reply_id, model_name, streams, usage))
        outputs = await unless_disconnected(
            request, asyncio.gather(*(_collect(s) for s in streams))
        )
        choices = [CompletionChoice(i, text, reason) for i, (text, reason, _) in enumerate(outputs)]
        return _json(Completion(reply_id, int(time.time()), model_name, choices, _usage(outputs)))

    @post("/v1/chat/completions", status_code=200, guards=guards)
    async def chat_completions(request: Request) -> Response[bytes] | ServerSentEvent:
        body = decode_body(_chat_decoder, request, await request.body())
        record = _note(request, body.model, body.user, body.stream)
        check_served_model(body.model, model_name)
        check_model(request, model_name, OPENAI_ERRORS)
        _check_stream_options(body)
        _check_tools(body)
        _refuse(
            *_chat_unsupported(body),
            ("logprobs", body.logprobs not in (None, False)),
            *_common_unsupported(body),
        )
        messages = _messages(body.messages)
        # The limits that do not depend on max_tokens, before the template runs.
        checked = _sampling(body, 1, "max_tokens")
        _precheck(engine, checked, [[m["content"] for m in messages]], 1, "messages")
        with record.timing("render_chat"):
            prompt = await _render(engine, messages)
        if body.max_completion_tokens is not None:
            params = _sampling(body, body.max_completion_tokens, "max_completion_tokens")
        elif body.max_tokens is not None:
            params = _sampling(body, body.max_tokens, "max_tokens")
        else:  # as much as the context leaves (at least one token: a full context is a 400)
            params = _sampling(body, max(engine.max_seq_len - len(prompt), 1), "max_tokens")
        with record.timing("tokenize"):
            prepared = await _prepare(engine, prompt, params, "messages")
        explicit = body.max_completion_tokens is not None or body.max_tokens is not None
        await _reserve(request, [prepared], params, explicit)
        group = _prioritized(request, body.priority, body.metadata)
        [stream] = _admit(group, "chatcmpl", [prepared], params, "messages")
        reply_id = new_request_id("chatcmpl")
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            return sse(_chat_chunks(reply_id, model_name, stream, usage))
        text, reason, counts = await unless_disconnected(request, _collect(stream))
        choice = ChatChoice(0, ChatMessageOut(text), reason)
        return _json(
            ChatCompletion(
                reply_id, int(time.time()), model_name, [choice], _usage([(text, reason, counts)])
            )
        )

    return [models, completions, chat_completions]


async def _reserve(
    request: Request, prepared: list[list[int]], params: SamplingParams, explicit: bool = True
) -> None:
    """Reserve the tokens the request may use under its tenant's limits: prompts +
    max_tokens each; a chat without a max_tokens reserves its prompt + at most
    ``UNSET_MAX_TOKENS_RESERVE`` (its real use is counted when it ends)."""
    out = params.max_tokens if explicit else min(params.max_tokens, UNSET_MAX_TOKENS_RESERVE)
    tokens = sum(len(p) for p in prepared) + out * len(prepared)
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


def check_served_model(requested: str | None, served: str) -> None:
    """``model`` may be left out (vLLM's behaviour: the served model); any other is a 404."""
    if requested is not None and requested != served:
        raise HTTPError(
            404,
            f"The model `{requested}` does not exist (serving `{served}`)",
            "invalid_request_error",
            "model",
            "model_not_found",
        )


def _refuse(*checks: tuple[str, bool]) -> None:
    for field, is_set in checks:
        if is_set:
            raise HTTPError(
                400, f"`{field}` is not supported by this server", "invalid_request_error", field
            )


def _check_stream_options(body: CompletionRequest | ChatCompletionRequest) -> None:
    if body.stream_options is not None and not body.stream:
        raise HTTPError(
            400,
            "`stream_options` is only allowed when `stream` is true",
            "invalid_request_error",
            "stream_options",
        )


def _common_unsupported(body: CompletionRequest | ChatCompletionRequest) -> list[tuple[str, bool]]:
    return [
        ("n", body.n not in (None, 1)),
    ]


def _check_tools(body: ChatCompletionRequest) -> None:
    """OpenAI's answers: an empty ``tools`` (or ``functions``) list is too short, and the
    tool options need tools."""
    for name, tools in (("tools", body.tools), ("functions", body.functions)):
        if tools == []:
            raise HTTPError(400, f"[] is too short - '{name}'", "invalid_request_error", name)
    if body.tools is not None:
        return
    for name, option in (
        ("tool_choice", body.tool_choice),
        ("parallel_tool_calls", body.parallel_tool_calls),
    ):
        if option is not None:
            raise HTTPError(
                400,
                f"Invalid value for '{name}': '{name}' is only allowed when 'tools' are specified.",
                "invalid_request_error",
                name,
            )


def _chat_unsupported(body: ChatCompletionRequest) -> list[tuple[str, bool]]:
    text_format = body.response_format in (None, {"type": "text"})
    return [
        ("tools", bool(body.tools)),
        ("tool_choice", body.tool_choice not in (None, "none", "auto")),
        ("functions", bool(body.functions)),
        ("function_call", body.function_call is not None),
        ("response_format", not text_format),
        ("top_logprobs", body.top_logprobs is not None),
        ("audio", body.audio is not None),
        ("modalities", body.modalities not in (None, ["text"])),
        ("prediction", body.prediction is not None),
        ("web_search_options", body.web_search_options is not None),
    ]


def _sampling(
    body: CompletionRequest | ChatCompletionRequest, max_tokens: int, max_tokens_field: str
) -> SamplingParams:
    """``max_tokens_field``: the request field ``max_tokens`` came from (errors name it)."""
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if body.temperature is not None and not 0.0 <= body.temperature <= 2.0:
        raise HTTPError(
            400, "temperature must be in [0, 2]", "invalid_request_error", "temperature"
        )
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            min_p=body.min_p or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            ignore_eos=bool(body.ignore_eos),
            stop_token_ids=tuple(body.stop_token_ids or ()),
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            stop=stop,
            seed=body.seed,
            logit_bias=_logit_bias(body.logit_bias),
        )
    except InvalidParameterError as e:
        param = max_tokens_field if e.param == "max_tokens" else e.param
        message = str(e).replace(e.param, param, 1)
        raise HTTPError(400, message, "invalid_request_error", param) from e


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias`` (token id as a string -> a bias in [-100, 100]) as
    (id, bias) pairs; ids beyond the vocabulary are refused when the prompt is prepared."""
    pairs = []
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise HTTPError(
                400,
                f"logit_bias keys are token ids, got {key!r}",
                "invalid_request_error",
                "logit_bias",
            ) from None
        pairs.append((token, float(value)))
    return tuple(pairs)


def _prompts(prompt: str | list[Any]) -> list[Prompt]:
    """A string, a list of strings, token ids, or a list of token-id lists -> prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(_is_token_id(t) for t in prompt):
        return [list(prompt)]
    if prompt and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if prompt and all(isinstance(p, list) and all(_is_token_id(t) for t in p) for p in prompt):
        return [list(p) for p in prompt]
    raise HTTPError(
        400,
        "prompt must be a string, strings, token ids or lists of token ids",
        "invalid_request_error",
        "prompt",
    )


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


ROLES = ("system", "developer", "user", "assistant", "tool", "function")
NEEDS_CONTENT = ("system", "developer", "user", "tool", "function")  # assistant: tool calls


def _messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages, checked, with text content (parts joined)."""
    if not messages:
        raise HTTPError(400, "messages must not be empty", "invalid_request_error", "messages")
    for i, message in enumerate(messages):
        role = message.get("role")
        if role not in ROLES:
            raise HTTPError(
                400,
                f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}",
                "invalid_request_error",
                f"messages[{i}].role",
            )
        if role in NEEDS_CONTENT and message.get("content") is None:
            raise HTTPError(
                400,
                f"messages[{i}].content is required for role {role!r}",
                "invalid_request_error",
                f"messages[{i}].content",
            )
    return [{**m, "content": _text_content(m.get("content"))} for m in messages]


async def _render(engine: EngineClient, messages: list[dict[str, Any]]) -> list[int]:
    try:
        return await engine.render_chat(messages)
    except InvalidParameterError as e:
        raise OPENAI_ERRORS.error(e, "messages") from e


def _text_content(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" for p in content
    ):
        return "".join(str(p.get("text", "")) for p in content)
    raise HTTPError(
        400, "only text content parts are supported", "invalid_request_error", "messages"
    )


def _precheck(
    engine: EngineClient,
    params: SamplingParams,
    prompts: Sequence[Sequence[str]],
    count: int,
    field: str,
) -> None:
    """What is cheap to check before any tokenizing: the stop-string limits, each prompt's
    size (a prompt is a list of texts: a chat's messages), and room for ``count`` requests
    (a full engine answers 503 at once)."""
    try:
        engine.check_params(params)
        for texts in prompts:
            engine.check_prompt_size(texts, field)
        engine.check_room(count)
    except Exception as e:
        raise OPENAI_ERRORS.error(e, field) from e


async def _prepare(
    engine: EngineClient, prompt: Prompt, params: SamplingParams, field: str
) -> list[int]:
    """A prompt's token ids, validated, off the event loop (errors name ``field``)."""
    try:
        return await engine.prepare(prompt, params)
    except Exception as e:
        raise OPENAI_ERRORS.error(e, field) from e


def _admit(
    group: OwnedRequests,
    prefix: str,
    prompts: Sequence[list[int]],
    params: SamplingParams,
    field: str,
) -> list[AsyncIterator[StepOutput]]:
    """Queue every prepared prompt or none; the HTTP request's group owns them (its end,
    however it comes, aborts those still running)."""
    request_ids = [new_request_id(prefix) for _ in prompts]
    try:
        return group.admit(request_ids, prompts, params)
    except Exception as e:
        raise OPENAI_ERRORS.error(e, field) from e


async def _collect(stream: AsyncIterator[StepOutput]) -> tuple[str, str | None, tuple[int, int]]:
    parts, reason, counts = [], None, (0, 0)
    async for out in stream:
        if out.error is not None:
            raise HTTPError(500, out.error, "server_error")
        parts.append(out.text_delta)
        if out.finished:
            reason = FINISH_REASONS.get(out.finish_reason or "", out.finish_reason)
            counts = (out.prompt_tokens, out.completion_tokens)
    return "".join(parts), reason, counts


def _usage(outputs: Sequence[tuple[str, str | None, tuple[int, int]]]) -> Usage:
    prompt = sum(c[0] for _, _, c in outputs)
    completion = sum(c[1] for _, _, c in outputs)
    return Usage(prompt, completion, prompt + completion)


async def _completion_chunks(
    reply_id: str, model: str, streams: list[AsyncIterator[StepOutput]], include_usage: bool
) -> AsyncIterator[bytes]:
    created, totals = int(time.time()), [0, 0]
    async for index, out in merge_streams(streams):
        if out.error is not None:
            yield _error_chunk(out.error)
            return
        reason = (
            FINISH_REASONS.get(out.finish_reason or "", out.finish_reason) if out.finished else None
        )
        if out.finished:
            totals[0] += out.prompt_tokens
            totals[1] += out.completion_tokens
        yield _encoder.encode(
            Completion(reply_id, created, model, [CompletionChoice(index, out.text_delta, reason)])
        )
    if include_usage:
        yield _encoder.encode(
            Completion(reply_id, created, model, [], Usage(totals[0], totals[1], sum(totals)))
        )
    yield b"[DONE]"


async def _chat_chunks(
    reply_id: str, model: str, stream: AsyncIterator[StepOutput], include_usage: bool
) -> AsyncIterator[bytes]:
    created = int(time.time())

    def chunk(delta: ChatDelta, reason: str | None = None) -> bytes:
        return _encoder.encode(
            ChatCompletionChunk(reply_id, created, model, [ChatChunkChoice(0, delta, reason)])
        )

    yield chunk(ChatDelta(role="assistant", content=""))
    usage = None
    async for out in stream:
        if out.error is not None:
            yield _error_chunk(out.error)
            return
        if out.text_delta:
            yield chunk(ChatDelta(content=out.text_delta))
        if out.finished:
            yield chunk(ChatDelta(), FINISH_REASONS.get(out.finish_reason or "", out.finish_reason))
            usage = Usage(
                out.prompt_tokens, out.completion_tokens, out.prompt_tokens + out.completion_tokens
            )
    if include_usage and usage is not None:
        yield _encoder.encode(ChatCompletionChunk(reply_id, created, model, [], usage))
    yield b"[DONE]"


def _error_chunk(message: str) -> bytes:
    return _encoder.encode(
        {"error": {"message": message, "type": "server_error", "param": None, "code": None}}
    )


def _json(payload: msgspec.Struct) -> Response[bytes]:
    return Response(_encoder.encode(payload), media_type="application/json")
