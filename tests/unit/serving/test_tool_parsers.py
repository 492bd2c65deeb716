"""Tool-call parsers: whole outputs, and the same outputs streamed in random chunks (the
argument fragments concatenate to the whole parse's arguments, valid JSON)."""

import json
import random

import pytest

from application.serving.tool_parsers import (
    FORMATS,
    NamedCallParser,
    StreamingToolParser,
    ToolCall,
    ToolCallDelta,
    parse_all,
    required_parser,
)

TOOLS = frozenset({"get_weather", "get_time"})
PARIS = ToolCall("get_weather", '{"city": "Paris"}')
TRICKY = ToolCall("get_time", '{"zone": "}{\\"<tool_call>", "at": [1, {"h": null}], "ok": true}')


def hermes() -> StreamingToolParser:
    return FORMATS["hermes"].parser(TOOLS)


def llama3() -> StreamingToolParser:
    return FORMATS["llama3_json"].parser(TOOLS)


def pythonic() -> StreamingToolParser:
    return FORMATS["pythonic"].parser(TOOLS)


def required() -> StreamingToolParser:
    return required_parser(TOOLS)


def tag(call: ToolCall) -> str:
    return f'<tool_call>\n{{"name": "{call.name}", "arguments": {call.arguments}}}\n</tool_call>'


