"""The Anthropic Messages API (``/v1/messages``, ``/v1/messages/count_tokens``), driven by
the official ``anthropic`` SDK over the fake engine: messages whole and streamed, stop
reasons, thinking, tools and ``tool_choice``, token counts, errors in Anthropic's format,
and — through the composition root — keys, limits, metrics and the request log."""

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest
from litestar.testing import TestClient
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from adapters.fake.runner import FakeModelRunner
from adapters.http import HttpServices, HttpSettings, create_app
from adapters.http.anthropic.errors import ANTHROPIC_ERRORS, error_type
from adapters.http.anthropic.replies import MessageReply
from adapters.http.errors import HTTPError
from adapters.observability.http import ObservedApp
from adapters.observability.tracing import Tracing, TracingSettings, build_tracer_provider
from application.access.idempotency import MemoryIdempotencyStore
from application.access.keys import hash_key
from application.serving.tool_parsers import FORMATS
from domain.errors import QueueFullError
from domain.request import StepOutput
from tests.fakes import AcceptingGrammar, fake_async_engine, fake_container
from tests.support.anthropic_sdk import anthropic_client
from tests.support.json_logs import json_log_stream
from tests.support.scripted import TOKENIZER, Replies

MODEL = "test/fake-model"
USER = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
TIME = {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture
def replies() -> Replies:
    return Replies("It is sunny.")


def _engine(replies: Replies, **config: Any) -> Any:
    return fake_async_engine(
        script=replies.script(),
        tokenizer=TOKENIZER,
        max_model_len=2048,
        grammar=AcceptingGrammar(),
        **config,
    )


@pytest.fixture
def http(replies: Replies) -> Iterator[TestClient]:
    app = create_app(_engine(replies), MODEL, settings=HttpSettings(reasoning_parser="think"))
    with TestClient(app=app) as client:
        yield client


@pytest.fixture
def sdk(http: TestClient) -> anthropic.Anthropic:
    return anthropic_client(http)


def create(sdk: anthropic.Anthropic, **kwargs: Any) -> Any:
    return sdk.messages.create(
        model=MODEL,
        max_tokens=kwargs.pop("max_tokens", 256),
        messages=kwargs.pop("messages", USER),
        **kwargs,
    )


def without_ids(message: Any) -> dict[str, Any]:
    """A message as a dict, its id and its tool_use ids left out, its input tokens counted
    whole (a second request for the same prompt reads part of it from the cache)."""
    body = message.model_dump(exclude_none=True)
    body.pop("id")
    usage = body["usage"]
    usage["input_tokens"] += usage.pop("cache_read_input_tokens", 0)
    for block in body["content"]:
        block.pop("id", None)
    return body


def engine_request(replies: Replies) -> Any:
    return replies.requests[-1]


# --- messages ---------------------------------------------------------------------------


def test_a_message_comes_back_with_its_text_stop_reason_and_usage(
    sdk: anthropic.Anthropic, replies: Replies
) -> None:
    message = create(sdk, max_tokens=100, metadata={"user_id": "user-7"})
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.model == MODEL
    [block] = message.content
    assert (block.type, block.text) == ("text", "It is sunny.")
    assert (message.stop_reason, message.stop_sequence) == ("end_turn", None)
    request = engine_request(replies)
    assert message.usage.input_tokens == len(request.prompt_token_ids)
    assert message.usage.output_tokens == len("It is sunny.") + 1  # and EOS
    assert message.usage.cache_read_input_tokens == 0
    assert message.usage.cache_creation_input_tokens == 0
    assert request.sampling_params.max_tokens == 100
    assert replies.prompt().endswith("<|user|>\nWeather in Paris?\n<|assistant|>\n")


def test_the_system_prompt_comes_first_as_a_string_or_text_blocks(
    sdk: anthropic.Anthropic, replies: Replies
) -> None:
    create(sdk, system="Be brief.")
    assert replies.prompt().startswith("<|system|>\nBe brief.\n<|user|>\n")
    blocks = [
        {"type": "text", "text": "Be brief."},
        {"type": "text", "text": "Answer in French.", "cache_control": {"type": "ephemeral"}},
    ]
    create(sdk, system=blocks)
    assert replies.prompt().startswith("<|system|>\nBe brief.\n\nAnswer in French.\n<|user|>")


def test_user_content_blocks_are_joined(sdk: anthropic.Anthropic, replies: Replies) -> None:
    content = [{"type": "text", "text": "First."}, {"type": "text", "text": "Second."}]
    create(sdk, messages=[{"role": "user", "content": content}])
    assert "<|user|>\nFirst.\n\nSecond.\n" in replies.prompt()


def test_sampling_fields_reach_the_engine(sdk: anthropic.Anthropic, replies: Replies) -> None:
    create(sdk, extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 7})
    params = engine_request(replies).sampling_params
    assert (params.temperature, params.top_p, params.top_k) == (0.5, 0.9, 7)


