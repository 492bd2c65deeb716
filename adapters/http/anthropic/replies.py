"""The Messages face's replies: a message whole, or its stream of Anthropic's events.

A choice is split once, by :mod:`application.serving.chat_output`, into thinking, answer text and
tool calls; here they become content blocks: a ``thinking`` block first when the model
thought (its ``signature`` empty: there is nothing to verify), then ``text``, then one
``tool_use`` block per call (its ``input`` the arguments object). Whitespace-only text
makes no block (Anthropic refuses such blocks sent back).

``stop_reason``: ``tool_use`` when it called tools, ``max_tokens`` when cut, and
``stop_sequence`` when a stop sequence ended it (``stop_sequence``: which one), else
``end_turn``.

The stream: ``message_start`` (the message with no content, the prompt's tokens), each
block's ``content_block_start``, deltas (``thinking_delta`` then a ``signature_delta``,
``text_delta``, ``input_json_delta``) and ``content_block_stop``, then ``message_delta``
(stop reason, output tokens) and ``message_stop``. A failure mid-stream is an ``error``
event; the heartbeat's keep-alive here is ``event: ping`` (``PING``).
"""

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec
from litestar import Request, Response
from litestar.response import ServerSentEvent
from litestar.response.sse import ServerSentEventMessage

from adapters.http.anthropic.errors import error_event
from adapters.http.anthropic.schemas import (
    BlockDelta,
    BlockStart,
    BlockStop,
    ContentBlock,
    Event,
    InputJsonDelta,
    Message,
    MessageDelta,
    MessageEnd,
    MessageStart,
    MessageStop,
    SignatureDelta,
    TextBlock,
    TextDelta,
    ThinkingBlock,
    ThinkingDelta,
    ToolUseBlock,
    Usage,
)
from adapters.http.streaming import unless_disconnected
from application.serving.chat_output import (
    ChoiceEnd,
    ChoiceError,
    ChoiceEvents,
    Text,
    Thinking,
    ToolCallDelta,
    collect_choice,
    tool_parser,
)
from application.serving.chat_prompts import ToolRequest
from application.serving.reasoning import Reasoning
from application.serving.tool_parsers import ToolFormat
from domain.request import StepOutput

_encoder = msgspec.json.Encoder()
# Anthropic's keep-alive event, sent by the heartbeat into a silent stream.
PING = b'event: ping\ndata: {"type": "ping"}\n\n'


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def new_tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def stop_reason(end: ChoiceEnd, last: StepOutput | None) -> tuple[str, str | None]:
    """The message's ``stop_reason`` and ``stop_sequence``."""
    if end.tool_calls:
        return "tool_use", None
    if end.reason == "length":
        return "max_tokens", None
    matched = last.stop_reason if last is not None else None
    if end.reason == "stop" and isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None  # EOS, or a stop token of the model's


