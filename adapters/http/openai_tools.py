"""Tools on /v1/chat/completions: the request's tools and ``tool_choice`` checked, the
conversation rendered with them (through the chat template, or a system prompt in the
parser's format when the template knows no tools), the output constrained for
``required`` and named choices, and parsed into ``tool_calls`` (whole or streamed).

``tool_choice``: ``none`` leaves the tools out of the prompt and parses nothing (vLLM
renders them anyway unless told not to; a model that is shown tools it may not call
sometimes calls them in text); ``auto`` (the default with tools) renders them and parses
calls with the server's parser; ``required`` constrains the output to a JSON array of
calls (``[{"name": ..., "parameters": {...}}]``, one at most without parallel calls) and a
named function to that function's arguments object, as vLLM does. The legacy
``functions`` / ``function_call`` stay refused.
"""

import dataclasses
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from adapters.http.errors import HTTPError
from adapters.http.openai_schemas import (
    ChatCompletionRequest,
    ChatDelta,
    ChatMessageOut,
    FunctionCallOut,
    FunctionDeltaOut,
    ToolCallDeltaOut,
    ToolCallOut,
)
from application.engine_client import EngineClient
from application.tool_parsers import (
    Event,
    NamedCallParser,
    StreamingToolParser,
    ToolCallDelta,
    ToolFormat,
    is_json_object,
    parse_all,
    required_parser,
)
from domain.sampling import SamplingParams, StructuredOutput

NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names
CHOICES = ("none", "auto", "required")
NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """A request's tools (as sent, checked), its choice (``none``, ``auto``, ``required``
    or a function's name) and whether several calls may come back."""

    tools: list[dict[str, Any]]
    choice: str
    parallel: bool

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t["function"]["name"] for t in self.tools)

    @property
    def constrained(self) -> bool:
        return self.choice not in ("none", "auto")

    def parameters(self, name: str) -> dict[str, Any]:
        [tool] = [t for t in self.tools if t["function"]["name"] == name]
        return closed(tool["function"].get("parameters") or NO_PARAMETERS)


def closed(parameters: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters as a constrained call takes them: an object schema that does not
    say ``additionalProperties`` takes only its listed properties (as vLLM's xgrammar
    strict mode and OpenAI's strict function calling do), so a small model cannot go on
    inventing arguments until ``max_tokens``."""
    if parameters.get("type") == "object" and "additionalProperties" not in parameters:
        return {**parameters, "additionalProperties": False}
    return parameters


def _bad(message: str, param: str) -> HTTPError:
    return HTTPError(400, message, "invalid_request_error", param)


def tool_request(body: ChatCompletionRequest) -> ToolRequest | None:
    """The request's tools, checked (OpenAI's answers: an empty list is too short, the
    tool options need tools); None without tools."""
    for name, tools in (("tools", body.tools), ("functions", body.functions)):
        if tools == []:
            raise _bad(f"[] is too short - '{name}'", name)
    if body.tools is None:
        for name, option in (
            ("tool_choice", body.tool_choice),
            ("parallel_tool_calls", body.parallel_tool_calls),
        ):
            if option is not None:
                raise _bad(
                    f"Invalid value for '{name}': '{name}' is only allowed when 'tools' "
                    "are specified.",
                    name,
                )
        return None
    tools = [_check_tool(tool, i) for i, tool in enumerate(body.tools)]
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise _bad("tools must have distinct function names", "tools")
    request = ToolRequest(
        tools, _choice(body.tool_choice, set(names)), body.parallel_tool_calls is not False
    )
    if request.constrained and body.response_format not in (None, {"type": "text"}):
        raise _bad(
            "tool_choice required or a named function cannot take a response_format", "tool_choice"
        )
    return request


def _check_tool(tool: Any, i: int) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise _bad(f"{where}.type must be 'function'", f"{where}.type")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise _bad(f"{where}.function must be an object", f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise _bad(
            f"{where}.function.name must be 1-64 letters, digits, underscores or dashes",
            f"{where}.function.name",
        )
    if not isinstance(function.get("description", ""), str):
        raise _bad(
            f"{where}.function.description must be a string", f"{where}.function.description"
        )
    parameters = function.get("parameters")
    if parameters is not None and (
        not isinstance(parameters, dict) or parameters.get("type", "object") != "object"
    ):
        raise _bad(
            f"{where}.function.parameters must be a JSON Schema of type 'object'",
            f"{where}.function.parameters",
        )
    return tool


def _choice(choice: Any, names: set[str]) -> str:
    if choice is None:
        return "auto"
    if isinstance(choice, str) and choice in CHOICES:
        return choice
    if (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and isinstance(choice.get("function"), dict)
        and isinstance(choice["function"].get("name"), str)
    ):
        name = choice["function"]["name"]
        if name not in names:
            raise _bad(
                f"tool_choice names the function {name!r}, which is not in tools", "tool_choice"
            )
        return str(name)
    raise _bad(
        "tool_choice must be 'none', 'auto', 'required' or "
        '{"type": "function", "function": {"name": ...}}',
        "tool_choice",
    )


def check_history(messages: Sequence[Mapping[str, Any]]) -> None:
    """Assistant messages' ``tool_calls`` and tool messages' ``tool_call_id``."""
    for i, message in enumerate(messages):
        if message.get("role") == "tool" and not isinstance(message.get("tool_call_id"), str):
            raise _bad(
                f"messages[{i}].tool_call_id is required for role 'tool'",
                f"messages[{i}].tool_call_id",
            )
        calls = message.get("tool_calls")
        if message.get("role") != "assistant" or calls is None:
            continue
        if not isinstance(calls, list):
            raise _bad(f"messages[{i}].tool_calls must be a list", f"messages[{i}].tool_calls")
        for j, call in enumerate(calls):
            _check_history_call(call, f"messages[{i}].tool_calls[{j}]")


def _check_history_call(call: Any, where: str) -> None:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise _bad(f"{where}.function.name is required", f"{where}.function")
    arguments = function.get("arguments")
    if not isinstance(arguments, str) or not is_json_object(arguments):
        raise _bad(
            f"{where}.function.arguments must be a JSON object's text",
            f"{where}.function.arguments",
        )


@dataclass(slots=True)
class TemplateSupport:
    """What the model's chat template does with tools, found once by rendering probes."""

    renders_tools: bool
    renders_tool_calls: bool


_PROBE_NAME = "infer_probe_function"
_PROBE_TOOL = {
    "type": "function",
    "function": {"name": _PROBE_NAME, "description": "probe", "parameters": NO_PARAMETERS},
}
_PROBE_USER = {"role": "user", "content": "hi"}
_PROBE_CALL = {
    "id": "call_probe",
    "type": "function",
    "function": {"name": _PROBE_NAME, "arguments": {}},
}


async def probe_template(engine: EngineClient) -> TemplateSupport:
    """Whether tools, and past tool calls, change the rendered prompt."""

    async def differs(
        with_: list[dict[str, Any]],
        without: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
    ) -> bool:
        try:
            return await engine.render_chat(with_, tools) != await engine.render_chat(without)
        except Exception:  # a template that refuses the probe does not support it
            return False

    answer = {"role": "assistant", "content": ""}
    return TemplateSupport(
        renders_tools=await differs([_PROBE_USER], [_PROBE_USER], [_PROBE_TOOL]),
        renders_tool_calls=await differs(
            [_PROBE_USER, {**answer, "tool_calls": [_PROBE_CALL]}], [_PROBE_USER, answer]
        ),
    )


class ChatTools:
    """The chat face's tool handling with one output format (the server's parser)."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.format = fmt
        self._support: TemplateSupport | None = None

    async def prepare(
        self, engine: EngineClient, messages: list[dict[str, Any]], request: ToolRequest | None
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """The messages and tools to render: past calls' arguments as objects (what chat
        templates expect), and what the template does not render written in the format."""
        check_history(messages)
        if self._support is None:
            self._support = await probe_template(engine)
        support = self._support
        messages = (
            [_arguments_as_objects(m) for m in messages]
            if support.renders_tool_calls
            else self._history_as_text(messages)
        )
        if request is None or request.choice == "none":
            return messages, None
        if support.renders_tools:
            return messages, request.tools
        return self._with_instructions(messages, request.tools), None

    def _history_as_text(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Past calls in the assistant's text, results as a user turn (consecutive results
        in one), as the model is told to write and read them."""
        out: list[dict[str, Any]] = []
        for message in messages:
            role = message.get("role")
            if role == "assistant" and message.get("tool_calls"):
                calls = _arguments_as_objects(message)["tool_calls"]
                text = self.format.render_calls([c["function"] for c in calls])
                content = message.get("content") or ""
                rest = {k: v for k, v in message.items() if k != "tool_calls"}
                out.append({**rest, "content": f"{content}\n{text}" if content else text})
            elif role == "tool":
                result = self.format.render_result(message["content"])
                if out and out[-1].get("tool_results"):
                    out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n{result}"}
                else:
                    out.append({"role": "user", "content": result, "tool_results": True})
            else:
                out.append(message)
        return [{k: v for k, v in m.items() if k != "tool_results"} for m in out]

    def _with_instructions(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        prompt = self.format.instructions("\n".join(json.dumps(t) for t in tools))
        first = messages[0]
        if first.get("role") in ("system", "developer"):
            return [{**first, "content": f"{first['content']}\n\n{prompt}"}, *messages[1:]]
        return [{"role": "system", "content": prompt}, *messages]

    def parser(self, request: ToolRequest | None) -> StreamingToolParser | None:
        if request is None or request.choice == "none":
            return None
        if request.choice == "auto":
            return self.format.parser(request.names)
        if request.choice == "required":
            return required_parser(request.names)
        return NamedCallParser(request.choice)

    def stream(self, request: ToolRequest | None) -> "ToolStream | None":
        parser = self.parser(request)
        return None if parser is None or request is None else ToolStream(parser, request.parallel)

    def reply(
        self, request: ToolRequest | None, text: str, reason: str | None
    ) -> tuple[ChatMessageOut, str | None]:
        """A whole output as the message: content (None when only calls) and calls."""
        parser = self.parser(request)
        if parser is None or request is None:
            return ChatMessageOut(text), reason
        cut = reason == "length"
        content, calls = parse_all(parser, text, truncated=cut)
        if not calls:
            return ChatMessageOut(text), reason
        calls = calls if request.parallel else calls[:1]
        out = [ToolCallOut(new_call_id(), FunctionCallOut(c.name, c.arguments)) for c in calls]
        # Cut by max_tokens: the complete calls, and the finish reason stays "length".
        return ChatMessageOut(content, tool_calls=out), reason if cut else "tool_calls"


def constrain(params: SamplingParams, request: ToolRequest | None) -> SamplingParams:
    """``required`` and named choices constrain the output to calls of the tools."""
    if request is None or not request.constrained:
        return params
    if request.choice == "required":
        schema = required_schema(request)
    else:
        schema = request.parameters(request.choice)
    return dataclasses.replace(
        params, structured=StructuredOutput("json_schema", json.dumps(schema))
    )


def required_schema(request: ToolRequest) -> dict[str, Any]:
    """vLLM's for ``required``: an array of calls, each a tool's name and arguments."""
    items = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t["function"]["name"]]},
                "parameters": closed(t["function"].get("parameters") or NO_PARAMETERS),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in request.tools
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": items[0] if len(items) == 1 else {"anyOf": items},
    }
    if not request.parallel:
        schema["maxItems"] = 1
    return schema


def tool_texts(request: ToolRequest | None) -> list[str]:
    """The tools as text, counted with the messages against the prompt-size limit."""
    return [] if request is None or request.choice == "none" else [json.dumps(request.tools)]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolStream:
    """One choice's text deltas -> chat deltas: content, and ``tool_calls`` deltas as
    OpenAI sends them (a call's first delta: ``index``, ``id``, ``type``, ``function.name``
    and empty ``arguments``; then argument fragments). Without parallel calls, only the
    first call is sent."""

    def __init__(self, parser: StreamingToolParser, parallel: bool) -> None:
        self._parser = parser
        self._parallel = parallel
        self._ids: dict[int, str] = {}

    def deltas(self, text: str, finished: bool) -> list[ChatDelta]:
        events = self._parser.feed(text) if text else []
        if finished:
            events += self._parser.finish()
        return [d for e in events if (d := self._delta(e)) is not None]

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self._ids else reason

    def _delta(self, event: Event) -> ChatDelta | None:
        if isinstance(event, str):
            return ChatDelta(content=event)
        if event.index > 0 and not self._parallel:
            return None
        return ChatDelta(tool_calls=[self._call_delta(event)])

    def _call_delta(self, event: ToolCallDelta) -> ToolCallDeltaOut:
        if event.name is None:
            return ToolCallDeltaOut(
                event.index, function=FunctionDeltaOut(arguments=event.arguments)
            )
        self._ids[event.index] = new_call_id()
        return ToolCallDeltaOut(
            event.index,
            id=self._ids[event.index],
            type="function",
            function=FunctionDeltaOut(name=event.name, arguments=""),
        )


def _arguments_as_objects(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message whose tool calls' arguments are objects, not JSON text (as vLLM gives
    them to chat templates, which write them with ``tojson``)."""
    calls = message.get("tool_calls")
    if not calls:
        return dict(message)
    return {
        **message,
        "tool_calls": [
            {
                **call,
                "function": {
                    **call["function"],
                    "arguments": json.loads(call["function"]["arguments"]),
                },
            }
            for call in calls
        ],
    }