def test_a_stop_sequence_names_the_one_that_matched(
    sdk: anthropic.Anthropic, replies: Replies
) -> None:
    replies.text = "One. Two. END Three."
    message = create(sdk, stop_sequences=["NEVER", "END", "Three"])
    assert message.content[0].text == "One. Two. "
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "END")
    assert engine_request(replies).sampling_params.stop == ("NEVER", "END", "Three")


def test_max_tokens_cuts_the_message(sdk: anthropic.Anthropic) -> None:
    message = create(sdk, max_tokens=5)
    assert message.content[0].text == "It is"
    assert (message.stop_reason, message.usage.output_tokens) == ("max_tokens", 5)


def test_a_streamed_message_is_the_message(sdk: anthropic.Anthropic, replies: Replies) -> None:
    whole = create(sdk, system="Be brief.", stop_sequences=["sunny"])
    with sdk.messages.stream(
        model=MODEL, max_tokens=256, messages=USER, system="Be brief.", stop_sequences=["sunny"]
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "It is "
    # The same prompt again: its full blocks are read from the prefix cache (Anthropic's
    # input_tokens are the tokens not read from it).
    first, again = whole.usage, final.usage
    assert first.cache_read_input_tokens == 0 and again.cache_read_input_tokens > 0
    prompt = first.input_tokens
    assert again.input_tokens + again.cache_read_input_tokens == prompt
    assert again.cache_read_input_tokens == (prompt - 1) // 16 * 16  # full blocks, short of one
    assert without_ids(final) == without_ids(whole)
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "sunny")
    assert final.id.startswith("msg_")


