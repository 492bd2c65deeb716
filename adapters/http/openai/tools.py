"""Tools on /v1/chat/completions, on the wire: the request's tools and ``tool_choice``
checked (as a :class:`~application.serving.chat_prompts.ToolRequest`, which the completion service
renders and constrains), and the output parsed into ``tool_calls``, whole or streamed.

``tool_choice``: ``none`` parses nothing; ``auto`` (the default with tools) parses calls
with the server's parser; ``required`` and a named function parse the JSON their
constraint makes the model write. The legacy ``functions`` / ``function_call`` stay
refused.
"""

import re
import uuid
from typing import Any

from adapters.http.errors import HTTPError
from adapters.http.openai.schemas import (
    ChatCompletionRequest,
    FunctionDeltaOut,
    ToolCallDeltaOut,
)
from application.serving.chat_output import tool_parser
from application.serving.chat_prompts import ToolRequest
from application.serving.tool_parsers import StreamingToolParser, ToolCallDelta, ToolFormat

NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names
CHOICES = ("none", "auto", "required")


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


class ToolReplies:
    """Tool calls read from the model's output in the server's tool format."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.format = fmt

    def parser(self, request: ToolRequest | None) -> StreamingToolParser | None:
        return tool_parser(self.format, request)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class CallIds:
    """A streamed choice's call ids: OpenAI's first delta of a call carries ``index``,
    ``id``, ``type``, ``function.name`` and empty ``arguments``; later ones argument
    fragments only."""

    def __init__(self) -> None:
        self._ids: dict[int, str] = {}

    def delta(self, event: ToolCallDelta) -> ToolCallDeltaOut:
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
