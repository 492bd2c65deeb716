"""Tool calls as the parsers see them, and the scanner of one JSON call object.

A streaming parser turns text deltas into events: content text (``str``) and
:class:`ToolCallDelta` s. The first delta of a call carries its ``name`` (and no
arguments); later ones carry argument fragments whose concatenation is the call's
arguments, a JSON object's text.
"""

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    index: int
    name: str | None = None  # set on a call's first delta only
    arguments: str = ""


Event = str | ToolCallDelta


class StreamingToolParser(Protocol):
    def feed(self, text: str) -> list[Event]:
        """Events for the next text delta (text that may still start a call is held)."""
        ...

    def finish(self) -> list[Event]:
        """Events for what is held at the end of the output."""
        ...


def parse_all(parser: StreamingToolParser, text: str) -> tuple[str | None, list[ToolCall]]:
    """The whole output at once: its content (None when it is only calls) and its calls.
    A call whose arguments are not a JSON object makes the whole text content."""
    events = [*parser.feed(text), *parser.finish()]
    content = "".join(e for e in events if isinstance(e, str))
    names: dict[int, str] = {}
    arguments: dict[int, list[str]] = {}
    for event in events:
        if isinstance(event, ToolCallDelta):
            if event.name is not None:
                names[event.index] = event.name
            arguments.setdefault(event.index, []).append(event.arguments)
    calls = [ToolCall(names[i], "".join(arguments[i])) for i in sorted(names)]
    if not all(is_json_object(c.arguments) for c in calls):
        return text, []
    if not calls:
        return content, []
    return (content if content.strip() else None), calls


def is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


class CallDeltas:
    """Numbers a parser's calls and turns each call's growing name/arguments into deltas,
    keeping what was sent."""

    def __init__(self) -> None:
        self.count = 0  # calls started
        self._sent = 0  # argument characters sent for the current call

    def start(self, name: str) -> ToolCallDelta:
        self.count += 1
        self._sent = 0
        return ToolCallDelta(self.count - 1, name=name)

    def arguments(self, text: str) -> list[Event]:
        """The new part of the current call's arguments (``text``: all of them so far)."""
        new, self._sent = text[self._sent :], len(text)
        return [ToolCallDelta(self.count - 1, arguments=new)] if new else []