def test_the_stream_has_anthropics_events_in_order(http: TestClient) -> None:
    body = {"model": MODEL, "max_tokens": 64, "messages": USER, "stream": True}
    response = http.post("/v1/messages", json=body)
    assert response.headers["content-type"].startswith("text/event-stream")
    events = _events(response.text)
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[2:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert (start["content"], start["stop_reason"], start["usage"]["output_tokens"]) == (
        [],
        None,
        0,
    )
    assert start["usage"]["input_tokens"] > 0
    assert events[1][1]["content_block"] == {"type": "text", "text": ""}
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == len("It is sunny.") + 1
    assert all(data["type"] == name for name, data in events)


def _events(text: str) -> list[tuple[str, dict[str, Any]]]:
    """An event stream's (event, data) pairs."""
    events = []
    for frame in text.replace("\r\n", "\n").split("\n\n"):
        lines = dict(line.split(": ", 1) for line in frame.splitlines() if ": " in line)
        if "event" in lines:
            events.append((lines["event"], json.loads(lines["data"])))
    return events


def test_a_silent_stream_gets_anthropics_ping_event(replies: Replies) -> None:
    engine = _engine(replies, step_latency_s=0.05)
    settings = HttpSettings(sse_heartbeat_interval=0.02)
    with TestClient(app=create_app(engine, MODEL, settings=settings)) as http:
        replies.text = "Hi"
        body = {"model": MODEL, "max_tokens": 8, "messages": USER, "stream": True}
        text = http.post("/v1/messages", json=body).text
    assert 'event: ping\ndata: {"type": "ping"}\n\n' in text.replace("\r\n", "\n")
    assert not any(line.startswith(": ping") for line in text.splitlines())  # not a comment
    final = anthropic_client_message(text)
    assert final["content"] == [{"type": "text", "text": "Hi"}]


def anthropic_client_message(text: str) -> dict[str, Any]:
    """The message an event stream builds (text blocks only)."""
    message: dict[str, Any] = {}
    for name, data in _events(text):
        if name == "message_start":
            message = data["message"]
        elif name == "content_block_start":
            message["content"].append(data["content_block"])
        elif name == "content_block_delta":
            message["content"][data["index"]]["text"] += data["delta"]["text"]
    return message


def test_an_engine_failure_mid_stream_is_an_error_event() -> None:
    async def failing() -> AsyncIterator[StepOutput]:
        yield StepOutput("r", 5, "Hi", False)
        yield StepOutput("r", None, "", True, error="the engine failed")

    async def run() -> list[Any]:
        reply = MessageReply("msg_1", MODEL, FORMATS["hermes"])
        return [event async for event in reply._stream(failing(), 3)]

    events = asyncio.run(run())
    assert [type(e).__name__ for e in events][-1] == "ErrorBody"
    assert events[-1].error.type == "api_error"
    assert events[-1].error.message == "the engine failed"


def test_a_claude_code_style_request_is_served(http: TestClient) -> None:
    """What Claude Code sends: system blocks and tools with cache_control, metadata,
    context_management, beta and version headers, a stream."""
    body = {
        "model": MODEL,
        "max_tokens": 512,
        "stream": True,
        "temperature": 1,
        "system": [
            {
                "type": "text",
                "text": "You are a coding agent.",
                "cache_control": {"type": "ephemeral"},
            }
        ],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<system-reminder>ctx</system-reminder>"},
                    {"type": "text", "text": "Fix it.", "cache_control": {"type": "ephemeral"}},
                ],
            }
        ],
        "tools": [{**WEATHER, "cache_control": {"type": "ephemeral"}, "strict": False}],
        "metadata": {"user_id": "user_abc_session_1"},
        "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]},
    }
    headers = {
        "anthropic-version": "2023-06-01",
        "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14",
        "x-api-key": "anything",
    }
    response = http.post("/v1/messages?beta=true", json=body, headers=headers)
    assert response.status_code == 200, response.text
    assert _events(response.text)[-1][0] == "message_stop"


# --- thinking ---------------------------------------------------------------------------


def test_thinking_comes_first_as_a_thinking_block(
    sdk: anthropic.Anthropic, replies: Replies
) -> None:
    replies.text = "<think>\nLet me see: 2 + 2.\n</think>\n\nIt is 4."
    message = create(sdk, thinking={"type": "enabled", "budget_tokens": 1024})
    thinking, text = message.content
    assert (thinking.type, thinking.thinking, thinking.signature) == (
        "thinking",
        "Let me see: 2 + 2.",
        "",
    )
    assert (text.type, text.text) == ("text", "It is 4.")
    with sdk.messages.stream(
        model=MODEL,
        max_tokens=256,
        messages=USER,
        thinking={"type": "enabled", "budget_tokens": 1024},
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert without_ids(final) == without_ids(message)
    kinds = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert kinds.index("signature_delta") == kinds.index("text_delta") - 1
    assert "<think>" not in replies.prompt()  # enabled: the template's default


def test_thinking_disabled_switches_the_templates_thinking_off(
    sdk: anthropic.Anthropic, replies: Replies
) -> None:
    message = create(sdk, thinking={"type": "disabled"})
    assert replies.prompt().endswith("<|assistant|>\n<think>\n\n</think>\n\n")
    assert [b.type for b in message.content] == ["text"]


def test_past_thinking_blocks_are_dropped_from_the_prompt(
    sdk: anthropic.Anthropic, replies: Replies
) -> None:
    history = [
        {"role": "user", "content": "2 + 2?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "SECRET-THOUGHT", "signature": ""},
                {"type": "redacted_thinking", "data": "xyz"},
                {"type": "text", "text": "4."},
            ],
        },
        {"role": "user", "content": "And 3 + 3?"},
    ]
    create(sdk, messages=history)
    prompt = replies.prompt()
    assert "SECRET-THOUGHT" not in prompt
    assert "<|assistant|>\n4.\n<|user|>\nAnd 3 + 3?" in prompt


