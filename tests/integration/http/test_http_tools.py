"""Tools on /v1/chat/completions, driven by the official openai SDK over the fake engine:
tool_calls in bodies and streamed deltas, tool_choice, parallel_tool_calls, the
constraints given to the engine, the history rendered, and bad requests refused."""

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from litestar.testing import TestClient

from adapters.fake import ByteTokenizer
from adapters.http import create_app
from tests.fakes import AcceptingGrammar, fake_async_engine
from tests.support.scripted import Replies
from tests.support.tools import function_tool

MODEL = "test/fake-model"
TOKENIZER = ByteTokenizer()
WEATHER = function_tool("get_weather", "Current weather in a city.", {"city": {"type": "string"}})
TIME = {"type": "function", "function": {"name": "get_time"}}
USER = [{"role": "user", "content": "Weather in Paris?"}]
PARIS = '{"city": "Paris"}'
HERMES_CALL = f'<tool_call>\n{{"name": "get_weather", "arguments": {PARIS}}}\n</tool_call>'


@pytest.fixture
def replies() -> Replies:
    return Replies()


@pytest.fixture
def http(replies: Replies) -> Iterator[TestClient]:
    engine = fake_async_engine(
        script=replies.script(), tokenizer=TOKENIZER, max_model_len=2048, grammar=AcceptingGrammar()
    )
    with TestClient(app=create_app(engine, MODEL)) as client:
        yield client


def chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL,
        messages=kwargs.pop("messages", USER),
        max_tokens=kwargs.pop("max_tokens", 256),
        **kwargs,
    )


def test_a_call_in_the_output_comes_back_as_tool_calls(
    client: openai.OpenAI, replies: Replies
) -> None:
    replies.text = HERMES_CALL
    reply = chat(client, tools=[WEATHER])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Paris"},
    )
    assert "get_weather" in replies.prompt()  # the tools were rendered


def test_text_without_calls_stays_content(client: openai.OpenAI, replies: Replies) -> None:
    replies.text = "It is sunny."
    choice = chat(client, tools=[WEATHER]).choices[0]
    assert (choice.message.content, choice.finish_reason) == ("It is sunny.", "stop")
    assert choice.message.tool_calls is None


def test_the_raw_body_has_no_tool_calls_key_without_calls(
    http: TestClient, replies: Replies
) -> None:
    replies.text = "Hi"
    body = {"messages": USER, "tools": [WEATHER], "max_tokens": 8}
    message = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert message == {"content": "Hi", "role": "assistant", "refusal": None}


def streamed(client: openai.OpenAI, **kwargs: Any) -> list[Any]:
    return list(chat(client, stream=True, stream_options={"include_usage": True}, **kwargs))


def test_streamed_calls_arrive_as_openai_sends_them(
    client: openai.OpenAI, replies: Replies
) -> None:
    replies.text = f"Checking.\n{HERMES_CALL}\n{HERMES_CALL.replace('Paris', 'Rome')}"
    chunks = streamed(client, tools=[WEATHER])
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    content = "".join(d.content or "" for d in deltas)
    assert content == "Checking."
    calls = [tc for d in deltas for tc in d.tool_calls or ()]
    for index, city in enumerate(["Paris", "Rome"]):
        mine = [tc for tc in calls if tc.index == index]
        first, rest = mine[0], mine[1:]
        assert first.id.startswith("call_") and first.type == "function"
        assert (first.function.name, first.function.arguments) == ("get_weather", "")
        assert all(tc.id is None and tc.function.name is None for tc in rest)
        assert len(rest) > 1  # the arguments stream in fragments
        assert json.loads("".join(tc.function.arguments for tc in rest)) == {"city": city}
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert [f for f in finishes if f] == ["tool_calls"]
    assert chunks[-1].usage is not None


def test_a_streamed_reply_without_calls_finishes_with_stop(
    client: openai.OpenAI, replies: Replies
) -> None:
    replies.text = "No need <for> tools."
    chunks = streamed(client, tools=[WEATHER])
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "No need <for> tools."
    assert not any(d.tool_calls for d in deltas)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_required_constrains_to_an_array_of_calls(client: openai.OpenAI, replies: Replies) -> None:
    replies.text = (
        f'[{{"name": "get_weather", "parameters": {PARIS}}}, '
        '{"name": "get_time", "parameters": {}}]'
    )
    reply = chat(client, tools=[WEATHER, TIME], tool_choice="required")
    calls = reply.choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        ("get_weather", PARIS),
        ("get_time", "{}"),
    ]
    assert reply.choices[0].finish_reason == "tool_calls"
    structured = replies.requests[-1].sampling_params.structured
    assert structured is not None and structured.kind == "json_schema"
    schema = json.loads(structured.spec)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    # the tool's parameters, closed to the properties they list (they say nothing of more)
    closed = {**WEATHER["function"]["parameters"], "additionalProperties": False}
    assert schema["items"]["anyOf"][0]["properties"]["parameters"] == closed


