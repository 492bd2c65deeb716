"""The Messages face's request checks: an Anthropic body translated into the chat
completion it asks for, then into the completion service's job by the OpenAI face's own
``chat_job`` — one copy of the sampling parameters, tools, ``tool_choice`` constraints,
structured output and template variables.

What is translated:

- ``system`` (a string or text blocks) -> a system message first;
- ``messages``: ``user`` / ``assistant`` turns; text blocks joined with a blank line;
  ``tool_use`` blocks -> the assistant's ``tool_calls``; ``tool_result`` blocks -> tool
  messages (before the turn's text; ``is_error`` prefixes the result with ``Error:``);
  ``thinking`` / ``redacted_thinking`` blocks dropped (the templates drop past thinking
  too); ``image`` / ``document`` and other blocks refused (a text model);
- ``tools`` (client tools: ``name``, ``description``, ``input_schema``) -> functions;
  ``tool_choice`` ``auto`` / ``any`` / ``tool`` / ``none`` -> ``auto`` / ``required`` /
  the named function / ``none``; ``disable_parallel_tool_use`` -> one call at most;
- ``thinking`` ``enabled`` / ``disabled`` -> the template's ``enable_thinking`` true /
  false (``adaptive``: the template's default);
- ``output_config.format`` (a JSON schema) -> the output constrained to it;
- ``stop_sequences``, ``temperature`` (0..1), ``top_p``, ``top_k``, ``max_tokens``;
  ``metadata.user_id`` -> the request's logged user;
- ignored: ``cache_control`` (the prefix cache is automatic), ``context_management``
  (nothing is cleared server-side), ``service_tier``, ``speed``, ``inference_geo``,
  ``diagnostics``, ``user_profile_id``, ``workspace_id``, ``output_config.effort``,
  ``thinking.budget_tokens``, and the tools' ``strict``, ``cache_control``,
  ``input_examples`` and other options; refused: server tools, ``mcp_servers``,
  ``container``, and a final assistant message (a prefill: the template would open a
  new turn after it, not continue it).

Errors are :class:`HTTPError` 400s (the router writes them in Anthropic's format).
"""

import dataclasses
import json
from typing import Any, TypeVar

import msgspec
from litestar import Request

from adapters.http.anthropic.schemas import MessageParam, MessagesRequest, PromptBody
from adapters.http.errors import HTTPError, check_content_type, decode_json
from adapters.http.openai.params import chat_job
from adapters.http.openai.schemas import ChatCompletionRequest
from adapters.http.openai.tools import NAME
from application.serving.completions import ChatJob

B = TypeVar("B", bound=PromptBody)
TOOL_KEYS = {
    "name",
    "description",
    "input_schema",
    "type",
    # accepted, ignored
    "cache_control",
    "strict",
    "defer_loading",
    "eager_input_streaming",
    "input_examples",
    "allowed_callers",
}
# What one text block's text is joined to the next with.
BLOCK_SEPARATOR = "\n\n"


def bad(message: str) -> HTTPError:
    return HTTPError(400, message, "invalid_request_error")


def decode_body(decoder: msgspec.json.Decoder[B], request: Request[Any, Any, Any], raw: bytes) -> B:
    """The JSON body; msgspec's refusals as Anthropic words them (``max_tokens: Field
    required``, ``foo: Extra inputs are not permitted``)."""
    check_content_type(request)
    return decode_json(decoder, raw, _invalid)


def _invalid(message: str) -> HTTPError:
    path = ""
    if " - at `$" in message:
        message, _, at = message.partition(" - at `$")
        path = _dotted(at.rstrip("`").lstrip("."))
    if message.startswith("Object missing required field `"):
        field = message.split("`")[1]
        return bad(f"{_join(path, field)}: Field required")
    if message.startswith("Object contains unknown field `"):
        field = message.split("`")[1]
        return bad(f"{_join(path, field)}: Extra inputs are not permitted")
    return bad(f"{path}: {message}" if path else message)


def _dotted(path: str) -> str:
    """msgspec's ``messages[0].content`` as Anthropic writes it: ``messages.0.content``."""
    return path.replace("[", ".").replace("]", "")


def _join(path: str, field: str) -> str:
    return f"{path}.{field}" if path else field