# --- tools ------------------------------------------------------------------------------


def test_a_tool_call_is_a_tool_use_block(sdk: anthropic.Anthropic, replies: Replies) -> None:
    replies.text = f"Let me check.\n{HERMES_CALL}"
    message = create(sdk, tools=[WEATHER])
    text, call = message.content
    assert (text.type, text.text.strip()) == ("text", "Let me check.")
    assert call.type == "tool_use" and call.id.startswith("toolu_")
    assert (call.name, call.input) == ("get_weather", {"city": "Paris"})
    assert message.stop_reason == "tool_use"
    assert "<|tools|>\nget_weather" in replies.prompt()  # the tools were rendered


def test_a_streamed_tool_call_is_the_same_message(
    sdk: anthropic.Anthropic, replies: Replies
) -> None:
    replies.text = f"Let me check.\n{HERMES_CALL}\n{HERMES_CALL.replace('Paris', 'Rome')}"
    whole = create(sdk, tools=[WEATHER])
    with sdk.messages.stream(model=MODEL, max_tokens=256, messages=USER, tools=[WEATHER]) as s:
        events = list(s)
        final = s.get_final_message()
    assert without_ids(final) == without_ids(whole)
    assert [b.input for b in final.content if b.type == "tool_use"] == [
        {"city": "Paris"},
        {"city": "Rome"},
    ]
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    partial = [d.partial_json for d in deltas if d.type == "input_json_delta"]
    assert len(partial) > 2  # the input streams in pieces
    assert final.stop_reason == "tool_use"


def test_a_tool_round_trip_renders_the_call_and_its_result(
    sdk: anthropic.Anthropic, replies: Replies
) -> None:
    replies.text = HERMES_CALL
    first = create(sdk, tools=[WEATHER])
    [call] = first.content
    replies.text = "It is 21 degrees in Paris."
    history = [
        *USER,
        {"role": "assistant", "content": [block.model_dump() for block in first.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": call.id, "content": "21 degrees"},
                {"type": "text", "text": "Thanks!"},
            ],
        },
    ]
    second = create(sdk, tools=[WEATHER], messages=history)
    assert (second.content[0].text, second.stop_reason) == (
        "It is 21 degrees in Paris.",
        "end_turn",
    )
    prompt = replies.prompt()
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<tool_response>\n21 degrees\n</tool_response>" in prompt
    assert prompt.index("</tool_response>") < prompt.index("Thanks!")


def test_an_error_result_and_block_content_are_rendered(
    sdk: anthropic.Anthropic, replies: Replies
) -> None:
    history = [
        *USER,
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": [{"type": "text", "text": "city is required"}],
                    "is_error": True,
                }
            ],
        },
    ]
    create(sdk, tools=[WEATHER], messages=history)
    assert "<tool_response>\nError: city is required\n</tool_response>" in replies.prompt()


@pytest.mark.parametrize(
    ("choice", "schema_check"),
    [
        ({"type": "any"}, lambda s: s["type"] == "array" and "maxItems" not in s),
        (
            {"type": "any", "disable_parallel_tool_use": True},
            lambda s: s["type"] == "array" and s["maxItems"] == 1,
        ),
        ({"type": "tool", "name": "get_weather"}, lambda s: s["required"] == ["city"]),
    ],
)
def test_tool_choice_constrains_the_output(
    sdk: anthropic.Anthropic, replies: Replies, choice: dict[str, Any], schema_check: Any
) -> None:
    replies.text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'
    if choice["type"] == "tool":
        replies.text = '{"city": "Paris"}'
    message = create(sdk, tools=[WEATHER, TIME], tool_choice=choice)
    structured = engine_request(replies).sampling_params.structured
    assert structured is not None and structured.kind == "json_schema"
    assert schema_check(json.loads(structured.spec))
    [call] = message.content
    assert (call.name, call.input, message.stop_reason) == (
        "get_weather",
        {"city": "Paris"},
        "tool_use",
    )


