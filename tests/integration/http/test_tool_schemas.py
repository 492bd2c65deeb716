"""The JSON schemas that ``tool_choice`` ``required`` and named functions constrain the
output to, compiled by llguidance (the grammar backend) and matched against outputs."""

import json
from typing import Any

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from application.serving.chat_prompts import ToolRequest, required_schema

llguidance = pytest.importorskip("llguidance")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters
PARIS = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
NOW = '{"name": "get_time", "parameters": {}}'


@pytest.fixture(scope="module")
def matches() -> Any:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    rust = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.decoder = decoders.ByteLevel()
    rust.add_special_tokens([AddedToken("<eos>", special=True)])
    tokenizer = llguidance.LLTokenizer(
        rust.to_str(), n_vocab=rust.get_vocab_size(), eos_token=rust.token_to_id("<eos>")
    )

    def match(schema: dict[str, Any], text: str) -> bool:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        ids = rust.encode(text).ids
        return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()

    return match


@pytest.mark.parametrize(
    ("text", "parallel", "expected"),
    [
        (f"[{PARIS}]", True, True),
        (f"[{NOW}, {PARIS}]", True, True),
        (f"[{NOW}, {PARIS}]", False, False),  # one call at most
        (f"[{NOW}]", False, True),
        ("[]", True, False),  # one call at least
        ('[{"name": "get_weather", "parameters": {}}]', True, False),  # its schema holds
        ('[{"name": "rm_rf", "parameters": {}}]', True, False),  # only the tools
        ('[{"name": "get_time", "parameters": {}, "x": 1}]', True, False),
        # arguments the tool does not list (its schema does not allow more)
        ('[{"name": "get_weather", "parameters": {"city": "Paris", "units": "C"}}]', True, False),
        ('[{"name": "get_time", "parameters": {"tz": "UTC"}}]', True, False),
        (PARIS, True, False),  # an array
    ],
)
def test_required_allows_calls_of_the_tools_only(
    matches: Any, text: str, parallel: bool, expected: bool
) -> None:
    schema = required_schema(ToolRequest([WEATHER, TIME], "required", parallel))
    assert matches(schema, text) is expected


def test_required_with_one_tool_needs_no_choice_between_schemas(matches: Any) -> None:
    schema = required_schema(ToolRequest([WEATHER], "required", True))
    assert "anyOf" not in schema["items"]
    assert matches(schema, f"[{PARIS}]") and not matches(schema, f"[{NOW}]")


def test_a_named_function_constrains_to_its_arguments(matches: Any) -> None:
    request = ToolRequest([WEATHER, TIME], "get_weather", True)
    schema = request.parameters("get_weather")
    assert matches(schema, '{"city": "Paris"}') and not matches(schema, "{}")
    assert matches(ToolRequest([TIME], "get_time", True).parameters("get_time"), "{}")


def test_a_tool_that_allows_more_arguments_keeps_them(matches: Any) -> None:
    """Only where the schema says nothing are the listed properties all there is."""
    parameters = {**WEATHER["function"]["parameters"], "additionalProperties": True}  # type: ignore[dict-item]
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": parameters}}
    request = ToolRequest([tool], "get_weather", True)
    assert matches(request.parameters("get_weather"), '{"city": "Paris", "units": "C"}')
    closed = ToolRequest([WEATHER], "get_weather", True).parameters("get_weather")
    assert not matches(closed, '{"city": "Paris", "units": "C"}')
    assert "additionalProperties" not in WEATHER["function"]["parameters"]  # type: ignore[index]
