"""Tool-call parsers: a model's output -> content and tool calls, whole or as it streams.

One parser per output format (``hermes``, ``llama3_json``, ``pythonic``), chosen for the
model's chat template (:func:`detect_format`) or by name; plus the parsers of the outputs
that ``tool_choice`` constrains: ``required`` (a JSON array of calls) and a named function
(its arguments object). Pure Python: the HTTP face drives them.
"""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from application.serving.tool_parsers import hermes, json_calls, pythonic
from application.serving.tool_parsers.calls import (
    CallDeltas,
    Event,
    StreamingToolParser,
    ToolCall,
    ToolCallDelta,
    is_json_object,
    parse_all,
)

__all__ = [
    "FORMATS",
    "Event",
    "NamedCallParser",
    "StreamingToolParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolFormat",
    "detect_format",
    "is_json_object",
    "parse_all",
    "required_parser",
]


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """How a model family writes calls: its parser, and for a chat template that knows no
    tools, how to describe the tools (``instructions``, given the tools as JSON lines) and
    write past calls and results into the conversation."""

    name: str
    parser: Callable[[frozenset[str] | None], StreamingToolParser]
    instructions: Callable[[str], str]
    render_calls: Callable[[Sequence[Mapping[str, Any]]], str]
    render_result: Callable[[str], str]


FORMATS = {
    "hermes": ToolFormat(
        "hermes",
        hermes.HermesParser,
        hermes.instructions,
        hermes.render_calls,
        hermes.render_result,
    ),
    "llama3_json": ToolFormat(
        "llama3_json",
        json_calls.JsonCallsParser,
        json_calls.instructions,
        json_calls.render_calls,
        json_calls.render_result,
    ),
    "pythonic": ToolFormat(
        "pythonic",
        pythonic.PythonicParser,
        pythonic.instructions,
        pythonic.render_calls,
        pythonic.render_result,
    ),
}


def detect_format(chat_template: str | None) -> str:
    """The format a chat template's model writes calls in, as vLLM's docs pair them:
    Llama 3.x templates (``<|python_tag|>``, ``ipython``) -> ``llama3_json``; Gemma's
    (``<start_of_turn>``) -> ``pythonic``; Qwen / Hermes (``<tool_call>``) and any other
    (ChatML: our prompt teaches it) -> ``hermes``."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    if "<start_of_turn>" in template:
        return "pythonic"
    return "hermes"


def required_parser(tool_names: frozenset[str] | None = None) -> StreamingToolParser:
    """The parser of ``tool_choice: required``'s constrained output."""
    return json_calls.JsonCallsParser(tool_names, array=True)


class NamedCallParser:
    """A named ``tool_choice``: the whole output is the call's arguments."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._deltas = CallDeltas()

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = [] if self._deltas.count else [self._deltas.start(self._name)]
        return events + self._deltas.fragment(text)

    def finish(self) -> list[Event]:
        return self.feed("")
