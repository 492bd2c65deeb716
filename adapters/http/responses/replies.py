"""The Responses API's replies: the response object, whole or as its stream of events.

A chat choice is split once (``application/chat_output``: thinking, answer text, tool
calls, end); here its parts become output items, in order: a ``reasoning`` item when the
model thought, a ``message`` item with the answer text, a ``function_call`` item per call.
A choice with none of these answers an empty message. Cut by ``max_output_tokens`` (or the
context's end), the response is ``incomplete`` (``incomplete_details.reason``
``max_output_tokens``) and so is its last item.

Streamed, each item is announced (``response.output_item.added``), filled
(``response.content_part.added``, ``response.output_text.delta`` /
``response.reasoning_text.delta`` / ``response.function_call_arguments.delta``), and closed
(the ``.done`` events, ``response.output_item.done``), between ``response.created`` /
``response.in_progress`` and ``response.completed`` (or ``response.incomplete``,
``response.failed``) carrying the whole response. Every event has its ``sequence_number``
and its ``type`` as the SSE event name.

Usage counts the prompt's tokens and the output's; ``reasoning_tokens``: the output's
tokens up to the one that closed the thinking (all of them when it never closed);
``cached_tokens``: the prompt's tokens found in the prefix cache.
"""

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import msgspec
from litestar.response import ServerSentEvent
from litestar.response.sse import ServerSentEventMessage

from adapters.http.errors import HTTPError
from adapters.http.openai.tools import new_call_id
from adapters.http.responses.params import new_id
from adapters.http.responses.schemas import (
    ArgumentsDelta,
    ArgumentsDone,
    Completed,
    Failed,
    FunctionCallItem,
    Incomplete,
    IncompleteDetails,
    InProgress,
    InputTokensDetails,
    ItemAdded,
    ItemDone,
    MessageItem,
    OutputItem,
    OutputText,
    OutputTokensDetails,
    PartAdded,
    PartDone,
    ReasoningDelta,
    ReasoningDone,
    ReasoningItem,
    ReasoningText,
    ResponseError,
    ResponseEvent,
    ResponseObject,
    ResponseUsage,
    StreamEvent,
    TextDelta,
    TextDone,
)
from application.serving.chat_output import (
    ChoiceEnd,
    ChoiceError,
    ChoiceEvents,
    ChoiceResult,
    Text,
    Thinking,
    ToolCallDelta,
)
from application.serving.reasoning import CLOSE, Reasoning
from application.serving.tool_parsers import StreamingToolParser
from domain.request import StepOutput

_encoder = msgspec.json.Encoder()
# Called with the finished response before it is answered (storing it).
OnDone = Callable[[ResponseObject], Awaitable[None]]


def thinking_tokens(texts: Sequence[str], thought: bool) -> int:
    """Of the output's tokens (their texts, in order), how many are thinking: those up to
    the one that completes ``</think>``, all of them when it never came (0: no thinking)."""
    if not thought:
        return 0
    end = "".join(texts).find(CLOSE)
    if end < 0:
        return len(texts)
    position, stop = 0, end + len(CLOSE)
    for count, text in enumerate(texts, 1):
        position += len(text)
        if position >= stop:
            return count
    return len(texts)


def finished(
    skeleton: ResponseObject, items: list[OutputItem], end: ChoiceEnd, reasoning_tokens: int
) -> ResponseObject:
    """The response once its choice ended with ``end``."""
    cut = end.reason == "length"
    usage = ResponseUsage(
        end.prompt_tokens,
        end.completion_tokens,
        end.prompt_tokens + end.completion_tokens,
        input_tokens_details=InputTokensDetails(end.cached_tokens),
        output_tokens_details=OutputTokensDetails(reasoning_tokens),
    )
    return msgspec.structs.replace(
        skeleton,
        status="incomplete" if cut else "completed",
        incomplete_details=IncompleteDetails("max_output_tokens") if cut else None,
        output=items,
        usage=usage,
    )


def response_body(skeleton: ResponseObject, result: ChoiceResult) -> ResponseObject:
    """The whole response of a collected choice."""
    items: list[OutputItem] = []
    if result.reasoning:
        items.append(ReasoningItem(new_id("rs"), content=[ReasoningText(result.reasoning)]))
    if result.content or not (result.calls or items):
        items.append(MessageItem(new_id("msg"), content=[OutputText(result.content or "")]))
    for call in result.calls:
        items.append(FunctionCallItem(new_id("fc"), new_call_id(), call.name, call.arguments))
    if result.end.reason == "length" and items:
        items[-1] = msgspec.structs.replace(items[-1], status="incomplete")
    texts = [out.text_delta for out in result.outputs]
    return finished(skeleton, items, result.end, thinking_tokens(texts, bool(result.reasoning)))


@dataclass
class _Open:
    """The item being streamed: its index, id, kind and what it holds so far."""

    index: int
    item_id: str
    kind: str  # reasoning, message, function_call
    text: str = ""
    name: str = ""
    call_id: str = ""


