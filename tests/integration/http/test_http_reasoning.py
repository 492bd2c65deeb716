"""Reasoning output on /v1/chat/completions, driven by the openai SDK over the scripted
fake engine: a thinking model's thinking in ``reasoning_content`` (and vLLM's
``reasoning``), whole and streamed; tools and structured outputs apply to the answer only;
``chat_template_kwargs`` / ``reasoning_effort`` reach the template; without a reasoning
parser the thinking stays in the content."""

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from litestar.testing import TestClient

from adapters.http import create_app
from adapters.http.app import HttpSettings
from tests.fakes import AcceptingGrammar, fake_async_engine
from tests.support.scripted import TOKENIZER, Replies
from tests.support.tools import function_tool

MODEL = "test/thinking-model"
USER = [{"role": "user", "content": "What is 2 + 2?"}]
THOUGHT = "<think>\nThe user adds 2 and 2.\n</think>\n\nIt is 4."
WEATHER = function_tool("get_weather", "Current weather in a city.", {"city": {"type": "string"}})
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture
def replies() -> Replies:
    return Replies()


def serve(replies: Replies, parser: str) -> Iterator[openai.OpenAI]:
    engine = fake_async_engine(
        script=replies.script(), tokenizer=TOKENIZER, max_model_len=2048, grammar=AcceptingGrammar()
    )
    app = create_app(engine, MODEL, settings=HttpSettings(reasoning_parser=parser))
    with TestClient(app=app) as http:
        yield openai.OpenAI(
            base_url=f"{http.base_url}/v1", api_key="unused", http_client=http, max_retries=0
        )


@pytest.fixture
def client(replies: Replies) -> Iterator[openai.OpenAI]:
    yield from serve(replies, "think")


def chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    return client.chat.completions.create(model=MODEL, messages=USER, max_tokens=256, **kwargs)


def test_the_thinking_comes_apart_from_the_answer(client: openai.OpenAI, replies: Replies) -> None:
    replies.text = THOUGHT
    message = chat(client).choices[0].message
    assert message.content == "It is 4."
    assert message.reasoning_content == "The user adds 2 and 2."  # type: ignore[attr-defined]
    assert message.reasoning == "The user adds 2 and 2."  # type: ignore[attr-defined]


def test_streamed_thinking_comes_as_its_own_deltas(client: openai.OpenAI, replies: Replies) -> None:
    replies.text = THOUGHT
    thinking, content = [], []
    for chunk in chat(client, stream=True):
        for choice in chunk.choices:
            delta = choice.delta
            thinking.append(getattr(delta, "reasoning_content", None) or "")
            content.append(delta.content or "")
            assert "<think>" not in (delta.content or "") + thinking[-1]
    assert "".join(thinking) == "The user adds 2 and 2."
    assert "".join(content) == "It is 4."


def test_an_answer_without_thinking_has_no_reasoning(
    client: openai.OpenAI, replies: Replies
) -> None:
    replies.text = "Just 4."
    message = chat(client).choices[0].message
    assert message.content == "Just 4."
    assert "reasoning_content" not in message.model_dump(exclude_unset=True)


def test_tool_calls_are_read_from_the_answer_not_the_thinking(
    client: openai.OpenAI, replies: Replies
) -> None:
    replies.text = f"<think>I could call {CALL} but no.</think>\n\nNo call needed."
    choice = chat(client, tools=[WEATHER]).choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"
    assert choice.message.content == "No call needed."
    assert "get_weather" in choice.message.reasoning_content  # type: ignore[attr-defined]

    replies.text = f"<think>Paris weather: call the tool.</think>\n{CALL}"
    for stream in (False, True):
        if stream:
            chunks = list(chat(client, tools=[WEATHER], stream=True))
            calls = [c for ch in chunks for c in ch.choices[0].delta.tool_calls or []]
            assert calls[0].function.name == "get_weather"
            assert "".join(c.function.arguments or "" for c in calls) == '{"city": "Paris"}'
            assert chunks[-1].choices[0].finish_reason == "tool_calls"
        else:
            choice = chat(client, tools=[WEATHER]).choices[0]
            assert choice.finish_reason == "tool_calls"
            [call] = choice.message.tool_calls or []
            assert (call.function.name, call.function.arguments) == (
                "get_weather",
                '{"city": "Paris"}',
            )
            assert choice.message.reasoning_content == "Paris weather: call the tool."  # type: ignore[attr-defined]


def test_a_structured_answer_is_constrained_after_the_thinking(
    client: openai.OpenAI, replies: Replies
) -> None:
    replies.text = '<think>JSON it is.</think>\n{"a": 1}'
    schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}
    message = chat(client, response_format=schema).choices[0].message
    assert message.content == '{"a": 1}'
    structured = replies.requests[-1].sampling_params.structured
    assert structured is not None and structured.kind == "json_schema"
    close = tuple(TOKENIZER.encode("</think>", add_special_tokens=False))
    assert structured.start_after == close
    # Thinking switched off: the template closes it, the constraint holds from the start.
    replies.text = '{"a": 1}'
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    message = chat(client, response_format=schema, extra_body=off).choices[0].message
    assert replies.prompt().endswith("<think>\n\n</think>\n\n")
    structured = replies.requests[-1].sampling_params.structured
    assert structured is not None and structured.start_after == ()
    assert message.content == '{"a": 1}'
    assert "reasoning_content" not in message.model_dump(exclude_unset=True)


def test_reasoning_effort_none_switches_the_thinking_off(
    client: openai.OpenAI, replies: Replies
) -> None:
    replies.text = "4."
    chat(client, reasoning_effort="none")
    assert replies.prompt().endswith("<think>\n\n</think>\n\n")
    chat(client, reasoning_effort="low")
    assert not replies.prompt().endswith("</think>\n\n")
    with pytest.raises(openai.BadRequestError, match="reasoning_effort"):
        chat(client, reasoning_effort="extreme")  # type: ignore[arg-type]


def test_without_a_reasoning_parser_the_thinking_stays_in_the_content(replies: Replies) -> None:
    replies.text = THOUGHT
    for client in serve(replies, "none"):
        message = chat(client).choices[0].message
        assert message.content == THOUGHT
        assert "reasoning_content" not in message.model_dump(exclude_unset=True)
