"""Outputs that are JSON call objects from their first character: Llama 3's
(``{"name": "f", "parameters": {...}}``, optionally after ``<|python_tag|>``, several
separated by ``;``) and the JSON array a ``tool_choice`` of ``required`` is constrained
to (``[{"name": "f", "parameters": {...}}, ...]``, as in vLLM)."""

import json
from collections.abc import Mapping, Sequence
from typing import Any

from application.serving.tool_parsers.calls import CallDeltas, Event, JsonCallStream

PYTHON_TAG = "<|python_tag|>"
ARGUMENT_KEYS = ("parameters", "arguments")


class JsonCallsParser:
    """An output that does not begin with a call object (``[`` and one, with ``array``)
    is content; after the calls, text that is not another call is content too. A call
    malformed before its name makes the whole output content (the first call) or ends
    the calls (a later one)."""

    def __init__(self, tool_names: frozenset[str] | None = None, *, array: bool = False) -> None:
        self._tool_names = tool_names
        self._array = array
        self._deltas = CallDeltas()
        self._held = ""
        self._raw = ""  # the output so far, while it may still be content
        self._state = "start"  # start, between, call, content, done
        self._current: JsonCallStream | None = None

    def feed(self, text: str) -> list[Event]:
        self._held += text
        if self._deltas.count == 0 and self._state != "content":
            self._raw += text
        events: list[Event] = []
        while self._held:
            before = (self._held, self._state)
            events += getattr(self, f"_{self._state}")()
            if (self._held, self._state) == before:
                break
        return events

    def finish(self) -> list[Event]:
        held, self._held = self._held, ""
        if self._deltas.count == 0 and self._state != "content":
            return [self._raw] if self._raw else []
        return [held] if self._state == "content" and held else []

    def _start(self) -> list[Event]:
        held = self._held.lstrip()
        if held.startswith(PYTHON_TAG):
            held = held[len(PYTHON_TAG) :].lstrip()
        opener = "[" if self._array else "{"
        if held.startswith(opener):
            self._held = held[1:] if self._array else held
            self._state = "between" if self._array else "call"
        elif held and not PYTHON_TAG.startswith(held):
            return self._to_content()
        return []

    def _between(self) -> list[Event]:
        held = self._held.lstrip()
        separators = "," if self._array else ";"
        while held[:1] and held[0] in separators:
            held = held[1:].lstrip()
        self._held = held
        if held.startswith("{"):
            self._state = "call"
        elif held.startswith("]") and self._array:
            self._held, self._state = held[1:], "content"
        elif held:
            if self._deltas.count == 0:
                return self._to_content()
            self._state = "content"
        return []

    def _call(self) -> list[Event]:
        if self._current is None:
            self._current = JsonCallStream(ARGUMENT_KEYS, self._tool_names, self._deltas)
        call = self._current
        text, self._held = self._held, ""
        events = call.feed(text)
        scanner = call.scanner
        if call.rejected or (call.done and not scanner.end):
            self._current = None
            if self._deltas.count == 0:
                return self._to_content()
            self._state = "done"
        elif call.done:
            self._current = None
            self._held, self._state = scanner.rest, "between"
        return events

    def _content(self) -> list[Event]:
        text, self._held = self._held, ""
        return [text]

    def _done(self) -> list[Event]:
        self._held = ""
        return []

    def _to_content(self) -> list[Event]:
        self._state, self._held = "content", ""
        raw, self._raw = self._raw, ""
        return [raw]


def render_calls(calls: Sequence[Mapping[str, Any]]) -> str:
    return "; ".join(json.dumps({"name": c["name"], "parameters": c["arguments"]}) for c in calls)


def render_result(content: str) -> str:
    return content


def instructions(tools_json: str) -> str:
    """Llama 3.1's prompt for JSON calls."""
    return (
        "Given the following functions, please respond with a JSON for a function call "
        "with its proper arguments that best answers the given prompt.\n\n"
        'Respond in the format {"name": function name, "parameters": dictionary of '
        "argument name and its value}. Do not use variables.\n\n"
        f"{tools_json}"
    )