@dataclass
class _Items:
    """A streamed choice's output items: the events that open, fill and close them, and
    the finished items."""

    done: list[OutputItem] = field(default_factory=list)
    current: _Open | None = None

    def _open(self, kind: str, prefix: str) -> _Open:
        self.current = _Open(len(self.done), new_id(prefix), kind)
        return self.current

    def thinking(self, text: str) -> list[StreamEvent]:
        events = [] if self._is("reasoning") else self.close()
        if not self._is("reasoning"):
            now = self._open("reasoning", "rs")
            item = ReasoningItem(now.item_id, status="in_progress")
            events += [
                ItemAdded(now.index, item),
                PartAdded(now.item_id, now.index, 0, ReasoningText("")),
            ]
        assert self.current is not None
        self.current.text += text
        events.append(ReasoningDelta(self.current.item_id, self.current.index, 0, text))
        return events

    def answer(self, text: str) -> list[StreamEvent]:
        events = [] if self._is("message") else self.close()
        if not self._is("message"):
            now = self._open("message", "msg")
            events += [
                ItemAdded(now.index, MessageItem(now.item_id, status="in_progress")),
                PartAdded(now.item_id, now.index, 0, OutputText("")),
            ]
        assert self.current is not None
        self.current.text += text
        if text:
            events.append(TextDelta(self.current.item_id, self.current.index, 0, text))
        return events

    def call(self, delta: ToolCallDelta) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        if delta.name is not None:
            events += self.close()
            now = self._open("function_call", "fc")
            now.name, now.call_id = delta.name, new_call_id()
            item = FunctionCallItem(now.item_id, now.call_id, now.name, "", "in_progress")
            events.append(ItemAdded(now.index, item))
        current = self.current
        if delta.arguments and current is not None and current.kind == "function_call":
            current.text += delta.arguments
            events.append(ArgumentsDelta(current.item_id, current.index, delta.arguments))
        return events

    def close(self, status: str = "completed") -> list[StreamEvent]:
        """The events closing the open item (none open: none)."""
        now, self.current = self.current, None
        if now is None:
            return []
        index, item_id = now.index, now.item_id
        events: list[StreamEvent]
        item: OutputItem
        if now.kind == "reasoning":
            part = ReasoningText(now.text)
            item = ReasoningItem(item_id, content=[part], status=status)
            events = [ReasoningDone(item_id, index, 0, now.text), PartDone(item_id, index, 0, part)]
        elif now.kind == "message":
            text = OutputText(now.text)
            item = MessageItem(item_id, status, content=[text])
            events = [TextDone(item_id, index, 0, now.text), PartDone(item_id, index, 0, text)]
        else:
            item = FunctionCallItem(item_id, now.call_id, now.name, now.text, status)
            events = [ArgumentsDone(item_id, index, now.name, now.text)]
        self.done.append(item)
        return [*events, ItemDone(index, item)]

    def _is(self, kind: str) -> bool:
        return self.current is not None and self.current.kind == kind


async def response_events(
    skeleton: ResponseObject,
    stream: AsyncIterator[StepOutput],
    reasoning: Reasoning | None,
    parser: StreamingToolParser | None,
    parallel: bool,
    on_done: OnDone,
) -> AsyncIterator[StreamEvent]:
    """One choice's stream as the Responses events (``on_done``: called with the finished
    response before its last event)."""
    yield ResponseEvent(skeleton)
    yield InProgress(skeleton)
    choice, items = ChoiceEvents(reasoning, parser, parallel), _Items()
    texts: list[str] = []
    thought, end = False, None
    try:
        async for out in stream:
            if out.token_id is not None:
                texts.append(out.text_delta)
            for event in choice.feed(out):
                if isinstance(event, Thinking):
                    thought = True
                    for e in items.thinking(event.text):
                        yield e
                elif isinstance(event, Text):
                    for e in items.answer(event.text):
                        yield e
                elif isinstance(event, ToolCallDelta):
                    for e in items.call(event):
                        yield e
                else:
                    end = event
    except ChoiceError as error:
        for e in _failed(skeleton, items, str(error)):
            yield e
        return
    if end is None:  # the engine let go of the request without an end (aborted)
        for e in _failed(skeleton, items, "the response ended before it finished"):
            yield e
        return
    cut = end.reason == "length"
    for e in items.close("incomplete" if cut else "completed"):
        yield e
    if not items.done:  # nothing said: an empty answer
        for e in [*items.answer(""), *items.close()]:
            yield e
    response = finished(skeleton, items.done, end, thinking_tokens(texts, thought))
    try:
        await on_done(response)
    except HTTPError as error:  # not stored: the client must not continue it
        yield Failed(
            msgspec.structs.replace(
                response, status="failed", error=ResponseError("server_error", error.message)
            )
        )
        return
    yield (Incomplete if cut else Completed)(response)


def _failed(skeleton: ResponseObject, items: _Items, message: str) -> list[StreamEvent]:
    """The open item closed (incomplete), then ``response.failed``."""
    events = items.close("incomplete")
    failed = msgspec.structs.replace(
        skeleton,
        status="failed",
        output=items.done,
        error=ResponseError("server_error", message),
    )
    return [*events, Failed(failed)]


def event_stream(events: AsyncIterator[StreamEvent]) -> ServerSentEvent:
    """The events as SSE, each named by its type and numbered in order."""

    async def messages() -> AsyncIterator[ServerSentEventMessage]:
        number = 0
        async for event in events:
            event.sequence_number = number
            number += 1
            name = type(event).__struct_config__.tag
            yield ServerSentEventMessage(data=_encoder.encode(event).decode(), event=str(name))

    return ServerSentEvent(messages())