def test_tool_choice_none_leaves_the_tools_out(sdk: anthropic.Anthropic, replies: Replies) -> None:
    replies.text = HERMES_CALL
    message = create(sdk, tools=[WEATHER], tool_choice={"type": "none"})
    assert engine_request(replies).sampling_params.structured is None
    assert "<|tools|>" not in replies.prompt()
    assert [b.type for b in message.content] == ["text"]  # no calls are read
    assert message.stop_reason == "end_turn"


def test_auto_with_disable_parallel_tool_use_keeps_the_first_call(
    sdk: anthropic.Anthropic, replies: Replies
) -> None:
    replies.text = f"{HERMES_CALL}\n{HERMES_CALL.replace('Paris', 'Rome')}"
    message = create(
        sdk, tools=[WEATHER], tool_choice={"type": "auto", "disable_parallel_tool_use": True}
    )
    assert [b.input for b in message.content] == [{"city": "Paris"}]


def test_output_config_format_constrains_the_output(
    sdk: anthropic.Anthropic, replies: Replies
) -> None:
    replies.text = '{"answer": 4}'
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}}
    create(sdk, output_config={"format": {"type": "json_schema", "schema": schema}})
    structured = engine_request(replies).sampling_params.structured
    assert structured is not None and json.loads(structured.spec) == schema


# --- count_tokens -----------------------------------------------------------------------


def test_count_tokens_counts_the_rendered_prompt(
    sdk: anthropic.Anthropic, replies: Replies
) -> None:
    kwargs: dict[str, Any] = {"system": "Be brief.", "tools": [WEATHER], "messages": USER}
    count = sdk.messages.count_tokens(model=MODEL, **kwargs)
    assert count.input_tokens > 0
    message = create(sdk, **kwargs)
    assert count.input_tokens == message.usage.input_tokens
    bare = sdk.messages.count_tokens(model=MODEL, messages=USER)
    assert bare.input_tokens < count.input_tokens  # the system prompt and tools count
    off = sdk.messages.count_tokens(model=MODEL, messages=USER, thinking={"type": "disabled"})
    assert off.input_tokens == bare.input_tokens + len("<think>\n\n</think>\n\n")
    assert len(replies.requests) == 1  # counting runs nothing


# --- errors -----------------------------------------------------------------------------


def _error(response: Any, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == kind
    return str(body["error"]["message"])


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"messages": USER}, "max_tokens: Field required"),
        ({"max_tokens": 8, "messages": USER, "n": 2}, "n: Extra inputs are not permitted"),
        (
            {"max_tokens": 8, "messages": [{"role": "user", "content": "x", "name": "a"}]},
            "messages.0.name: Extra inputs are not permitted",
        ),
        ({"max_tokens": 8, "messages": USER, "temperature": 1.5}, "temperature"),
        ({"max_tokens": 0, "messages": USER}, "max_tokens"),
        ({"max_tokens": 8, "messages": []}, "messages"),
        ({"max_tokens": 8, "messages": [{"role": "system", "content": "x"}]}, "role"),
        (
            {
                "max_tokens": 8,
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image", "source": {"type": "base64", "data": "x"}}],
                    }
                ],
            },
            "`image` content is not supported",
        ),
        (
            {"max_tokens": 8, "messages": [*USER, {"role": "assistant", "content": "The"}]},
            "prefill",
        ),
        (
            {
                "max_tokens": 8,
                "messages": USER,
                "tools": [{"type": "web_search_20250305", "name": "web_search"}],
            },
            "web_search_20250305",
        ),
        (
            {"max_tokens": 8, "messages": USER, "tool_choice": {"type": "any"}},
            "needs tools",
        ),
        (
            {
                "max_tokens": 8,
                "messages": USER,
                "tools": [WEATHER],
                "tool_choice": {"type": "tool", "name": "nope"},
            },
            "not one of the tools",
        ),
        ({"max_tokens": 8, "messages": USER, "thinking": {"type": "sometimes"}}, "thinking"),
        ({"max_tokens": 8, "messages": USER, "mcp_servers": []}, "mcp_servers"),
    ],
)
def test_bad_requests_are_400s_in_anthropics_format(
    http: TestClient, body: dict[str, Any], message: str
) -> None:
    response = http.post("/v1/messages", json={"model": MODEL, **body})
    assert message in _error(response, 400, "invalid_request_error")