def messages_job(body: MessagesRequest, adapter_id: str | None) -> ChatJob:
    """``POST /v1/messages``' body as the completion service's job."""
    _refuse(body)
    if body.container is not None:
        raise bad("container: code execution containers are not supported by this server")
    if body.max_tokens < 1:
        raise bad("max_tokens: Input should be greater than or equal to 1")
    for field, value, low, high in (
        ("temperature", body.temperature, 0.0, 1.0),
        ("top_p", body.top_p, 0.0, 1.0),
    ):
        if value is not None and not low <= value <= high:
            raise bad(f"{field}: Input should be between {low:g} and {high:g}")
    if body.top_k is not None and body.top_k < 0:
        raise bad("top_k: Input should be greater than or equal to 0")
    chat = _chat(
        body,
        max_tokens=body.max_tokens,
        stop=body.stop_sequences,
        stream=bool(body.stream),
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        user=user(body),
    )
    return _job(chat, adapter_id)


def prompt_job(body: PromptBody, adapter_id: str | None) -> ChatJob:
    """``/v1/messages/count_tokens``' body: the job whose prompt is counted."""
    _refuse(body)
    return _job(_chat(body), adapter_id)


def user(body: MessagesRequest) -> str | None:
    value = (body.metadata or {}).get("user_id")
    if value is not None and not isinstance(value, str):
        raise bad("metadata.user_id: Input should be a valid string")
    return value


def _refuse(body: PromptBody) -> None:
    if body.mcp_servers is not None:
        raise bad("mcp_servers: MCP servers are not supported by this server")


def _job(chat: ChatCompletionRequest, adapter_id: str | None) -> ChatJob:
    job = chat_job(chat, adapter_id)
    if chat.response_format is not None and job.structured_param != "tools":
        job = dataclasses.replace(job, structured_param="output_config.format")
    return job


def _chat(body: PromptBody, **sampling: Any) -> ChatCompletionRequest:
    """The chat completion ``body`` asks for (``sampling``: its sampling fields)."""
    tools = _tools(body.tools)
    choice, parallel = _tool_choice(body.tool_choice, tools)
    return ChatCompletionRequest(
        model=body.model,
        messages=[*_system(body.system), *_messages(body.messages)],
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        response_format=_response_format(body.output_config),
        chat_template_kwargs=_thinking(body.thinking),
        **sampling,
    )


def _system(system: str | list[Any] | None) -> list[dict[str, Any]]:
    if system is None:
        return []
    text = system if isinstance(system, str) else _texts(system, "system")
    return [{"role": "system", "content": text}]


def _texts(blocks: list[Any], where: str) -> str:
    """Text blocks' texts, joined (any other block: a 400)."""
    texts = []
    for i, block in enumerate(blocks):
        kind = _kind(block, f"{where}.{i}")
        if kind != "text":
            _refuse_block(kind, f"{where}.{i}")
        texts.append(_text(block, f"{where}.{i}"))
    return BLOCK_SEPARATOR.join(texts)