@dataclass(frozen=True)
class MessageReply:
    """The reply to one message request: ``tools``' calls read in the server's tool
    format ``fmt``; ``reasoning``: how the thinking splits from the answer (None: no
    split)."""

    reply_id: str
    model: str
    fmt: ToolFormat
    tools: ToolRequest | None = None
    reasoning: Reasoning | None = None

    @property
    def _parallel(self) -> bool:
        return self.tools is None or self.tools.parallel

    def _events(self) -> ChoiceEvents:
        return ChoiceEvents(self.reasoning, tool_parser(self.fmt, self.tools), self._parallel)

    async def body(
        self, request: Request[Any, Any, Any], stream: AsyncIterator[StepOutput]
    ) -> Response[bytes]:
        """The whole message, once the choice finished."""
        last: list[StepOutput] = []
        parser = tool_parser(self.fmt, self.tools)
        result = await unless_disconnected(
            request, collect_choice(_ends(stream, last), self.reasoning, parser, self._parallel)
        )
        content: list[ContentBlock] = []
        if result.reasoning:
            content.append(ThinkingBlock(result.reasoning))
        if result.content and result.content.strip():
            content.append(TextBlock(result.content))
        for call in result.calls:
            content.append(ToolUseBlock(new_tool_use_id(), call.name, json.loads(call.arguments)))
        end = result.end
        reason, sequence = stop_reason(end, last[-1] if last else None)
        usage = end_usage(end)
        message = Message(self.reply_id, self.model, content, reason, sequence, usage)
        return Response(_encoder.encode(message), media_type="application/json")

    def stream(self, stream: AsyncIterator[StepOutput], prompt_tokens: int) -> ServerSentEvent:
        """The message as Anthropic's event stream."""

        async def messages() -> AsyncIterator[ServerSentEventMessage]:
            async for event in self._stream(stream, prompt_tokens):
                yield ServerSentEventMessage(
                    data=_encoder.encode(event).decode(), event=_event_name(event)
                )

        return ServerSentEvent(messages())

    async def _stream(
        self, stream: AsyncIterator[StepOutput], prompt_tokens: int
    ) -> AsyncIterator[Event]:
        start = Message(self.reply_id, self.model, [], None, None, Usage(prompt_tokens, 0))
        yield MessageStart(start)
        choice, blocks = self._events(), _Blocks()
        end: ChoiceEnd | None = None
        last: StepOutput | None = None
        async for out in stream:
            try:
                events = choice.feed(out)
            except ChoiceError as e:
                yield error_event(str(e))
                return
            for event in events:
                if isinstance(event, Thinking):
                    for item in blocks.thinking(event.text):
                        yield item
                elif isinstance(event, Text):
                    for item in blocks.text(event.text):
                        yield item
                elif isinstance(event, ToolCallDelta):
                    for item in blocks.call(event):
                        yield item
                else:
                    end, last = event, out
        if end is None:  # aborted without an end (the client left)
            yield error_event("the request ended before the message was complete")
            return
        for item in blocks.close():
            yield item
        reason, sequence = stop_reason(end, last)
        usage = end_usage(end)
        yield MessageDelta(MessageEnd(reason, sequence), usage)
        yield MessageStop()


def end_usage(end: ChoiceEnd) -> Usage:
    """Anthropic's usage: ``input_tokens`` are those not read from the cache."""
    cached = end.cached_tokens
    return Usage(end.prompt_tokens - cached, end.completion_tokens, cache_read_input_tokens=cached)


async def _ends(
    stream: AsyncIterator[StepOutput], last: list[StepOutput]
) -> AsyncIterator[StepOutput]:
    """``stream``, its finishing output noted in ``last`` (its ``stop_reason``)."""
    try:
        async for out in stream:
            if out.finished:
                last.append(out)
            yield out
    finally:
        await stream.aclose()  # type: ignore[attr-defined]


def _event_name(event: Event) -> str:
    return str(type(event).__struct_config__.tag)


class _Blocks:
    """A streamed message's content blocks: which one is open, each call's block."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # the open block's type
        self.calls: dict[int, int] = {}  # a call's index -> its block's
        self.held = ""  # whitespace that may lead a text block

    def thinking(self, text: str) -> list[Event]:
        out = [] if self.open == "thinking" else self._start(ThinkingBlock(""), "thinking")
        return [*out, BlockDelta(self.index, ThinkingDelta(text))]

    def text(self, text: str) -> list[Event]:
        out: list[Event] = []
        if self.open != "text":
            if not (self.held + text).strip():
                self.held += text
                return []
            text, self.held = self.held + text, ""
            out = self._start(TextBlock(""), "text")
        return [*out, BlockDelta(self.index, TextDelta(text))]

    def call(self, delta: ToolCallDelta) -> list[Event]:
        out: list[Event] = []
        if delta.name is not None:
            out = self._start(ToolUseBlock(new_tool_use_id(), delta.name, {}), "tool_use")
            self.calls[delta.index] = self.index
        if delta.arguments:
            index = self.calls.get(delta.index, self.index)
            out.append(BlockDelta(index, InputJsonDelta(delta.arguments)))
        return out

    def close(self) -> list[Event]:
        if self.open is None:
            return []
        out: list[Event] = []
        if self.open == "thinking":
            out.append(BlockDelta(self.index, SignatureDelta()))
        self.open = None
        return [*out, BlockStop(self.index)]

    def _start(self, block: ContentBlock, kind: str) -> list[Event]:
        out = self.close()
        self.held = ""
        self.index += 1
        self.open = kind
        return [*out, BlockStart(self.index, block)]


def json_response(payload: msgspec.Struct) -> Response[bytes]:
    return Response(_encoder.encode(payload), media_type="application/json")


__all__ = [
    "PING",
    "MessageReply",
    "json_response",
    "new_message_id",
    "new_tool_use_id",
    "stop_reason",
]
