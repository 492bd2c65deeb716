"""Anthropic Messages API wire types: the bodies of ``POST /v1/messages`` and
``/v1/messages/count_tokens``, the reply (a message and its content blocks) and the
events of a streamed reply.

Every documented top-level request field is declared, so a field we do not support is
refused by name (400) and one that exists nowhere is refused as an extra input (400), as
the Anthropic API does. Content blocks, tools and options are read as objects
(``params.py`` checks what it uses and ignores keys it does not read, such as
``cache_control``).
"""

from typing import Any

import msgspec


class MessageParam(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    content: str | list[Any]


class PromptBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """What both endpoints take: the conversation, its tools and the thinking switch."""

    model: str
    messages: list[MessageParam]
    system: str | list[Any] | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # format: a JSON schema; effort: ignored
    # Accepted and ignored: prompt caching is automatic here (the prefix cache), nothing is
    # cleared from the context server-side, and the rest picks Anthropic's capacity,
    # region or accounts.
    cache_control: dict[str, Any] | None = None
    context_management: dict[str, Any] | None = None
    speed: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    mcp_servers: list[Any] | None = None  # refused: no server-side MCP calls


class MessagesRequest(PromptBody, kw_only=True):
    max_tokens: int  # required, as Anthropic requires it
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None  # user_id: logged as the request's user
    service_tier: str | None = None  # ignored
    inference_geo: str | None = None  # ignored
    diagnostics: dict[str, Any] | None = None  # ignored
    container: Any = None  # refused: no code execution containers


class CountTokensRequest(PromptBody, kw_only=True):
    pass


# --- the reply -----------------------------------------------------------------------


class TextBlock(msgspec.Struct, tag="text", tag_field="type"):
    text: str


class ThinkingBlock(msgspec.Struct, tag="thinking", tag_field="type"):
    thinking: str
    signature: str = ""  # nothing to verify: thinking sent back is dropped anyway


class ToolUseBlock(msgspec.Struct, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: dict[str, Any]


ContentBlock = TextBlock | ThinkingBlock | ToolUseBlock


class Usage(msgspec.Struct):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class Message(msgspec.Struct, tag="message", tag_field="type"):
    id: str
    model: str
    content: list[ContentBlock]
    stop_reason: str | None
    stop_sequence: str | None
    usage: Usage
    role: str = "assistant"


class TokenCount(msgspec.Struct):
    input_tokens: int


# --- the stream's events -------------------------------------------------------------


class MessageStart(msgspec.Struct, tag="message_start", tag_field="type"):
    message: Message


class BlockStart(msgspec.Struct, tag="content_block_start", tag_field="type"):
    index: int
    content_block: ContentBlock


class TextDelta(msgspec.Struct, tag="text_delta", tag_field="type"):
    text: str


class ThinkingDelta(msgspec.Struct, tag="thinking_delta", tag_field="type"):
    thinking: str


class SignatureDelta(msgspec.Struct, tag="signature_delta", tag_field="type"):
    signature: str = ""


class InputJsonDelta(msgspec.Struct, tag="input_json_delta", tag_field="type"):
    partial_json: str


class BlockDelta(msgspec.Struct, tag="content_block_delta", tag_field="type"):
    index: int
    delta: TextDelta | ThinkingDelta | SignatureDelta | InputJsonDelta


class BlockStop(msgspec.Struct, tag="content_block_stop", tag_field="type"):
    index: int


class MessageEnd(msgspec.Struct):
    stop_reason: str | None
    stop_sequence: str | None


class MessageDelta(msgspec.Struct, tag="message_delta", tag_field="type"):
    delta: MessageEnd
    usage: Usage


class MessageStop(msgspec.Struct, tag="message_stop", tag_field="type"):
    pass


class ErrorDetail(msgspec.Struct):
    type: str
    message: str


class ErrorBody(msgspec.Struct, tag="error", tag_field="type"):
    error: ErrorDetail


Event = MessageStart | BlockStart | BlockDelta | BlockStop | MessageDelta | MessageStop | ErrorBody