def _kind(block: Any, where: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise bad(f"{where}: a content block is an object with a `type`")
    return str(block["type"])


def _text(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise bad(f"{where}.text: Field required")
    return text


def _refuse_block(kind: str, where: str) -> None:
    if kind in ("image", "document", "search_result"):
        raise bad(f"{where}: `{kind}` content is not supported by this server (a text model)")
    raise bad(f"{where}: content blocks of type `{kind}` are not supported here")


def _messages(messages: list[MessageParam]) -> list[dict[str, Any]]:
    if not messages:
        raise bad("messages: at least one message is required")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        where = f"messages.{i}"
        if message.role == "user":
            out += _user(message.content, where)
        elif message.role == "assistant":
            if i == len(messages) - 1:
                raise bad(
                    f"{where}: a final assistant message (a prefill to continue) is not "
                    "supported by this server"
                )
            out.append(_assistant(message.content, where))
        else:
            raise bad(f"{where}.role: Input should be 'user' or 'assistant'")
    return out


def _user(content: str | list[Any], where: str) -> list[dict[str, Any]]:
    """A user turn: its tool results as tool messages, then its text (if any)."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    out, texts = [], []
    for j, block in enumerate(content):
        at = f"{where}.content.{j}"
        kind = _kind(block, at)
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "tool_result":
            out.append(_tool_result(block, at))
        else:
            _refuse_block(kind, at)
    if texts or not out:
        out.append({"role": "user", "content": BLOCK_SEPARATOR.join(texts)})
    return out


def _tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str):
        raise bad(f"{where}.tool_use_id: Field required")
    content = block.get("content", "")
    if isinstance(content, list):
        content = _texts(content, f"{where}.content")
    elif not isinstance(content, str):
        raise bad(f"{where}.content: a string or text blocks")
    if block.get("is_error"):
        content = f"Error: {content}"
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def _assistant(content: str | list[Any], where: str) -> dict[str, Any]:
    """An assistant turn: its text, its tool calls; its thinking dropped."""
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    texts, calls = [], []
    for j, block in enumerate(content):
        at = f"{where}.content.{j}"
        kind = _kind(block, at)
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "tool_use":
            calls.append(_tool_use(block, at))
        elif kind not in ("thinking", "redacted_thinking"):
            _refuse_block(kind, at)
    message: dict[str, Any] = {"role": "assistant", "content": BLOCK_SEPARATOR.join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message


def _tool_use(block: dict[str, Any], where: str) -> dict[str, Any]:
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input")
    if not isinstance(call_id, str):
        raise bad(f"{where}.id: Field required")
    if not isinstance(name, str):
        raise bad(f"{where}.name: Field required")
    if not isinstance(arguments, dict):
        raise bad(f"{where}.input: Input should be an object")
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }


def _tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """Client tools as functions (server tools refused)."""
    if not tools:
        return None  # an empty list: no tools
    functions = []
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(tool, dict):
            raise bad(f"{where}: a tool is an object")
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise bad(
                f"{where}.type: tools of type {kind!r} are not supported by this server "
                "(client tools only: name, description, input_schema)"
            )
        if extra := sorted(set(tool) - TOOL_KEYS):
            raise bad(f"{where}.{extra[0]}: Extra inputs are not permitted")
        name = tool.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise bad(f"{where}.name: String should match pattern '{NAME.pattern}'")
        description = tool.get("description", "")
        if not isinstance(description, str):
            raise bad(f"{where}.description: Input should be a valid string")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict) or schema.get("type") != "object":
            raise bad(f"{where}.input_schema: a JSON schema of type 'object' is required")
        function: dict[str, Any] = {"name": name, "parameters": schema}
        if description:
            function["description"] = description
        functions.append({"type": "function", "function": function})
    return functions


CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def _tool_choice(
    choice: dict[str, Any] | None, tools: list[dict[str, Any]] | None
) -> tuple[Any, bool | None]:
    """``tool_choice`` as chat's (and whether calls may come in parallel: None, the
    default)."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    keys = {"type", "disable_parallel_tool_use"} | ({"name"} if kind == "tool" else set())
    if extra := sorted(set(choice) - keys):
        raise bad(f"tool_choice.{extra[0]}: Extra inputs are not permitted")
    disable = choice.get("disable_parallel_tool_use")
    if disable is not None and not isinstance(disable, bool):
        raise bad("tool_choice.disable_parallel_tool_use: Input should be a valid boolean")
    if kind in ("auto", "none") and tools is None:
        return None, None  # nothing to choose from
    if tools is None:
        raise bad(f"tool_choice: {kind!r} needs tools")
    parallel = None if not disable else False
    if kind in CHOICES:
        return CHOICES[kind], parallel
    if kind == "tool":
        name = choice.get("name")
        names = [t["function"]["name"] for t in tools]
        if name not in names:
            raise bad(f"tool_choice.name: {name!r} is not one of the tools")
        return {"type": "function", "function": {"name": name}}, parallel
    raise bad("tool_choice.type: Input should be 'auto', 'any', 'tool' or 'none'")


def _thinking(thinking: dict[str, Any] | None) -> dict[str, Any] | None:
    """``thinking`` as the chat template's ``enable_thinking`` (Qwen3's switch)."""
    if thinking is None:
        return None
    kind = thinking.get("type")
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
            raise bad("thinking.budget_tokens: Input should be a positive integer")
        return {"enable_thinking": True}
    if kind == "disabled":
        return {"enable_thinking": False}
    if kind == "adaptive":
        return None
    raise bad("thinking.type: Input should be 'enabled', 'disabled' or 'adaptive'")


def _response_format(config: dict[str, Any] | None) -> dict[str, Any] | None:
    """``output_config.format`` (``{"type": "json_schema", "schema"}``) as chat's
    ``response_format``; ``effort`` is ignored."""
    if config is None:
        return None
    if extra := sorted(set(config) - {"format", "effort"}):
        raise bad(f"output_config.{extra[0]}: Extra inputs are not permitted")
    found = config.get("format")
    if found is None:
        return None
    if (
        not isinstance(found, dict)
        or found.get("type") != "json_schema"
        or not isinstance(found.get("schema"), dict)
        or set(found) - {"type", "schema"}
    ):
        raise bad('output_config.format: {"type": "json_schema", "schema": {...}} expected')
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": found["schema"]}}
