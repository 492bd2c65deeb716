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


def parse_all(
    parser: StreamingToolParser, text: str, *, truncated: bool = False
) -> tuple[str | None, list[ToolCall]]:
    """The whole output at once: its content (None when it is only calls) and its calls.
    A call whose arguments are not a JSON object makes the whole text content — except,
    when the output was ``truncated`` (cut by ``max_tokens``), the calls cut short at its
    end, which are dropped: the complete calls before them stand."""
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
    while truncated and calls and not is_json_object(calls[-1].arguments):
        calls.pop()
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

    @property
    def sent(self) -> bool:
        """Some of the current call's arguments were sent."""
        return self._sent > 0

    def fragment(self, text: str) -> list[Event]:
        """The next piece of the current call's arguments."""
        self._sent += len(text)
        return [ToolCallDelta(self.count - 1, arguments=text)] if text else []


class JsonCallScanner:
    """One JSON call object, ``{"name": "f", "arguments": {...}}``, scanned as its text
    arrives, in time linear in its length: the name once its string is complete, the
    arguments' text as it grows (an object's text is passed on as written; a string
    holding JSON, ``null`` or no arguments at all are known when the call ends).

    ``end``: the closing brace was seen; ``error``: the text is not a call object;
    ``rest``: what was fed after either.
    """

    def __init__(self, argument_keys: Sequence[str]) -> None:
        self._argument_keys = tuple(argument_keys)
        self.name: str | None = None
        self.end = self.error = False
        self.rest = ""
        self._consumed: list[str] = []
        self._stack: list[str] = []
        self._in_string = self._escape = False
        self._expect = "open"  # open key colon value string primitive nested after
        self._key: str | None = None
        self._token: list[str] | None = None  # the key or value being read, when needed
        self._args = "none"  # none, object (being read), other (being read), done
        self._args_text: str | None = None  # a non-object arguments value
        self._args_parts: list[str] = []  # an object's text, as read
        self._fresh = 0  # parts not yet taken

    @property
    def done(self) -> bool:
        return self.end or self.error

    def feed(self, text: str) -> None:
        if self.done:
            self.rest += text
            return
        for i, c in enumerate(text):
            had_token, was_args = self._token is not None, self._args == "object"
            self._step(c)
            if had_token and self._token is not None:
                self._token.append(c)
            if was_args or self._args == "object":
                self._args_parts.append(c)
            if self.done:
                self._consumed.append(text[: i + 1])
                self.rest = text[i + 1 :]
                return
        self._consumed.append(text)

    def consumed_text(self) -> str:
        return "".join(self._consumed)

    def take_arguments(self) -> str:
        """The object arguments' text read since the last call."""
        fresh, self._fresh = self._args_parts[self._fresh :], len(self._args_parts)
        return "".join(fresh)

    def final_arguments(self) -> str | None:
        """The arguments once the call is complete (None: not a JSON object)."""
        if self._args == "none":
            return "{}"
        raw = "".join(self._args_parts) if self._args_text is None else self._args_text
        try:
            value = json.loads(raw)
        except ValueError:
            return None
        if value is None:
            return "{}"
        if isinstance(value, str) and is_json_object(value):
            return value
        return raw if isinstance(value, dict) else None

    def _step(self, c: str) -> None:
        if self._in_string:
            if self._escape:
                self._escape = False
            elif c == "\\":
                self._escape = True
            elif c == '"':
                self._in_string = False
                if len(self._stack) == 1:
                    self._string_closed(c)
            return
        top = len(self._stack) == 1
        if c == '"':
            self._in_string = True
            if top and self._expect == "key":
                self._token = [c]
            elif top:
                self._value_starts(c, "string")
        elif c in "{[":
            if not self._stack:
                self.error = c != "{"
                self._expect = "key"
            elif top:
                self._value_starts(c, "nested")
            self._stack.append("}" if c == "{" else "]")
        elif c in "}]":
            self._close(c)
        elif not self._stack:
            self.error = not c.isspace()
        elif top:
            self._top_level(c)

    def _close(self, c: str) -> None:
        if not self._stack or self._stack.pop() != c:
            self.error = True
            return
        if self._stack:
            if len(self._stack) == 1:
                self._value_ends(c)
            return
        if self._expect == "primitive":
            self._value_ends("")
        self.error = self._expect not in ("after", "key")
        self.end = not self.error

    def _top_level(self, c: str) -> None:
        expect = self._expect
        if c == ":" and expect == "colon":
            self._expect = "value"
        elif c == "," and expect in ("after", "primitive"):
            if expect == "primitive":
                self._value_ends("")
            self._expect = "key"
        elif c.isspace():
            if expect == "primitive":
                self._value_ends("")
        elif expect == "value":
            self._value_starts(c, "primitive")
        elif expect != "primitive":
            self.error = True

    def _string_closed(self, c: str) -> None:
        if self._expect == "key":
            try:
                self._key = json.loads("".join(self._token or ()) + c)
            except ValueError:
                self.error = True
            self._token, self._expect = None, "colon"
        elif self._expect == "string":
            self._value_ends(c)

    def _value_starts(self, c: str, kind: str) -> None:
        if self._expect != "value":
            self.error = True
            return
        self._expect = kind
        is_args = self._key in self._argument_keys and self._args == "none"
        if is_args and c == "{":
            self._args = "object"
        elif is_args or self._key == "name":
            self._token = [c]
            self._args = "other" if is_args else self._args

    def _value_ends(self, closing: str) -> None:
        """``closing``: the value's last character, when it is the current one."""
        self._expect = "after"
        if self._args == "object":
            self._args = "done"
            return
        if self._token is None:
            return
        text, self._token = "".join(self._token) + closing, None
        if self._args == "other":
            self._args, self._args_text = "done", text
            return
        try:
            name = json.loads(text)
        except ValueError:
            name = None
        self.name = name if isinstance(name, str) and name and self.name is None else self.name


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
        return self.scanner.done

    def feed(self, text: str) -> list[Event]:
        scanner = self.scanner
        scanner.feed(text)
        events: list[Event] = []
        if not self.committed:
            name = scanner.name
            known = name is not None and (self._tool_names is None or name in self._tool_names)
            if not known:
                self.rejected = scanner.done or name is not None
                return []
            assert name is not None
            self.committed = True
            events.append(self._deltas.start(name))
        events += self._deltas.fragment(scanner.take_arguments())
        if scanner.end and not self._deltas.sent:
            events += self._deltas.fragment(scanner.final_arguments() or "")
        return events
