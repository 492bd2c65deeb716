"""Hermes-style calls (Qwen2.5/3, Hermes 2 Pro, and our prompt for ChatML templates):
``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, any number, after
optional content."""

import json
from collections.abc import Mapping, Sequence
from typing import Any

from application.serving.tool_parsers.calls import CallDeltas, Event, JsonCallStream

START, END = "<tool_call>", "</tool_call>"


class HermesParser:
    """Content streams as it comes (a possible start of ``<tool_call>`` is held, and the
    whitespace around calls dropped); each call streams through :class:`JsonCallStream`.
    A call that turns out malformed before its name is content; after it, the rest of the
    call is dropped."""

    def __init__(self, tool_names: frozenset[str] | None = None) -> None:
        self._tool_names = tool_names
        self._deltas = CallDeltas()
        self._held = ""  # content not yet sent
        self._call: JsonCallStream | None = None
        self._after_call = False  # expecting </tool_call>
        self._skipping = False  # a broken call: dropped up to its </tool_call>

    def feed(self, text: str) -> list[Event]:
        self._held += text
        events: list[Event] = []
        while self._held:
            before = self._held
            if self._call is not None:
                events += self._in_call()
            elif self._after_call or self._skipping:
                self._close_call()
            else:
                events += self._content()
            if self._held == before:  # waiting for more text
                break
        return events

    def finish(self) -> list[Event]:
        held, self._held = self._held, ""
        if self._call is not None and not self._call.committed:
            return [START + self._call.scanner.consumed_text()]
        if self._call is not None or self._after_call or self._skipping:
            return []
        return [held] if held.strip() or (held and self._deltas.count == 0) else []

    def _content(self) -> list[Event]:
        held = self._held
        start = held.find(START)
        if start >= 0:
            content = held[:start]
            self._held = held[start + len(START) :]
            self._call = JsonCallStream(("arguments", "parameters"), self._tool_names, self._deltas)
            return [content.rstrip()] if content.strip() else []
        keep = _held_back(held)
        sent, self._held = held[: len(held) - keep], held[len(held) - keep :]
        if self._deltas.count and not sent.strip():
            self._held = held  # whitespace after a call: held until we know what follows
            return []
        return [sent] if sent else []

    def _in_call(self) -> list[Event]:
        call = self._call
        assert call is not None
        text, self._held = self._held, ""
        events = call.feed(text)
        scanner = call.scanner
        if call.rejected:  # not a call after all: its text is content
            self._call = None
            self._held = scanner.rest
            return [START + scanner.consumed_text()]
        if call.done:
            self._call = None
            self._held = scanner.rest
            self._after_call, self._skipping = scanner.end, not scanner.end
        return events

    def _close_call(self) -> None:
        held = self._held
        if self._skipping:
            end = held.find(END)
            self._held = held[end + len(END) :] if end >= 0 else held[1 - len(END) :]
            self._skipping = end < 0
            return
        stripped = held.lstrip()
        if stripped.startswith(END):
            self._held, self._after_call = stripped[len(END) :], False
        elif not END.startswith(stripped):  # no closing tag: carry on
            self._held, self._after_call = stripped, False
        elif stripped != held:
            self._held = stripped


def _held_back(text: str) -> int:
    """How many characters at the end of ``text`` may begin ``<tool_call>`` (with the
    whitespace before them)."""
    for n in range(min(len(START) - 1, len(text)), 0, -1):
        if START.startswith(text[-n:]):
            return len(text) - len(text[: len(text) - n].rstrip())
    return len(text) - len(text.rstrip())


def render_calls(calls: Sequence[Mapping[str, Any]]) -> str:
    """Calls (``{"name", "arguments"}``) as the model writes them."""
    return "\n".join(
        f"{START}\n{json.dumps({'name': c['name'], 'arguments': c['arguments']})}\n{END}"
        for c in calls
    )


def render_result(content: str) -> str:
    return f"<tool_response>\n{content}\n</tool_response>"


def instructions(tools_json: str) -> str:
    """The system prompt that teaches a template without tools this format (Qwen2.5's)."""
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{tools_json}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )
