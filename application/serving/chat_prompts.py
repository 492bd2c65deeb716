"""A chat as the model sees it: the conversation and its tools rendered through the model's
chat template, and the output constraint that ``tool_choice`` asks for.

Rendering: past tool calls' arguments become objects (what chat templates expect); a
template that knows no tools gets them as a system prompt in the tool format's words, and
the history of calls and results as text in that format. ``tool_choice`` ``none`` leaves
the tools out of the prompt (vLLM renders them anyway unless told not to; a model that is
shown tools it may not call sometimes calls them in text). ``required`` constrains the
output to a JSON array of calls (``[{"name": ..., "parameters": {...}}]``, one at most
without parallel calls) and a named function to that function's arguments object, as vLLM
does.
"""

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from application.serving.tool_parsers import ToolFormat, is_json_object
from domain.errors import InvalidRequestError
from domain.ports import ChatMessage
from domain.sampling import SamplingParams, StructuredOutput

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


def check_history(messages: Sequence[Mapping[str, Any]]) -> None:
    """Assistant messages' ``tool_calls`` and tool messages' ``tool_call_id``."""
    for i, message in enumerate(messages):
        if message.get("role") == "tool" and not isinstance(message.get("tool_call_id"), str):
            raise InvalidRequestError(
                f"messages[{i}].tool_call_id",
                f"messages[{i}].tool_call_id is required for role 'tool'",
            )
        calls = message.get("tool_calls")
        if message.get("role") != "assistant" or calls is None:
            continue
        if not isinstance(calls, list):
            raise InvalidRequestError(
                f"messages[{i}].tool_calls", f"messages[{i}].tool_calls must be a list"
            )
        for j, call in enumerate(calls):
            _check_history_call(call, f"messages[{i}].tool_calls[{j}]")


def _check_history_call(call: Any, where: str) -> None:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidRequestError(f"{where}.function", f"{where}.function.name is required")
    arguments = function.get("arguments")
    if not isinstance(arguments, str) or not is_json_object(arguments):
        raise InvalidRequestError(
            f"{where}.function.arguments",
            f"{where}.function.arguments must be a JSON object's text",
        )


class ChatRenderer(Protocol):
    """What renders a conversation into prompt token ids (the input processor)."""

    async def render_chat(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]: ...


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


async def probe_template(renderer: ChatRenderer) -> TemplateSupport:
    """Whether tools, and past tool calls, change the rendered prompt."""

    async def differs(
        with_: list[dict[str, Any]],
        without: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
    ) -> bool:
        try:
            return await renderer.render_chat(with_, tools) != await renderer.render_chat(without)
        except Exception:  # a template that refuses the probe does not support it
            return False

    answer = {"role": "assistant", "content": ""}
    return TemplateSupport(
        renders_tools=await differs([_PROBE_USER], [_PROBE_USER], [_PROBE_TOOL]),
        renders_tool_calls=await differs(
            [_PROBE_USER, {**answer, "tool_calls": [_PROBE_CALL]}], [_PROBE_USER, answer]
        ),
    )


class ChatPrompts:
    """Conversations rendered by ``renderer``, tools in the server's tool format ``fmt``."""

    def __init__(self, fmt: ToolFormat, renderer: ChatRenderer) -> None:
        self.format, self.renderer = fmt, renderer
        self._support: TemplateSupport | None = None

    async def render(
        self,
        messages: list[dict[str, Any]],
        request: ToolRequest | None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """The prompt's token ids (the history checked first; ``template_kwargs``: more
        variables for the template)."""
        messages, tools = await self.prepare(messages, request)
        return await self.renderer.render_chat(messages, tools, template_kwargs)

    async def prepare(
        self, messages: list[dict[str, Any]], request: ToolRequest | None
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """The messages and tools to render: past calls' arguments as objects (what chat
        templates expect), and what the template does not render written in the format."""
        check_history(messages)
        if self._support is None:
            self._support = await probe_template(self.renderer)
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