def test_calls_cut_by_max_tokens_keep_the_complete_ones(
    client: openai.OpenAI, replies: Replies
) -> None:
    first = f'[{{"name": "get_weather", "parameters": {PARIS}}}, '
    replies.text = first + '{"name": "get_time", "parameters": {"zone": "Europe/Par'
    cut = len(TOKENIZER.encode(replies.text, add_special_tokens=False)) - 2
    reply = chat(client, tools=[WEATHER, TIME], tool_choice="required", max_tokens=cut)
    [call] = reply.choices[0].message.tool_calls or []
    assert (call.function.name, call.function.arguments) == ("get_weather", PARIS)
    assert reply.choices[0].finish_reason == "length"


def test_required_without_parallel_calls_allows_one(
    client: openai.OpenAI, replies: Replies
) -> None:
    replies.text = f'[{{"name": "get_weather", "parameters": {PARIS}}}]'
    chat(client, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    structured = replies.requests[-1].sampling_params.structured
    assert structured is not None
    schema = json.loads(structured.spec)
    assert schema["maxItems"] == 1
    assert schema["items"]["properties"]["name"]["enum"] == ["get_weather"]


def test_a_named_function_constrains_to_its_arguments(
    client: openai.OpenAI, replies: Replies
) -> None:
    replies.text = PARIS
    choice = {"type": "function", "function": {"name": "get_weather"}}
    reply = chat(client, tools=[WEATHER, TIME], tool_choice=choice)
    [call] = reply.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", PARIS)
    structured = replies.requests[-1].sampling_params.structured
    assert structured is not None
    closed = {**WEATHER["function"]["parameters"], "additionalProperties": False}
    assert json.loads(structured.spec) == closed
    chunks = streamed(client, tools=[WEATHER, TIME], tool_choice=choice)
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    assert calls[0].function.name == "get_weather"
    assert "".join(tc.function.arguments for tc in calls) == PARIS


def test_without_parallel_calls_only_the_first_comes_back(
    client: openai.OpenAI, replies: Replies
) -> None:
    replies.text = HERMES_CALL + HERMES_CALL.replace("Paris", "Rome")
    reply = chat(client, tools=[WEATHER], parallel_tool_calls=False)
    assert [c.function.arguments for c in reply.choices[0].message.tool_calls] == [PARIS]
    chunks = streamed(client, tools=[WEATHER], parallel_tool_calls=False)
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    assert {tc.index for tc in calls} == {0}


def test_choice_none_renders_no_tools_and_parses_nothing(
    client: openai.OpenAI, replies: Replies
) -> None:
    replies.text = HERMES_CALL
    choice = chat(client, tools=[WEATHER], tool_choice="none").choices[0]
    assert (choice.message.content, choice.finish_reason) == (HERMES_CALL, "stop")
    assert "get_weather" not in replies.prompt()
    assert replies.requests[-1].sampling_params.structured is None


def test_a_history_of_calls_and_results_is_rendered(
    client: openai.OpenAI, replies: Replies
) -> None:
    """The fake's template knows no tool calls: they are written in the parser's format,
    and the results as a user turn."""
    replies.text = "It is 18C in Paris."
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": PARIS},
    }
    messages = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    ]
    reply = chat(client, tools=[WEATHER], messages=messages)
    assert reply.choices[0].message.content == "It is 18C in Paris."
    prompt = replies.prompt()
    assert f"<|assistant|>\n{HERMES_CALL}" in prompt
    assert "<|user|>\n<tool_response>\n18C\n</tool_response>" in prompt


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tools": [WEATHER, {"type": "function"}]}, "tools[1].function"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "x" * 65}}]},
            "tools[0].function.name",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "string"}},
                    }
                ]
            },
            "tools[0].function.parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "tool_choice",
        ),
        ({"functions": [WEATHER["function"]]}, "functions"),
        (
            {"messages": [*USER, {"role": "tool", "content": "18C"}]},
            "messages[1].tool_call_id",
        ),
        (
            {"messages": [*USER, {"role": "assistant", "tool_calls": {"id": 1}}]},
            "messages[1].tool_calls",
        ),
        (
            {
                "messages": [
                    *USER,
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "f", "arguments": "{oops"},
                            }
                        ],
                    },
                ]
            },
            "messages[1].tool_calls[0].function.arguments",
        ),
    ],
)
def test_bad_tool_requests_get_400_naming_the_field(
    http: TestClient, kwargs: dict[str, Any], param: str
) -> None:
    body = {"messages": USER, "max_tokens": 4, **kwargs}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_the_sdk_message_goes_back_into_the_history(
    client: openai.OpenAI, replies: Replies
) -> None:
    """The loop in docs/openai.md: the reply's message object, then the tool's result."""
    replies.text = HERMES_CALL
    reply = chat(client, tools=[WEATHER])
    call = reply.choices[0].message.tool_calls[0]
    messages = [
        *USER,
        reply.choices[0].message,
        {"role": "tool", "tool_call_id": call.id, "content": "18C"},
    ]
    replies.text = "18C."
    assert chat(client, tools=[WEATHER], messages=messages).choices[0].message.content == "18C."
    assert HERMES_CALL in replies.prompt() and "<tool_response>\n18C" in replies.prompt()
