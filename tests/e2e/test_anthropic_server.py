"""The Anthropic Messages API on a real `infer serve` process on the default model
(SmolLM2-135M-Instruct), driven by the official ``anthropic`` SDK: a message, the same
message streamed, a stop sequence, a forced tool call, and token counts."""

from collections.abc import Iterator
from typing import Any

import anthropic
import pytest

from tests.e2e.server import infer_serve

pytestmark = pytest.mark.slow
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
USER = [{"role": "user", "content": "Name three colors."}]
GREEDY = {"temperature": 0}  # not in the SDK's signature any more: sent as an extra field
WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 40}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def sdk() -> Iterator[anthropic.Anthropic]:
    with infer_serve("--max-batch-size", "2") as url:
        yield anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)


def create(sdk: anthropic.Anthropic, **kwargs: Any) -> Any:
    return sdk.messages.create(
        model=MODEL,
        max_tokens=kwargs.pop("max_tokens", 24),
        messages=kwargs.pop("messages", USER),
        extra_body=GREEDY,
        **kwargs,
    )


def test_a_message_and_its_stream_agree(sdk: anthropic.Anthropic) -> None:
    message = create(sdk, system="You are brief.")
    [block] = message.content
    assert block.type == "text" and block.text.strip()
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert 0 < message.usage.output_tokens <= 24
    with sdk.messages.stream(
        model=MODEL, max_tokens=24, messages=USER, system="You are brief.", extra_body=GREEDY
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == block.text == final.content[0].text
    assert final.stop_reason == message.stop_reason
    # the same prompt again: part of it is read from the prefix cache this time
    first, again = message.usage, final.usage
    assert again.output_tokens == first.output_tokens
    assert again.cache_read_input_tokens > 0
    assert (
        again.input_tokens + again.cache_read_input_tokens
        == first.input_tokens + first.cache_read_input_tokens
    )


def test_a_stop_sequence_stops_and_is_named(sdk: anthropic.Anthropic) -> None:
    text = create(sdk).content[0].text
    word = text.split()[1]  # a word the greedy answer writes
    message = create(sdk, stop_sequences=[word])
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", word)
    assert word not in message.content[0].text
    assert text.startswith(message.content[0].text)


def test_a_named_tool_gives_a_valid_tool_use(sdk: anthropic.Anthropic) -> None:
    message = create(
        sdk,
        max_tokens=60,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    [call] = message.content
    assert (call.type, call.name, message.stop_reason) == ("tool_use", "get_weather", "tool_use")
    assert set(call.input) == {"city"} and isinstance(call.input["city"], str)


def test_count_tokens_is_the_messages_input_tokens(sdk: anthropic.Anthropic) -> None:
    kwargs: dict[str, Any] = {"system": "You are brief.", "tools": [WEATHER], "messages": USER}
    count = sdk.messages.count_tokens(model=MODEL, **kwargs)
    message = create(sdk, max_tokens=4, **kwargs)
    assert count.input_tokens == message.usage.input_tokens > 0
