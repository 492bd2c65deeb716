"""A chat choice's output as every face reads it: thinking, answer text, tool calls, its end.

The engine streams text; a chat's text is split in this order — the thinking from the
answer (:mod:`application.serving.reasoning`), then tool calls from the answer's text (the
server's tool format, or the JSON a constrained ``tool_choice`` makes the model write).
Chat completions, Responses and Messages each write these events in their own wire form,
so the split is written once.
"""

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from application.serving.chat_prompts import ToolRequest
from application.serving.reasoning import Reasoning, ReasoningStream, Split
from application.serving.tool_parsers import (
    NamedCallParser,
    StreamingToolParser,
    ToolCall,
    ToolCallDelta,
    ToolFormat,
    parse_all,
    required_parser,
)
from domain.request import StepOutput

__all__ = [
    "ChoiceEnd",
    "ChoiceEvent",
    "ChoiceEvents",
    "ChoiceResult",
    "Text",
    "Thinking",
    "ToolCallDelta",
    "collect_choice",
    "tool_parser",
]


@dataclass(frozen=True, slots=True)
class Thinking:
    text: str


@dataclass(frozen=True, slots=True)
class Text:
    text: str


@dataclass(frozen=True, slots=True)
class ChoiceEnd:
    """The choice ended: ``reason`` is the engine's (``eos``, ``stop``: a stop string or
    id, ``length``, ``abort``); ``tool_calls``: it called tools (and was not cut)."""

    reason: str
    prompt_tokens: int
    completion_tokens: int
    tool_calls: bool = False
    cached_tokens: int = 0  # of the prompt's, found in the prefix cache


ChoiceEvent = Thinking | Text | ToolCallDelta | ChoiceEnd


class ChoiceError(Exception):
    """The engine failed the choice (its message is the engine's)."""


def tool_parser(fmt: ToolFormat, request: ToolRequest | None) -> StreamingToolParser | None:
    """What reads ``request``'s calls from the answer: the server's format (``auto``), the
    constrained JSON (``required``, a named function), or nothing (no tools, ``none``)."""
    if request is None or request.choice == "none":
        return None
    if request.choice == "auto":
        return fmt.parser(request.names)
    if request.choice == "required":
        return required_parser(request.names)
    return NamedCallParser(request.choice)


class ChoiceEvents:
    """One streamed choice: its outputs in, events out. Without parallel calls only the
    first call is kept."""

    def __init__(
        self,
        reasoning: Reasoning | None,
        parser: StreamingToolParser | None,
        parallel: bool = True,
    ) -> None:
        self._thinking: ReasoningStream | None = None if reasoning is None else reasoning.stream()
        self._parser, self._parallel = parser, parallel
        self._calls = 0

    def feed(self, out: StepOutput) -> list[ChoiceEvent]:
        """The events of one output (an engine error raises :class:`ChoiceError`)."""
        if out.error is not None:
            raise ChoiceError(out.error)
        events: list[ChoiceEvent] = []
        answer = out.text_delta
        if self._thinking is not None:
            split = self._thinking.feed(out.text_delta)
            if out.finished:
                rest = self._thinking.finish()
                split = Split(split.reasoning + rest.reasoning, split.content + rest.content)
            if split.reasoning:
                events.append(Thinking(split.reasoning))
            answer = split.content
        events += self._answer(answer, out.finished)
        if out.finished:
            reason = out.finish_reason or "stop"
            calls = self._calls > 0 and reason != "length"
            events.append(
                ChoiceEnd(
                    reason, out.prompt_tokens, out.completion_tokens, calls, out.cached_tokens
                )
            )
        return events

    def _answer(self, text: str, finished: bool) -> list[ChoiceEvent]:
        if self._parser is None:
            return [Text(text)] if text else []
        parsed = self._parser.feed(text) if text else []
        if finished:
            parsed += self._parser.finish()
        events: list[ChoiceEvent] = []
        for event in parsed:
            if isinstance(event, str):
                if event:
                    events.append(Text(event))
            elif event.index == 0 or self._parallel:
                if event.name is not None:
                    self._calls += 1
                events.append(event)
        return events


@dataclass
class ChoiceResult:
    """One whole choice: ``reasoning`` None when the model did not think; ``content``
    None when it only called tools; its outputs that carried a token (logprobs)."""

    reasoning: str | None
    content: str | None
    calls: list[ToolCall]
    end: ChoiceEnd
    outputs: list[StepOutput] = field(default_factory=list)
    text: str = ""  # the raw text, thinking and calls included


async def collect_choice(
    stream: AsyncIterator[StepOutput],
    reasoning: Reasoning | None,
    parser: StreamingToolParser | None,
    parallel: bool = True,
) -> ChoiceResult:
    """A choice's outputs read to its end and split (an engine error raises
    :class:`ChoiceError`)."""
    parts: list[str] = []
    outputs: list[StepOutput] = []
    end = ChoiceEnd("abort", 0, 0)
    async for out in stream:
        if out.error is not None:
            raise ChoiceError(out.error)
        parts.append(out.text_delta)
        if out.token_id is not None:
            outputs.append(out)
        if out.finished:
            end = ChoiceEnd(
                out.finish_reason or "stop",
                out.prompt_tokens,
                out.completion_tokens,
                cached_tokens=out.cached_tokens,
            )
    return split_choice("".join(parts), end, reasoning, parser, parallel, outputs)


def split_choice(
    text: str,
    end: ChoiceEnd,
    reasoning: Reasoning | None,
    parser: StreamingToolParser | None,
    parallel: bool = True,
    outputs: Sequence[StepOutput] = (),
) -> ChoiceResult:
    """A whole output split into thinking, answer and calls. Calls cut short by
    ``max_tokens`` are dropped (the complete ones stand); a call that is not valid JSON
    leaves the answer as text."""
    thinking, answer = (None, text) if reasoning is None else reasoning.split(text)
    content: str | None = answer
    calls: list[ToolCall] = []
    if parser is not None:
        cut = end.reason == "length"
        parsed, calls = parse_all(parser, answer, truncated=cut)
        if calls:
            content = parsed
            calls = calls if parallel else calls[:1]
            end = ChoiceEnd(
                end.reason, end.prompt_tokens, end.completion_tokens, not cut, end.cached_tokens
            )
    return ChoiceResult(thinking, content, calls, end, list(outputs), text)
