"""Pythonic calls (Gemma 3 and Llama 3.2's alternative format, as vLLM's ``pythonic``
parser reads them): the output is a Python list of calls with keyword arguments,
``[get_weather(city="Paris"), get_time()]``."""

import ast
import json
from collections.abc import Mapping, Sequence
from typing import Any

from application.serving.tool_parsers.calls import CallDeltas, Event

_CLOSERS = {"(": ")", "[": "]", "{": "}"}
_JSON_NAMES = {"true": True, "false": False, "null": None}


class PythonicParser:
    """An output that does not begin with ``[`` is content. Each call is sent when its
    closing parenthesis arrives: its name, then its arguments as one JSON object. A call
    that is not a call of a known function with literal keyword arguments makes the whole
    output content (the first call) or ends the calls (a later one)."""

    def __init__(self, tool_names: frozenset[str] | None = None) -> None:
        self._tool_names = tool_names
        self._deltas = CallDeltas()
        self._raw = ""  # the whole output so far
        self._pos = 0  # scanned up to here
        self._state = "start"  # start, list, content, done
        self._stack: list[str] = []
        self._quote: str | None = None
        self._escape = False
        self._call_start: int | None = None

    def feed(self, text: str) -> list[Event]:
        self._raw += text
        if self._state == "content":
            return [text] if text else []
        if self._state == "start":
            stripped = self._raw.lstrip()
            if not stripped:
                return []
            if not stripped.startswith("["):
                self._state = "content"
                return [self._raw]
            self._state, self._pos = "list", len(self._raw) - len(stripped)
        events: list[Event] = []
        while self._state == "list" and self._pos < len(self._raw):
            events += self._step(self._raw[self._pos], self._pos)
            self._pos += 1
        if self._state == "content" and self._pos < len(self._raw):  # after the list
            events.append(self._raw[self._pos :])
            self._pos = len(self._raw)
        return events

    def finish(self) -> list[Event]:
        if self._deltas.count == 0 and self._state in ("start", "list"):
            return [self._raw] if self._raw else []
        return []

    def _step(self, c: str, i: int) -> list[Event]:
        if self._quote is not None:
            if self._escape:
                self._escape = False
            elif c == "\\":
                self._escape = True
            elif c == self._quote:
                self._quote = None
            return []
        if c in "'\"":
            self._quote = c
        elif c in _CLOSERS:
            self._stack.append(_CLOSERS[c])
        elif c in ")]}":
            if not self._stack or self._stack.pop() != c:
                return self._broken()
            if not self._stack:  # the list closed
                self._state = "content" if self._deltas.count else "done"
                return [] if self._deltas.count else self._broken()
            if len(self._stack) == 1 and c == ")" and self._call_start is not None:
                call, self._call_start = self._raw[self._call_start : i + 1], None
                return self._call(call)
        elif len(self._stack) == 1 and self._call_start is None and not c.isspace() and c != ",":
            self._call_start = i
        return []

    def _call(self, text: str) -> list[Event]:
        parsed = _parse_call(text)
        if parsed is None or (self._tool_names is not None and parsed[0] not in self._tool_names):
            return self._broken()
        name, arguments = parsed
        return [self._deltas.start(name), *self._deltas.fragment(arguments)]

    def _broken(self) -> list[Event]:
        if self._deltas.count:
            self._state = "done"
            return []
        self._state, self._pos = "content", len(self._raw)
        return [self._raw]


def _parse_call(text: str) -> tuple[str, str] | None:
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    try:
        arguments = {k.arg: _literal(k.value) for k in node.keywords if k.arg is not None}
    except ValueError:
        return None
    if len(arguments) != len(node.keywords):  # a **kwargs
        return None
    return node.func.id, json.dumps(arguments, ensure_ascii=False)


def _literal(node: ast.expr) -> Any:
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.List | ast.Tuple):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values, strict=True) if k}
    return ast.literal_eval(node)


def render_calls(calls: Sequence[Mapping[str, Any]]) -> str:
    def call(c: Mapping[str, Any]) -> str:
        arguments = ", ".join(f"{k}={v!r}" for k, v in c["arguments"].items())
        return f"{c['name']}({arguments})"

    return f"[{', '.join(call(c) for c in calls)}]"


def render_result(content: str) -> str:
    return content


def instructions(tools_json: str) -> str:
    """vLLM's Gemma 3 / Llama 3.2 pythonic prompt, shortened."""
    return (
        "You have access to functions. If you decide to invoke any of the function(s), you "
        "MUST put it in the format of\n[func_name1(params_name1=params_value1, "
        "params_name2=params_value2...), func_name2(params)]\n"
        "You SHOULD NOT include any other text in the response if you call a function.\n"
        f"{tools_json}"
    )
