"""A Responses body as the completion service's chat job: one engine path with chat
completions.

The body is translated into chat completions' own wire form (messages, function tools,
``tool_choice``, ``response_format``, ``max_completion_tokens``, ``reasoning_effort`` and
vLLM's sampling fields) and handed to the chat face's ``chat_job``, so rendering, tools,
constraints, sampling and limits are chat's, checked by chat's code; its errors come back
under the Responses names (``text.format``, ``max_output_tokens``, ``tools[0].name``).

The conversation is a list of items (OpenAI's input items, in a canonical form with ids:
what a stored response keeps): messages, ``function_call`` and ``function_call_output``
items and ``reasoning`` items (kept, never shown to the model). Its chat messages: the
``instructions`` as a system message first, each message's text, calls joined to the
assistant turn before them, each call's output as a ``tool`` message.
"""

import dataclasses
import re
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from adapters.http.errors import HTTPError
from adapters.http.openai.params import chat_job
from adapters.http.openai.schemas import ChatCompletionRequest
from adapters.http.responses.schemas import ResponseObject, ResponseRequest
from application.serving.completions import ChatJob
from application.serving.tool_parsers import is_json_object
from domain.responses import StoredResponse

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")
# The documented ``include`` values that change nothing here (the thinking comes back in
# clear, hosted tools are refused); logprobs are not returned, so asking for them is a 400.
HARMLESS_INCLUDES = frozenset(
    {
        "file_search_call.results",
        "web_search_call.results",
        "web_search_call.action.sources",
        "message.input_image.image_url",
        "computer_call_output.output.image_url",
        "code_interpreter_call.outputs",
        "reasoning.encrypted_content",
    }
)
_JSON_SCHEMA_KEYS = ("name", "schema", "strict", "description")
# Chat's field names in its errors -> the Responses body's.
_RENAMES = (
    (re.compile(r"\btools\[(\d+)\]\.function\."), r"tools[\1]."),
    (re.compile(r"\bresponse_format\b"), "text.format"),
    (re.compile(r"\bmax_completion_tokens\b"), "max_output_tokens"),
    (re.compile(r"\breasoning_effort\b"), "reasoning.effort"),
    (re.compile(r"\bmessages\b"), "input"),
)


def new_id(prefix: str) -> str:
    """An item's or response's id, as OpenAI writes them (``resp_…``, ``msg_…``)."""
    return f"{prefix}_{uuid.uuid4().hex}"


def bad(param: str, message: str, code: str | None = None) -> NoReturn:
    raise HTTPError(400, message, "invalid_request_error", param, code)


@dataclass(frozen=True)
class Turn:
    """What one ``POST /v1/responses`` asks: the chat ``job``, the ``conversation`` it
    answers (canonical items: the previous response's conversation and output, then its
    input), and the response object before any output (what the body asked, echoed)."""

    job: ChatJob
    conversation: list[dict[str, Any]]
    skeleton: ResponseObject


def response_turn(
    body: ResponseRequest,
    adapter_id: str | None,
    model: str,
    previous: StoredResponse | None,
    store: bool,
) -> Turn:
    """The body (continuing ``previous``) as a chat job for ``model`` (its served name);
    ``store``: whether the response will be kept."""
    refuse_unsupported(body)
    conversation = [] if previous is None else continued(previous)
    conversation += input_items(body.input)
    if not conversation:
        bad("input", "input is required (a string or a list of items)")
    messages = chat_messages(conversation)
    if body.instructions is not None:
        messages.insert(0, {"role": "system", "content": body.instructions})
    tools = function_tools(body.tools)
    chat = chat_body(body, messages, tools)
    try:
        job = chat_job(chat, adapter_id)
    except HTTPError as e:
        raise renamed(e) from e
    structured_param = "text.format" if job.structured_param == "response_format" else None
    job = dataclasses.replace(
        job,
        max_tokens_param="max_output_tokens",
        structured_param=structured_param or job.structured_param,
    )
    return Turn(job, conversation, skeleton(body, model, tools, store))


def refuse_unsupported(body: ResponseRequest) -> None:
    """The documented fields this server does not do (each a 400 naming it)."""
    for field, is_set, why in (
        ("background", bool(body.background), "background responses are not supported"),
        ("conversation", body.conversation is not None, "use previous_response_id"),
        ("prompt", body.prompt is not None, "stored prompt templates are OpenAI's"),
        ("context_management", body.context_management is not None, "no compaction here"),
        ("moderation", body.moderation is not None, "no moderation here"),
        ("max_tool_calls", body.max_tool_calls is not None, "use parallel_tool_calls"),
        ("top_logprobs", body.top_logprobs is not None, "logprobs are not returned"),
        (
            "truncation",
            body.truncation not in (None, "disabled"),
            "only 'disabled': a conversation longer than the context is a 400",
        ),
    ):
        if is_set:
            bad(field, f"`{field}` is not supported by this server: {why}")
    for i, value in enumerate(body.include or ()):
        if value not in HARMLESS_INCLUDES:
            why = (
                "logprobs are not returned"
                if value == "message.output_text.logprobs"
                else f"unknown value {value!r}"
            )
            bad(f"include[{i}]", f"include[{i}]: {why}")
    if body.stream_options is not None and not body.stream:
        bad("stream_options", "`stream_options` is only allowed when `stream` is true")