def test_the_sdk_raises_anthropics_errors(sdk: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as found:
        sdk.messages.create(model="claude-nope", max_tokens=8, messages=USER)
    assert found.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError):
        create(sdk, messages=[{"role": "user", "content": "x" * 10_000}])  # over the context


def test_the_use_cases_errors_name_this_faces_fields(http: TestClient) -> None:
    body = {"model": MODEL, "messages": USER}
    too_long = http.post("/v1/messages", json={**body, "max_tokens": 5000})
    assert _error(too_long, 400, "invalid_request_error").startswith("messages: ")
    stops = [f"s{i}" for i in range(100)]
    many = http.post("/v1/messages", json={**body, "max_tokens": 8, "stop_sequences": stops})
    assert _error(many, 400, "invalid_request_error").startswith("stop_sequences: 100 entries")


def test_framework_errors_under_the_route_are_in_anthropics_format(http: TestClient) -> None:
    assert "not allowed" in _error(http.get("/v1/messages"), 405, "invalid_request_error")
    malformed = http.post(
        "/v1/messages", content=b"{", headers={"content-type": "application/json"}
    )
    assert "malformed JSON" in _error(malformed, 400, "invalid_request_error")


def test_the_request_deadline_is_a_504_timeout_error(replies: Replies) -> None:
    replies.text = "A long answer. " * 20
    engine = _engine(replies, step_latency_s=0.02)
    settings = HttpSettings(request_timeout=0.2)
    with TestClient(app=create_app(engine, MODEL, settings=settings)) as http:
        body = {"model": MODEL, "max_tokens": 200, "messages": USER}
        late = http.post("/v1/messages", json=body)
        streamed = http.post("/v1/messages", json={**body, "stream": True})
    assert "timed out" in _error(late, 504, "timeout_error")
    name, data = _events(streamed.text)[-1]
    assert (name, data["error"]["type"]) == ("error", "api_error")
    assert "timed out" in data["error"]["message"]


def test_a_full_engine_is_a_529_overloaded_error() -> None:
    error = ANTHROPIC_ERRORS.error(QueueFullError("the engine is full"))
    assert isinstance(error, HTTPError)
    assert (error.status, error_type(error.status), error.headers) == (
        529,
        "overloaded_error",
        {"Retry-After": "1"},
    )


def test_an_idempotency_key_runs_a_message_once(replies: Replies) -> None:
    services = HttpServices(idempotency=MemoryIdempotencyStore())
    with TestClient(app=create_app(_engine(replies), MODEL, services)) as http:
        body = {"model": MODEL, "max_tokens": 16, "messages": USER}
        headers = {"Idempotency-Key": "once"}
        first = http.post("/v1/messages", json=body, headers=headers)
        again = http.post("/v1/messages", json=body, headers=headers)
        other = http.post("/v1/messages", json={**body, "max_tokens": 8}, headers=headers)
    assert again.json() == first.json() and again.headers["idempotent-replayed"] == "true"
    assert len(replies.requests) == 1
    assert "Idempotency-Key" in _error(other, 409, "invalid_request_error")


# --- through the composition root: keys, limits, metrics, the request log --------------


KEYS = {"alice": "sk-alice", "bob": "sk-bob"}