# (parser, output, expected content, expected calls)
CASES = {
    "hermes-one": (hermes, tag(PARIS), None, [PARIS]),
    "hermes-content-then-two": (
        hermes,
        f"Let me check.\n\n{tag(PARIS)}\n{tag(TRICKY)}",
        "Let me check.",
        [PARIS, TRICKY],
    ),
    "hermes-arguments-first": (
        hermes,
        '<tool_call>{"arguments": {"city": "Paris"}, "name": "get_weather"}</tool_call>',
        None,
        [PARIS],
    ),
    "hermes-string-arguments": (
        hermes,
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>',
        None,
        [PARIS],
    ),
    "hermes-no-arguments": (
        hermes,
        '<tool_call>{"name": "get_time"}</tool_call>',
        None,
        [ToolCall("get_time", "{}")],
    ),
    "hermes-plain-text": (hermes, "No tools needed: 1 < 2.", "No tools needed: 1 < 2.", []),
    "hermes-unknown-function": (
        hermes,
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
        [],
    ),
    "hermes-malformed": (
        hermes,
        "<tool_call>not json</tool_call> ok",
        "<tool_call>not json</tool_call> ok",
        [],
    ),
    "hermes-content-after": (hermes, f"{tag(PARIS)}\nDone.", "\nDone.", [PARIS]),
    "llama3-python-tag": (
        llama3,
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
        None,
        [PARIS],
    ),
    "llama3-two": (
        llama3,
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        f'{{"name": "get_time", "arguments": {TRICKY.arguments}}}',
        None,
        [PARIS, TRICKY],
    ),
    "llama3-json-answer-is-content": (
        llama3,
        '{"name": "Bob", "age": 3}',
        '{"name": "Bob", "age": 3}',
        [],
    ),
    "llama3-text": (llama3, "  Hello there", "  Hello there", []),
    "pythonic-two": (
        pythonic,
        '[get_weather(city="Paris"), get_time(zone=\'a)b\', at=[1, {"h": None}], ok=true)]',
        None,
        [PARIS, ToolCall("get_time", '{"zone": "a)b", "at": [1, {"h": null}], "ok": true}')],
    ),
    "pythonic-text": (pythonic, "Paris is sunny [1].", "Paris is sunny [1].", []),
    "pythonic-not-literal": (pythonic, "[get_weather(city=x)]", "[get_weather(city=x)]", []),
    "required-two": (
        required,
        '[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
        f'{{"name": "get_time", "parameters": {TRICKY.arguments}}}]',
        None,
        [PARIS, TRICKY],
    ),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_whole_output_parses_to_content_and_calls(case: tuple) -> None:
    make, text, content, calls = case
    assert parse_all(make(), text) == (content, calls)


def test_an_output_cut_by_max_tokens_keeps_its_complete_calls() -> None:
    cut = (
        '[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
        '{"name": "get_time", "parameters": {"zo'
    )
    assert parse_all(required(), cut, truncated=True) == (None, [PARIS])
    assert parse_all(required(), cut) == (cut, [])  # not cut: malformed, all content
    hermes_cut = tag(PARIS) + '<tool_call>{"name": "get_time", "arguments": {"zo'
    assert parse_all(hermes(), hermes_cut, truncated=True) == (None, [PARIS])
    only_partial = '[{"name": "get_weather", "parameters": {"ci'
    assert parse_all(required(), only_partial, truncated=True) == ("", [])


def stream(parser: StreamingToolParser, text: str, seed: int) -> list[str | ToolCallDelta]:
    rng, events, i = random.Random(seed), [], 0
    while i < len(text):
        n = rng.choice([1, 1, 2, 3, 5, 8, 13])
        events += parser.feed(text[i : i + n])
        i += n
    return events + parser.finish()


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_streamed_in_any_chunks_gives_the_whole_parse(case: tuple, seed: int) -> None:
    make, text, content, calls = case
    events = stream(make(), text, seed)
    deltas = [e for e in events if isinstance(e, ToolCallDelta)]
    streamed_calls = []
    for index in sorted({d.index for d in deltas}):
        mine = [d for d in deltas if d.index == index]
        assert mine[0].name is not None and mine[0].arguments == ""  # the name comes first
        assert all(d.name is None and d.arguments for d in mine[1:])
        arguments = "".join(d.arguments for d in mine)
        assert isinstance(json.loads(arguments), dict)
        streamed_calls.append(ToolCall(mine[0].name, arguments))
    assert streamed_calls == calls
    streamed_content = "".join(e for e in events if isinstance(e, str))
    assert streamed_content == (content or ""), events
    assert all(e for e in events if isinstance(e, str))  # no empty content deltas


def test_indices_count_calls_in_order() -> None:
    events = stream(hermes(), tag(PARIS) + tag(TRICKY), seed=1)
    starts = [e for e in events if isinstance(e, ToolCallDelta) and e.name]
    assert [(d.index, d.name) for d in starts] == [(0, "get_weather"), (1, "get_time")]


def test_content_streams_before_the_output_ends() -> None:
    parser = hermes()
    assert "".join(str(e) for e in parser.feed("The weather ")) == "The weather"
    assert parser.feed("is <tool") == [" is"]  # "<tool" may begin a call: held
    assert parser.feed("box>") == [" <toolbox>"]


def test_arguments_stream_before_the_call_ends() -> None:
    parser = hermes()
    events = parser.feed('<tool_call>{"name": "get_weather", "arguments": {"city": "Pa')
    assert events == [
        ToolCallDelta(0, name="get_weather"),
        ToolCallDelta(0, arguments='{"city": "Pa'),
    ]


def test_a_named_choice_is_one_call_of_the_whole_output() -> None:
    parser = NamedCallParser("get_weather")
    events = [*parser.feed('{"city":'), *parser.feed(' "Paris"}'), *parser.finish()]
    assert events == [
        ToolCallDelta(0, name="get_weather"),
        ToolCallDelta(0, arguments='{"city":'),
        ToolCallDelta(0, arguments=' "Paris"}'),
    ]
    assert parse_all(NamedCallParser("f"), "") == ("", [])  # not an object: no call


@pytest.mark.parametrize("name", FORMATS)
def test_each_format_reads_the_calls_it_renders(name: str) -> None:
    fmt = FORMATS[name]
    calls = [
        {"name": "get_weather", "arguments": {"city": "Paris"}},
        {"name": "get_time", "arguments": {}},
    ]
    content, parsed = parse_all(fmt.parser(TOOLS), fmt.render_calls(calls))
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
