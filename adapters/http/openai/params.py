"""The OpenAI faces' request checks: the body decoded, which fields are refused, the body
-> the completion service's job (``SamplingParams``, prompts or chat messages, priority),
each error a 400 naming its field."""

from typing import Any, TypeVar

import msgspec
from litestar import Request

from adapters.http.errors import HTTPError, check_content_type, decode_json, error_param
from adapters.http.openai.schemas import ChatCompletionRequest, CompletionRequest
from adapters.http.openai.structured import Body, structured_output
from adapters.http.openai.tools import tool_request
from application.serving.completions import ChatJob, Prompt, PromptJob
from domain.ports import STRUCTURED_PARAM
from domain.sampling import MAX_LOGPROBS, SamplingParams, StructuredOutput

T = TypeVar("T")
MAX_COMPLETION_LOGPROBS = 5  # the legacy endpoint's limit
COMPLETION_DEFAULT_MAX_TOKENS = 16  # the legacy endpoint's documented default


def decode_body(decoder: msgspec.json.Decoder[T], request: Request[Any, Any, Any], raw: bytes) -> T:
    """The JSON body as OpenAI checks it: an unknown field is an unrecognized argument."""
    check_content_type(request)
    return decode_json(decoder, raw, _invalid)


def _invalid(message: str) -> HTTPError:
    if "unknown field" in message:
        field = message.split("`")[1] if "`" in message else None
        return HTTPError(
            400, f"Unrecognized request argument supplied: {field}", "invalid_request_error", field
        )
    return HTTPError(400, message, "invalid_request_error", error_param(message))


def completion_job(body: CompletionRequest, adapter_id: str | None) -> PromptJob:
    """``/v1/completions``' body as the completion service's job."""
    check_stream_options(body)
    n = choices(body)
    refuse(("suffix", body.suffix is not None))
    logprobs = completion_logprobs(body)
    max_tokens = COMPLETION_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    found = structured_output(body)
    echoed = logprobs if body.echo else None  # the echoed prompt's logprobs
    asked = asked_prompt_logprobs(body)
    params = sampling(
        body,
        max_tokens,
        found,
        logprobs=logprobs,
        prompt_logprobs=echoed if asked is None else max(asked, echoed or 0),
    )
    prompts = parse_prompts(body.prompt)
    return PromptJob(
        params=params,
        n=n,
        adapter_id=adapter_id,
        priority=priority(body.priority, None),
        structured_param=found[1] if found else STRUCTURED_PARAM,
        prompts=prompts,
        best_of=best_of(body, n),
        **extras(body),
    )


def best_of(body: CompletionRequest, n: int) -> int | None:
    """``best_of`` candidates per prompt of which the ``n`` most likely come back (None:
    ``n``, all shown): at least ``n``, and not streamed (as in vLLM and OpenAI)."""
    if body.best_of is None or body.best_of == n:
        return None
    if body.best_of < n:
        raise HTTPError(400, f"best_of must be >= n ({n})", "invalid_request_error", "best_of")
    if body.stream:
        raise HTTPError(
            400,
            "best_of > n cannot be streamed (the best are known once all are done)",
            "invalid_request_error",
            "best_of",
        )
    return body.best_of


def extras(body: Body) -> dict[str, Any]:
    """vLLM's job-level extras (``bad_words``, ``truncate_prompt_tokens``) and the sampling
    fields the body left out (``unset``: they take the server's generation defaults)."""
    keep = body.truncate_prompt_tokens
    if keep is not None and keep != -1 and keep < 1:
        raise HTTPError(
            400,
            "truncate_prompt_tokens must be -1 (the context) or an integer >= 1",
            "invalid_request_error",
            "truncate_prompt_tokens",
        )
    given = {
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "min_p": body.min_p,
        "repetition_penalty": body.repetition_penalty,
    }
    unset = frozenset(name for name, value in given.items() if value is None)
    return {
        "bad_words": tuple(body.bad_words or ()),
        "truncate_prompt_tokens": keep,
        "unset": unset,
    }