class JsonCallScanner:
    """One JSON call object, ``{"name": "f", "arguments": {...}}``, scanned as its text
    arrives: the name once its string is complete, the arguments' raw text as it grows
    (an object's text is streamed as written; a string holding JSON, ``null`` or no
    arguments at all are known when the call ends).

    ``text``: what was fed; ``end``: the index just past the call's closing brace, once
    seen (text beyond it belongs to the caller); ``error``: the text is not a call object.
    """

    def __init__(self, argument_keys: Sequence[str]) -> None:
        self._argument_keys = tuple(argument_keys)
        self.text = ""
        self.name: str | None = None
        self.end: int | None = None
        self.error = False
        self._pos = 0
        self._stack: list[str] = []
        self._in_string = self._escape = False
        self._expect = "open"  # open key colon value string primitive nested after
        self._key: str | None = None
        self._token_start = 0
        self._args_start: int | None = None
        self._args_end: int | None = None

    def feed(self, text: str) -> None:
        self.text += text
        while not (self.error or self.end is not None) and self._pos < len(self.text):
            self._step(self.text[self._pos], self._pos)
            self._pos += 1

    @property
    def consumed(self) -> int:
        """How much of ``text`` was scanned (all of it, or up to the end or the error)."""
        return self._pos

    def streamable_arguments(self) -> str:
        """The arguments' text so far, when they are an object being written."""
        start = self._args_start
        if start is None or self.text[start] != "{":
            return ""
        return self.text[start : self._pos if self._args_end is None else self._args_end]

    def final_arguments(self) -> str | None:
        """The arguments once the call is complete (None: not a JSON object)."""
        if self._args_start is None or self._args_end is None:
            return "{}" if self._args_start is None else None
        raw = self.text[self._args_start : self._args_end]
        try:
            value = json.loads(raw)
        except ValueError:
            return None
        if value is None:
            return "{}"
        if isinstance(value, str) and is_json_object(value):
            return value
        return raw if isinstance(value, dict) else None

    def _step(self, c: str, i: int) -> None:
        if self._in_string:
            if self._escape:
                self._escape = False
            elif c == "\\":
                self._escape = True
            elif c == '"':
                self._in_string = False
                if len(self._stack) == 1:
                    self._string_closed(i + 1)
            return
        top = len(self._stack) == 1
        if c == '"':
            self._in_string = True
            if top and self._expect == "key":
                self._token_start = i
            elif top:
                self._value_starts(i, "string")
        elif c in "{[":
            if not self._stack:
                self.error = c != "{"
                self._expect = "key"
            elif top:
                self._value_starts(i, "nested")
            self._stack.append("}" if c == "{" else "]")
        elif c in "}]":
            self._close(c, i)
        elif not self._stack:
            self.error = not c.isspace()
        elif top:
            self._top_level(c, i)

    def _close(self, c: str, i: int) -> None:
        if not self._stack or self._stack.pop() != c:
            self.error = True
            return
        if self._stack:
            if len(self._stack) == 1:
                self._value_ends(i + 1)
            return
        if self._expect == "primitive":
            self._value_ends(i)
        self.error = self._expect not in ("after", "key")
        self.end = i + 1

    def _top_level(self, c: str, i: int) -> None:
        expect = self._expect
        if c == ":" and expect == "colon":
            self._expect = "value"
        elif c == "," and expect in ("after", "primitive"):
            if expect == "primitive":
                self._value_ends(i)
            self._expect = "key"
        elif c.isspace():
            if expect == "primitive":
                self._value_ends(i)
        elif expect == "value":
            self._value_starts(i, "primitive")
        elif expect != "primitive":
            self.error = True

    def _string_closed(self, end: int) -> None:
        if self._expect == "key":
            try:
                self._key = json.loads(self.text[self._token_start : end])
            except ValueError:
                self.error = True
            self._expect = "colon"
        elif self._expect == "string":
            self._value_ends(end)

    def _value_starts(self, i: int, kind: str) -> None:
        if self._expect != "value":
            self.error = True
            return
        self._expect, self._token_start = kind, i
        if self._key in self._argument_keys and self._args_start is None:
            self._args_start = i

    def _value_ends(self, end: int) -> None:
        if self._key == "name" and self.name is None:
            try:
                name = json.loads(self.text[self._token_start : end])
            except ValueError:
                name = None
            self.name = name if isinstance(name, str) and name else None
        if self._token_start == self._args_start:
            self._args_end = end
        self._expect = "after"


class JsonCallStream:
    """The deltas of one JSON call object as its text arrives: nothing until the name is
    known (and is one of ``tool_names``, when given), then the arguments as they grow.
    ``rejected``: the text is not a call (malformed before the name, or another name)."""

    def __init__(
        self, argument_keys: Sequence[str], tool_names: frozenset[str] | None, deltas: CallDeltas
    ) -> None:
        self.scanner = JsonCallScanner(argument_keys)
        self._tool_names = tool_names
        self._deltas = deltas
        self.committed = self.rejected = False

    @property
    def done(self) -> bool:
        return self.scanner.end is not None or self.scanner.error

    def feed(self, text: str) -> list[Event]:
        scanner = self.scanner
        scanner.feed(text)
        if not self.committed:
            name = scanner.name
            known = name is not None and (self._tool_names is None or name in self._tool_names)
            if not known:
                self.rejected = scanner.error or name is not None or scanner.end is not None
                return []
            assert name is not None
            self.committed = True
            events: list[Event] = [self._deltas.start(name)]
        else:
            events = []
        if scanner.end is None:
            return events + self._deltas.arguments(scanner.streamable_arguments())
        final = scanner.final_arguments()
        return events + self._deltas.arguments(
            scanner.streamable_arguments() if final is None else final
        )
