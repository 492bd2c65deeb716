"""OpenAI wire types for /v1/completions and /v1/chat/completions (requests and replies).

Every documented request field is declared, so a known-but-unsupported field can be
refused by name (400) while an undocumented one is refused as unrecognized (400), as the
OpenAI API does.
"""

from typing import Any

import msgspec


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # we never add obfuscation padding
    # vLLM's: with include_usage, every chunk carries the usage so far
    continuous_usage_stats: bool | None = None


class _Sampling(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None  # optional, as in vLLM: the served model
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    # vLLM's sampling extensions (sent by its clients and benchmarks as extra body fields)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    n: int | None = None
    user: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    priority: int | None = None  # vLLM's: lower runs earlier (default 0), may preempt
    min_tokens: int | None = None  # vLLM's: no EOS / stop id before this many tokens
    # vLLM's: prefix-cache blocks are shared only between requests with the same salt
    cache_salt: str | None = None
    # Structured outputs (adapters/http/openai_structured.py): vLLM's, then its older names.
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    # vLLM's request extras: the token ids in the reply, words never generated, the
    # prompt's last N tokens kept (-1: the context), the stop string kept, and the prompt
    # tokens' logprobs (N alternatives each).
    return_token_ids: bool | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    include_stop_str_in_output: bool | None = None
    prompt_logprobs: int | None = None


class CompletionRequest(_Sampling, kw_only=True):
    prompt: str | list[Any]  # a string, strings, token ids, or lists of token ids
    logprobs: int | None = None  # how many alternatives (0: the chosen token's only)
    best_of: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    response_format: dict[str, Any] | None = None  # vLLM's: as chat's


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: list[dict[str, Any]]
    logprobs: bool | None = None
    max_completion_tokens: int | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: Any = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None  # "none": the template's thinking switched off
    verbosity: str | None = None
    # vLLM's: more variables for the chat template (e.g. {"enable_thinking": false})
    chat_template_kwargs: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    service_tier: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0  # the prompt's tokens found in the prefix cache


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | msgspec.UnsetType = msgspec.UNSET

    @classmethod
    def of(cls, prompt: int, completion: int, cached: int) -> "Usage":
        return cls(prompt, completion, prompt + completion, PromptTokensDetails(cached))


class CompletionLogprobs(msgspec.Struct):
    """The legacy shape: per token its string, logprob, top alternatives (string ->
    logprob; None for the echoed prompt's first token) and offset in the text."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(msgspec.Struct):
    """vLLM's prompt logprob entry: the token's logprob, its rank (1: the most likely) and
    its string."""

    logprob: float
    rank: int
    decoded_token: str


# vLLM's ``prompt_logprobs``: None for the first prompt token, then per token its id (as a
# string) and the alternatives' -> PromptLogprob.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id hit
    # vLLM's, when asked (``return_token_ids``, ``prompt_logprobs``); left out otherwise.
    prompt_token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET
    prompt_logprobs: PromptLogprobs | msgspec.UnsetType = msgspec.UNSET


class Completion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: str = "text_completion"
    system_fingerprint: None = None


class FunctionCallOut(msgspec.Struct):
    name: str
    arguments: str  # a JSON object's text


class ToolCallOut(msgspec.Struct):
    id: str
    function: FunctionCallOut
    type: str = "function"


class ChatMessageOut(msgspec.Struct):
    content: str | None  # None: the message only calls tools
    role: str = "assistant"
    refusal: None = None
    tool_calls: list[ToolCallOut] | msgspec.UnsetType = msgspec.UNSET  # left out when none
    # A thinking model's thinking (vLLM's two names); left out when it did not think.
    reasoning_content: str | msgspec.UnsetType = msgspec.UNSET
    reasoning: str | msgspec.UnsetType = msgspec.UNSET


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob] | None
    refusal: None = None


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatMessageOut
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id hit
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET  # with ``return_token_ids``


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    system_fingerprint: None = None
    # vLLM's, when asked (``return_token_ids``, ``prompt_logprobs``); left out otherwise.
    prompt_token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET
    prompt_logprobs: PromptLogprobs | msgspec.UnsetType = msgspec.UNSET


class FunctionDeltaOut(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDeltaOut(msgspec.Struct, omit_defaults=True):
    """A call's first delta has ``id``, ``type`` and ``function.name``; later ones only
    argument fragments."""

    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionDeltaOut | None = None


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDeltaOut] | None = None
    reasoning_content: str | None = None  # thinking (vLLM's two names)
    reasoning: str | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET  # with ``return_token_ids``


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"
    system_fingerprint: None = None
    prompt_token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET  # the first chunk's


class ModelCard(msgspec.Struct):
    id: str
    created: int
    owned_by: str = "infer"
    object: str = "model"
    root: str | None = None  # the weights it serves (vLLM's)
    parent: str | None = None  # the base model of an adapter (None: a base model)
    max_model_len: int | None = None
    deprecation_date: str | None = None  # the day it stops being served
    task: str = "generate"  # what it does: "generate" (completions, chat) or "embed"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"