def continued(previous: StoredResponse) -> list[dict[str, Any]]:
    """The conversation a continuation of ``previous`` starts from."""
    return [*previous.conversation, *previous.response.get("output", [])]


# --- input items ----------------------------------------------------------------------


def input_items(value: str | list[Any] | None) -> list[dict[str, Any]]:
    """``input`` as canonical items (a string is one user message)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [_message("user", [value], None)]
    return [_item(item, f"input[{i}]") for i, item in enumerate(value)]


def _item(item: Any, where: str) -> dict[str, Any]:
    if not isinstance(item, dict):
        bad(where, f"{where} must be an object")
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        role = item.get("role")
        if role not in ROLES:
            bad(f"{where}.role", f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}")
        return _message(role, _texts(item.get("content"), f"{where}.content"), item.get("id"))
    if kind == "function_call":
        for key in ("call_id", "name", "arguments"):
            if not isinstance(item.get(key), str):
                bad(f"{where}.{key}", f"{where}.{key} must be a string")
        if not is_json_object(item["arguments"]):
            bad(f"{where}.arguments", f"{where}.arguments must be a JSON object's text")
        return {
            "type": "function_call",
            "id": _id(item, "fc"),
            "call_id": item["call_id"],
            "name": item["name"],
            "arguments": item["arguments"],
            "status": "completed",
        }
    if kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            bad(f"{where}.call_id", f"{where}.call_id must be a string")
        output = item.get("output")
        _output_text(output, f"{where}.output")
        return {
            "type": "function_call_output",
            "id": _id(item, "fco"),
            "call_id": item["call_id"],
            "output": output,
            "status": "completed",
        }
    if kind == "reasoning":  # kept in the conversation, never shown to the model
        return {**item, "id": _id(item, "rs")}
    if kind == "item_reference":
        bad(f"{where}.type", f"{where}: item references are not supported; send the item")
    bad(
        f"{where}.type",
        f"{where}.type {kind!r} is not supported: items are messages, function_call, "
        "function_call_output and reasoning",
    )


def _id(item: dict[str, Any], prefix: str) -> str:
    given = item.get("id")
    return given if isinstance(given, str) and given else new_id(prefix)


def _message(role: str, texts: list[str], given_id: Any) -> dict[str, Any]:
    part = "output_text" if role == "assistant" else "input_text"
    extra: dict[str, Any] = {"annotations": []} if role == "assistant" else {}
    return {
        "type": "message",
        "id": given_id if isinstance(given_id, str) and given_id else new_id("msg"),
        "role": role,
        "content": [{"type": part, "text": text, **extra} for text in texts],
        "status": "completed",
    }


def _texts(content: Any, where: str) -> list[str]:
    """A message's content: a string, or text parts (``refusal`` parts read as text)."""
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        bad(where, f"{where} must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        key = "refusal" if kind == "refusal" else "text"
        if kind not in (*TEXT_PARTS, "refusal") or not isinstance(part.get(key), str):
            bad(
                f"{where}[{j}]",
                f"{where}[{j}]: only text content is supported (input_text, output_text), "
                f"got {kind!r}",
            )
        texts.append(part[key])
    return texts


def _output_text(output: Any, where: str) -> str:
    """A call's output: a string, or text parts."""
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        return "".join(_texts(output, where))
    bad(where, f"{where} must be a string or a list of text parts")


def chat_messages(items: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Canonical items as chat messages: calls join the assistant turn before them (or
    make one), outputs are tool messages, reasoning is left out."""
    messages: list[dict[str, Any]] = []
    for item in items:
        kind = item["type"]
        if kind == "message":
            text = "".join(part.get("text", part.get("refusal", "")) for part in item["content"])
            messages.append({"role": item["role"], "content": text})
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            content = _output_text(item["output"], "input")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": content})
    return messages


# --- tools, formats, the chat body ----------------------------------------------------


def function_tools(tools: list[Any] | None) -> list[dict[str, Any]]:
    """Responses' flat function tools, checked for their type (hosted tools are OpenAI's:
    a 400 naming ``tools[i].type``); the rest of the check is chat's."""
    checked = []
    for i, tool in enumerate(tools or ()):
        if not isinstance(tool, dict):
            bad(f"tools[{i}]", f"tools[{i}] must be an object")
        kind = tool.get("type")
        if kind != "function":
            bad(
                f"tools[{i}].type",
                f"tools[{i}].type {kind!r} is not supported: this server runs function tools "
                "only (hosted tools such as web_search, file_search, code_interpreter, "
                "computer_use, mcp and image_generation are not available)",
            )
        checked.append(tool)
    return checked


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    function = {
        key: tool[key]
        for key in ("name", "description", "parameters", "strict")
        if tool.get(key) is not None
    }
    if "name" in tool and "name" not in function:
        function["name"] = tool["name"]
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any] | None, has_tools: bool) -> Any:
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            bad(
                "tool_choice",
                f"tool_choice type {choice.get('type')!r} is not supported: use 'none', "
                '\'auto\', \'required\' or {"type": "function", "name": ...}',
            )
        if not isinstance(choice.get("name"), str):
            bad("tool_choice", "tool_choice.name must be the name of a function in tools")
        return {"type": "function", "function": {"name": choice["name"]}}
    if not has_tools and choice in ("auto", "none"):
        return None  # nothing to choose from: as without it
    return choice


