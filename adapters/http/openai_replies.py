"""The OpenAI faces' replies: collecting a request's outputs into a body, and the SSE chunks
of streamed completions and chats."""

import time
from collections.abc import AsyncIterator, Sequence

import msgspec
from litestar import Response

from adapters.http.errors import HTTPError
from adapters.http.openai_schemas import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    Completion,
    CompletionChoice,
    Usage,
)
from adapters.http.openai_tools import ToolStream
from adapters.http.streaming import merge_streams
from domain.request import StepOutput

_encoder = msgspec.json.Encoder()


FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "abort": "stop"}


async def collect(stream: AsyncIterator[StepOutput]) -> tuple[str, str | None, tuple[int, int]]:
    parts, reason, counts = [], None, (0, 0)
    async for out in stream:
        if out.error is not None:
            raise HTTPError(500, out.error, "server_error")
        parts.append(out.text_delta)
        if out.finished:
            reason = FINISH_REASONS.get(out.finish_reason or "", out.finish_reason)
            counts = (out.prompt_tokens, out.completion_tokens)
    return "".join(parts), reason, counts


def total_usage(outputs: Sequence[tuple[str, str | None, tuple[int, int]]]) -> Usage:
    prompt = sum(c[0] for _, _, c in outputs)
    completion = sum(c[1] for _, _, c in outputs)
    return Usage(prompt, completion, prompt + completion)


async def completion_chunks(
    reply_id: str, model: str, streams: list[AsyncIterator[StepOutput]], include_usage: bool
) -> AsyncIterator[bytes]:
    created, totals = int(time.time()), [0, 0]
    async for index, out in merge_streams(streams):
        if out.error is not None:
            yield error_chunk(out.error)
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


async def chat_chunks(
    reply_id: str,
    model: str,
    stream: AsyncIterator[StepOutput],
    include_usage: bool,
    tools: ToolStream | None = None,
) -> AsyncIterator[bytes]:
    """``tools``: turns the text into content and tool-call deltas (None: all content)."""
    created = int(time.time())

    def chunk(delta: ChatDelta, reason: str | None = None) -> bytes:
        return _encoder.encode(
            ChatCompletionChunk(reply_id, created, model, [ChatChunkChoice(0, delta, reason)])
        )

    yield chunk(ChatDelta(role="assistant", content=""))
    usage = None
    async for out in stream:
        if out.error is not None:
            yield error_chunk(out.error)
            return
        if tools is not None:
            for delta in tools.deltas(out.text_delta, out.finished):
                yield chunk(delta)
        elif out.text_delta:
            yield chunk(ChatDelta(content=out.text_delta))
        if out.finished:
            reason = FINISH_REASONS.get(out.finish_reason or "", out.finish_reason)
            yield chunk(ChatDelta(), tools.finish_reason(reason) if tools else reason)
            usage = Usage(
                out.prompt_tokens, out.completion_tokens, out.prompt_tokens + out.completion_tokens
            )
    if include_usage and usage is not None:
        yield _encoder.encode(ChatCompletionChunk(reply_id, created, model, [], usage))
    yield b"[DONE]"


def error_chunk(message: str) -> bytes:
    return _encoder.encode(
        {"error": {"message": message, "type": "server_error", "param": None, "code": None}}
    )


def json_response(payload: msgspec.Struct) -> Response[bytes]:
    return Response(_encoder.encode(payload), media_type="application/json")