def _keys_file(tmp_path: Path) -> Path:
    tenants = [
        {"id": "alice", "keys": [hash_key(KEYS["alice"])]},
        {"id": "bob", "keys": [hash_key(KEYS["bob"])], "tokens_per_minute": 60},
    ]
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"tenants": tenants}))
    return path


def test_keys_limits_metrics_and_the_request_log(tmp_path: Path) -> None:
    replies = Replies("Hello.")
    runner = FakeModelRunner(script=replies.script())
    container = fake_container(
        runner, cache_dir=str(tmp_path), api_keys_file=str(_keys_file(tmp_path))
    )
    body = {"model": "fake", "max_tokens": 16, "messages": USER}
    with json_log_stream() as log, TestClient(app=container.http_app()) as http:  # type: ignore[arg-type]
        missing = http.post("/v1/messages", json=body)
        assert "x-api-key" in _error(missing, 401, "authentication_error")
        refused = http.post("/v1/messages", json=body, headers={"x-api-key": "sk-nobody"})
        _error(refused, 401, "authentication_error")
        with pytest.raises(anthropic.AuthenticationError):
            anthropic_client(http, "sk-nobody").messages.create(
                model="fake", max_tokens=8, messages=USER
            )
        message = anthropic_client(http, KEYS["alice"]).messages.create(
            model="fake", max_tokens=16, messages=USER
        )
        assert message.content[0].text == "Hello."
        bearer = {"Authorization": f"Bearer {KEYS['alice']}"}
        assert http.post("/v1/messages", json=body, headers=bearer).status_code == 200
        over = {**body, "max_tokens": 100}  # Bob may use 60 tokens a minute
        limited = http.post("/v1/messages", json=over, headers={"x-api-key": KEYS["bob"]})
        _error(limited, 429, "rate_limit_error")
        assert int(limited.headers["retry-after"]) >= 1
        metrics = http.get("/metrics").text
    samples = {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
    }

    def count(code: str) -> float:
        return sum(
            value
            for (name, labels), value in samples.items()
            if name == "infer:requests_total"
            and ("route", "/v1/messages") in labels
            and ("code", code) in labels
        )

    assert (count("200"), count("401"), count("429")) == (2, 3, 1)
    lines = [json.loads(line) for line in log.getvalue().splitlines() if line.strip()]
    [ok, *_] = [
        line for line in lines if line.get("event") == "request" and line.get("status") == 200
    ]
    assert (ok["route"], ok["model"], ok["tenant_id"], ok["stream"]) == (
        "/v1/messages",
        "fake",
        "alice",
        False,
    )
    assert (ok["tokens_in"], ok["tokens_out"]) == (
        message.usage.input_tokens,
        message.usage.output_tokens,
    )


def test_a_message_is_traced_from_the_callers_span_through_the_engine() -> None:
    exporter = InMemorySpanExporter()
    provider = build_tracer_provider(TracingSettings(), (SimpleSpanProcessor(exporter),))
    tracing = Tracing(provider, "fake")
    replies = Replies("Hello.")
    engine = fake_async_engine(script=replies.script(), tokenizer=TOKENIZER, observer=tracing)
    app = ObservedApp(create_app(engine, MODEL), tracing=tracing)
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    with TestClient(app=app) as http:  # type: ignore[arg-type]
        response = http.post(
            "/v1/messages",
            json={"model": MODEL, "max_tokens": 16, "messages": USER, "stream": True},
            headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"},
        )
        assert response.status_code == 200, response.text
    provider.shutdown()
    spans = exporter.get_finished_spans()
    [server] = [s for s in spans if s.name == "POST /v1/messages"]
    assert format(server.context.trace_id, "032x") == trace_id
    assert server.attributes is not None
    assert server.attributes["gen_ai.usage.output_tokens"] == len("Hello.") + 1
    [request] = [s for s in spans if s.name == "engine.request"]
    assert request.parent is not None and request.parent.span_id == server.context.span_id
    assert request.attributes is not None
    assert request.attributes["gen_ai.request.max_tokens"] == 16
    [render] = [s for s in spans if s.name == "render_chat"]
    assert render.parent is not None and render.parent.span_id == server.context.span_id