def _chat_format(text_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` in chat's ``response_format`` shape (its checks are chat's)."""
    if text_format is None or text_format.get("type") != "json_schema":
        return text_format
    extra = sorted(set(text_format) - {"type", *_JSON_SCHEMA_KEYS})
    if extra:
        bad("text.format", f"text.format: unknown or unsupported key {extra[0]!r}")
    for key in ("name", "schema"):  # both required here (chat's json_schema.schema is not)
        if key not in text_format:
            param = f"text.format.{key}"
            bad(param, f"Missing required parameter: '{param}'.", "missing_required_parameter")
    spec = {key: text_format[key] for key in _JSON_SCHEMA_KEYS if key in text_format}
    return {"type": "json_schema", "json_schema": spec}


def chat_body(
    body: ResponseRequest, messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> ChatCompletionRequest:
    """The body as chat completions' (what ``chat_job`` takes)."""
    text, reasoning = body.text, body.reasoning
    return ChatCompletionRequest(
        model=body.model,
        messages=messages,
        max_completion_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        stop=body.stop,
        stop_token_ids=body.stop_token_ids,
        seed=body.seed,
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
        logit_bias=body.logit_bias,
        priority=body.priority,
        cache_salt=body.cache_salt,
        user=body.user,
        metadata=body.metadata,
        tools=[_chat_tool(t) for t in tools] or None,
        tool_choice=_chat_tool_choice(body.tool_choice, bool(tools)),
        parallel_tool_calls=body.parallel_tool_calls if tools else None,
        response_format=_chat_format(text.format if text is not None else None),
        reasoning_effort=reasoning.effort if reasoning is not None else None,
        chat_template_kwargs=body.chat_template_kwargs,
    )


def renamed(e: HTTPError) -> HTTPError:
    """A chat error under the Responses body's names."""

    def rename(text: str) -> str:
        for pattern, name in _RENAMES:
            text = pattern.sub(name, text)
        return text

    param = None if e.param is None else rename(e.param)
    return HTTPError(e.status, rename(e.message), e.kind, param, e.code, e.headers)


def skeleton(
    body: ResponseRequest, model: str, tools: list[dict[str, Any]], store: bool
) -> ResponseObject:
    """The response before its output: what the body asked, echoed as OpenAI does."""
    text = body.text
    reasoning = body.reasoning
    return ResponseObject(
        id=new_id("resp"),
        created_at=int(time.time()),
        model=model,
        status="in_progress",
        output=[],
        instructions=body.instructions,
        max_output_tokens=body.max_output_tokens,
        metadata=dict(body.metadata or {}),
        parallel_tool_calls=body.parallel_tool_calls is not False,
        previous_response_id=body.previous_response_id,
        reasoning={
            "effort": reasoning.effort if reasoning else None,
            "summary": (reasoning.summary or reasoning.generate_summary) if reasoning else None,
        },
        store=store,
        temperature=1.0 if body.temperature is None else body.temperature,
        text={
            "format": (text.format if text and text.format else None) or {"type": "text"},
            "verbosity": (text.verbosity if text else None) or "medium",
        },
        tool_choice=body.tool_choice if body.tool_choice is not None else "auto",
        tools=[
            {
                "type": "function",
                "name": t.get("name"),
                "description": t.get("description"),
                "parameters": t.get("parameters"),
                "strict": t.get("strict"),
            }
            for t in tools
        ],
        top_p=1.0 if body.top_p is None else body.top_p,
        user=body.user,
    )