def asked_prompt_logprobs(body: Body) -> int | None:
    """vLLM's ``prompt_logprobs``: alternatives per prompt token, 0..20 (None: none; not
    computed for a stream, where vLLM refuses more than 0)."""
    asked = body.prompt_logprobs
    if asked is None:
        return None
    if not 0 <= asked <= MAX_LOGPROBS:
        raise HTTPError(
            400,
            f"prompt_logprobs must be in [0, {MAX_LOGPROBS}]",
            "invalid_request_error",
            "prompt_logprobs",
        )
    if body.stream:
        if asked:
            raise HTTPError(
                400,
                "prompt_logprobs are not available when stream is true",
                "invalid_request_error",
                "prompt_logprobs",
            )
        return None
    return asked


def chat_job(body: ChatCompletionRequest, adapter_id: str | None) -> ChatJob:
    """``/v1/chat/completions``' body as the completion service's job; its ``max_tokens``
    is set once the prompt is rendered (by default what the context leaves)."""
    check_stream_options(body)
    tools = tool_request(body)
    refuse(*chat_unsupported(body))
    n, top_logprobs = choices(body), chat_top_logprobs(body)
    messages = parse_messages(body.messages)
    found = structured_output(body)
    params = sampling(
        body,
        max(1, body.min_tokens or 0),
        found,
        logprobs=top_logprobs,
        prompt_logprobs=asked_prompt_logprobs(body),
    )
    max_tokens, field = body.max_completion_tokens, "max_completion_tokens"
    if max_tokens is None:  # None too: as much as the context leaves
        max_tokens, field = body.max_tokens, "max_tokens"
    if tools is not None and tools.constrained:
        structured_param = "tools"
    else:
        structured_param = found[1] if found else STRUCTURED_PARAM
    return ChatJob(
        params=params,
        n=n,
        adapter_id=adapter_id,
        priority=priority(body.priority, body.metadata),
        structured_param=structured_param,
        messages=messages,
        tools=tools,
        max_tokens=max_tokens,
        max_tokens_param=field,
        template_kwargs=template_kwargs(body),
        **extras(body),
    )


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")


def template_kwargs(body: ChatCompletionRequest) -> dict[str, Any]:
    """The chat template's extra variables: ``reasoning_effort`` (``none`` also turns the
    thinking off: ``enable_thinking`` false, Qwen3's switch), then
    ``chat_template_kwargs``, which win."""
    kwargs: dict[str, Any] = {}
    effort = body.reasoning_effort
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise HTTPError(
                400,
                f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}",
                "invalid_request_error",
                "reasoning_effort",
            )
        kwargs["reasoning_effort"] = effort
        if effort == "none":
            kwargs["enable_thinking"] = False
    return {**kwargs, **(body.chat_template_kwargs or {})}


def priority(value: int | None, metadata: dict[str, str] | None) -> int | None:
    """The requests' priority: ``priority`` (vLLM's field) or ``metadata.priority``; as in
    vLLM, a lower value runs earlier (default 0), and may preempt a running request of a
    higher value when the batch is full."""
    if value is None and metadata and "priority" in metadata:
        try:
            value = int(metadata["priority"])
        except ValueError:
            raise HTTPError(
                400, "metadata.priority must be an integer", "invalid_request_error", "metadata"
            ) from None
    if value is not None and not -(2**31) <= value < 2**31:
        raise HTTPError(
            400, "priority must be a 32-bit integer", "invalid_request_error", "priority"
        )
    return value


def refuse(*checks: tuple[str, bool]) -> None:
    for field, is_set in checks:
        if is_set:
            raise HTTPError(
                400, f"`{field}` is not supported by this server", "invalid_request_error", field
            )


def check_stream_options(body: Body) -> None:
    if body.stream_options is not None and not body.stream:
        raise HTTPError(
            400,
            "`stream_options` is only allowed when `stream` is true",
            "invalid_request_error",
            "stream_options",
        )


def chat_unsupported(body: ChatCompletionRequest) -> list[tuple[str, bool]]:
    return [
        ("functions", bool(body.functions)),  # the legacy form of tools
        ("function_call", body.function_call is not None),
        ("audio", body.audio is not None),
        ("modalities", body.modalities not in (None, ["text"])),
        ("prediction", body.prediction is not None),
        ("web_search_options", body.web_search_options is not None),
    ]


def choices(body: Body) -> int:
    """``n``: choices per prompt (its range is the engine's ``check_room``'s)."""
    return 1 if body.n is None else body.n


