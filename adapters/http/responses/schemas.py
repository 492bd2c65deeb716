"""The Responses API's wire types (``POST /v1/responses`` and the stored responses' routes).

Every documented request field is declared, so a known-but-unsupported field is refused by
name (400) and an undocumented one as unrecognized (400), as on the chat face. Input items,
tools and formats stay JSON objects here: ``params.py`` checks them, naming the failing
field (``input[2].call_id``). The reply types follow the openai SDK's
``openai.types.responses`` models field for field.
"""

from typing import Any

import msgspec


class TextParams(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    format: dict[str, Any] | None = None  # text, json_object, json_schema (flat)
    verbosity: str | None = None  # low, medium, high: accepted, no effect


class ReasoningParams(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    effort: str | None = None  # none, minimal, low, medium, high
    summary: str | None = None  # accepted; the thinking comes back whole, not summarized
    generate_summary: str | None = None  # the deprecated name of summary
    context: str | None = None
    mode: str | None = None


class ResponseRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None  # optional, as in vLLM: the served model
    input: str | list[Any] | None = None
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextParams | None = None
    reasoning: ReasoningParams | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    truncation: str | None = None
    include: list[str] | None = None
    background: bool | None = None
    background_options: dict[str, Any] | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    context_management: list[Any] | None = None
    moderation: dict[str, Any] | None = None
    access_programs: dict[str, Any] | None = None
    image: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    # vLLM's sampling extensions, as on the chat face (the openai SDK's ``extra_body``)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    logit_bias: dict[str, float] | None = None
    priority: int | None = None
    cache_salt: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


# --- replies ---------------------------------------------------------------------------


class ReasoningText(msgspec.Struct, tag_field="type", tag="reasoning_text"):
    text: str


class OutputText(msgspec.Struct, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[Any] = msgspec.field(default_factory=list)


class ReasoningItem(msgspec.Struct, tag_field="type", tag="reasoning"):
    id: str
    summary: list[Any] = msgspec.field(default_factory=list)
    content: list[ReasoningText] = msgspec.field(default_factory=list)
    status: str = "completed"


class MessageItem(msgspec.Struct, tag_field="type", tag="message"):
    id: str
    status: str = "completed"
    role: str = "assistant"
    content: list[OutputText] = msgspec.field(default_factory=list)


class FunctionCallItem(msgspec.Struct, tag_field="type", tag="function_call"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str = "completed"


OutputItem = ReasoningItem | MessageItem | FunctionCallItem
Part = ReasoningText | OutputText


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = msgspec.field(default_factory=InputTokensDetails)
    output_tokens_details: OutputTokensDetails = msgspec.field(default_factory=OutputTokensDetails)


class IncompleteDetails(msgspec.Struct):
    reason: str


class ResponseError(msgspec.Struct):
    code: str
    message: str


class ResponseObject(msgspec.Struct, kw_only=True):
    """The response: what the request asked (echoed), its output items and usage."""

    id: str
    created_at: int
    model: str
    status: str  # in_progress, completed, incomplete, failed
    output: list[OutputItem]
    object: str = "response"
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] = msgspec.field(default_factory=dict)
    store: bool = True
    temperature: float = 1.0
    text: dict[str, Any] = msgspec.field(default_factory=dict)
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = msgspec.field(default_factory=list)
    top_p: float = 1.0
    truncation: str = "disabled"
    background: bool = False
    service_tier: str = "default"
    usage: ResponseUsage | None = None
    user: str | None = None


class DeletedResponse(msgspec.Struct):
    id: str
    object: str = "response"
    deleted: bool = True


class InputItemList(msgspec.Struct):
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool
    object: str = "list"


# --- stream events (each with its ``sequence_number``; its name is its ``type``) ---------


class ResponseEvent(msgspec.Struct, tag_field="type", tag="response.created"):
    response: ResponseObject
    sequence_number: int = 0


class InProgress(ResponseEvent, tag="response.in_progress"):
    pass


class Completed(ResponseEvent, tag="response.completed"):
    pass


class Incomplete(ResponseEvent, tag="response.incomplete"):
    pass


class Failed(ResponseEvent, tag="response.failed"):
    pass


class ItemAdded(msgspec.Struct, tag_field="type", tag="response.output_item.added"):
    output_index: int
    item: OutputItem
    sequence_number: int = 0


class ItemDone(ItemAdded, tag="response.output_item.done"):
    pass


class PartAdded(msgspec.Struct, tag_field="type", tag="response.content_part.added"):
    item_id: str
    output_index: int
    content_index: int
    part: Part
    sequence_number: int = 0


class PartDone(PartAdded, tag="response.content_part.done"):
    pass


class TextDelta(msgspec.Struct, tag_field="type", tag="response.output_text.delta"):
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = msgspec.field(default_factory=list)
    sequence_number: int = 0


class TextDone(msgspec.Struct, tag_field="type", tag="response.output_text.done"):
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = msgspec.field(default_factory=list)
    sequence_number: int = 0


class ReasoningDelta(msgspec.Struct, tag_field="type", tag="response.reasoning_text.delta"):
    item_id: str
    output_index: int
    content_index: int
    delta: str
    sequence_number: int = 0


class ReasoningDone(msgspec.Struct, tag_field="type", tag="response.reasoning_text.done"):
    item_id: str
    output_index: int
    content_index: int
    text: str
    sequence_number: int = 0


class ArgumentsDelta(
    msgspec.Struct, tag_field="type", tag="response.function_call_arguments.delta"
):
    item_id: str
    output_index: int
    delta: str
    sequence_number: int = 0


class ArgumentsDone(msgspec.Struct, tag_field="type", tag="response.function_call_arguments.done"):
    item_id: str
    output_index: int
    name: str
    arguments: str
    sequence_number: int = 0


StreamEvent = (
    ResponseEvent
    | ItemAdded
    | PartAdded
    | TextDelta
    | TextDone
    | ReasoningDelta
    | ReasoningDone
    | ArgumentsDelta
    | ArgumentsDone
)