def completion_logprobs(body: CompletionRequest) -> int | None:
    """The legacy ``logprobs``: alternatives per token, 0..5 as OpenAI allows (None: off)."""
    if body.logprobs is not None and not 0 <= body.logprobs <= MAX_COMPLETION_LOGPROBS:
        raise HTTPError(
            400,
            f"logprobs must be in [0, {MAX_COMPLETION_LOGPROBS}]",
            "invalid_request_error",
            "logprobs",
        )
    return body.logprobs


def chat_top_logprobs(body: ChatCompletionRequest) -> int | None:
    """Chat's ``logprobs`` + ``top_logprobs`` (0..20, only with ``logprobs``) as
    alternatives per token (None: no logprobs)."""
    top = body.top_logprobs
    if top is not None and not body.logprobs:
        raise HTTPError(
            400,
            "top_logprobs needs logprobs to be true",
            "invalid_request_error",
            "top_logprobs",
        )
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise HTTPError(
            400,
            f"top_logprobs must be in [0, {MAX_LOGPROBS}]",
            "invalid_request_error",
            "top_logprobs",
        )
    return (top or 0) if body.logprobs else None


def sampling(
    body: Body,
    max_tokens: int,
    structured: tuple[StructuredOutput, str] | None,
    *,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """``structured``: the body's output constraint (and its field). ``logprobs``:
    alternatives per generated token (None: no logprobs); ``prompt_logprobs``: per prompt
    token (``echo`` with logprobs, ``prompt_logprobs``; with their ranks)."""
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if body.temperature is not None and not 0.0 <= body.temperature <= 2.0:
        raise HTTPError(
            400, "temperature must be in [0, 2]", "invalid_request_error", "temperature"
        )
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        min_p=body.min_p or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        ignore_eos=bool(body.ignore_eos),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        stop=stop,
        include_stop_str_in_output=bool(body.include_stop_str_in_output),
        seed=body.seed,
        logit_bias=logit_bias(body.logit_bias),
        min_tokens=body.min_tokens or 0,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs is not None,
        prompt_top_logprobs=prompt_logprobs or 0,
        prompt_ranks=body.prompt_logprobs is not None and prompt_logprobs is not None,
        structured=structured[0] if structured else None,
        cache_salt=body.cache_salt,
    )


def logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias`` (token id as a string -> a bias in [-100, 100]) as
    (id, bias) pairs; ids beyond the vocabulary are refused when the prompt is prepared."""
    pairs = []
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise HTTPError(
                400,
                f"logit_bias keys are token ids, got {key!r}",
                "invalid_request_error",
                "logit_bias",
            ) from None
        pairs.append((token, float(value)))
    return tuple(pairs)


def parse_prompts(prompt: str | list[Any]) -> list[Prompt]:
    """A string, a list of strings, token ids, or a list of token-id lists -> prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(is_token_id(t) for t in prompt):
        return [list(prompt)]
    if prompt and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if prompt and all(isinstance(p, list) and all(is_token_id(t) for t in p) for p in prompt):
        return [list(p) for p in prompt]
    raise HTTPError(
        400,
        "prompt must be a string, strings, token ids or lists of token ids",
        "invalid_request_error",
        "prompt",
    )


def is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


ROLES = ("system", "developer", "user", "assistant", "tool", "function")


NEEDS_CONTENT = ("system", "developer", "user", "tool", "function")  # assistant: tool calls


def parse_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages, checked, with text content (parts joined). A role outside ``ROLES``
    goes to the chat template as it is (vLLM's custom roles): the template decides, and
    one that refuses it answers a 400 naming ``messages``."""
    if not messages:
        raise HTTPError(400, "messages must not be empty", "invalid_request_error", "messages")
    for i, message in enumerate(messages):
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise HTTPError(
                400,
                f"messages[{i}].role must be a non-empty string, got {role!r}",
                "invalid_request_error",
                f"messages[{i}].role",
            )
        if role in NEEDS_CONTENT and message.get("content") is None:
            raise HTTPError(
                400,
                f"messages[{i}].content is required for role {role!r}",
                "invalid_request_error",
                f"messages[{i}].content",
            )
    return [{**m, "content": text_content(m.get("content"))} for m in messages]


def text_content(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" for p in content
    ):
        return "".join(str(p.get("text", "")) for p in content)
    raise HTTPError(
        400, "only text content parts are supported", "invalid_request_error", "messages"
    )
