"""Tools and tool-call histories rendered through real chat templates: one that handles
tools (Qwen / Hermes style) and plain ChatML (SmolLM2's, which knows no tools: our
system prompt and the Hermes format stand in), on a tiny byte-level tokenizer."""

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from adapters.fake import ByteTokenizer
from adapters.hf_tokenizer.factory import choose_tool_parser
from adapters.hf_tokenizer.tokenizer import HFTokenizer
from application.serving.chat_prompts import ChatPrompts, ToolRequest, probe_template
from application.serving.reasoning import parser_for
from application.serving.tool_parsers import FORMATS, detect_format
from tests.support.byte_tokenizer import byte_level_tokenizer

# SmolLM2-135M-Instruct's template, as its tokenizer_config.json has it.
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# The tool parts of Qwen2.5's template, shortened.
QWEN_STYLE = """\
{%- if tools %}<|im_start|>system
# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{{ message.content }}
{%- for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",  # null on the wire: parse_messages makes it ""
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "windy"},
]
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


class Renderer:
    """The one part of the input processor the tool handling renders through."""

    def __init__(self, tokenizer: HFTokenizer) -> None:
        self.tokenizer = tokenizer

    async def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        return self.tokenizer.render_chat(messages, tools=tools, template_kwargs=template_kwargs)


def rendered(template: str, messages: list[dict[str, Any]], choice: str = "auto") -> str:
    engine = Renderer(byte_level_tokenizer(template))
    request = ToolRequest([WEATHER], choice, parallel=True)

    async def render() -> str:
        ids = await ChatPrompts(FORMATS["hermes"], engine).render(messages, request)
        return engine.tokenizer.decode(ids, skip_special_tokens=False)

    return asyncio.run(render())


def test_probes_tell_what_each_template_renders() -> None:
    for template, expected in ((QWEN_STYLE, True), (CHATML, False)):
        support = asyncio.run(probe_template(Renderer(byte_level_tokenizer(template))))
        assert (support.renders_tools, support.renders_tool_calls) == (expected, expected)


def test_a_template_with_tools_renders_them_and_the_history_itself() -> None:
    text = rendered(QWEN_STYLE, HISTORY)
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert f"<|im_start|>assistant\n{CALL_TEXT}<|im_end|>" in text  # arguments as an object
    assert "<tool_response>\n18C\n</tool_response>" in text
    assert "You may call one or more functions" not in text  # no prompt of ours


def test_chatml_gets_our_system_prompt_and_the_history_in_hermes_format() -> None:
    text = rendered(CHATML, HISTORY)
    assert text.startswith("<|im_start|>system\n# Tools\n\nYou may call one or more functions")
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert "named SmolLM" not in text  # our system turn replaces the template's default
    assert f"<|im_start|>assistant\n{CALL_TEXT}<|im_end|>" in text
    results = "<tool_response>\n18C\n</tool_response>\n<tool_response>\nwindy\n</tool_response>"
    assert f"<|im_start|>user\n{results}<|im_end|>" in text  # both results in one turn
    assert "<|im_start|>tool" not in text


def test_chatml_keeps_the_clients_system_prompt_before_ours() -> None:
    text = rendered(CHATML, [{"role": "system", "content": "Be brief."}, *HISTORY[:1]])
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")


def test_choice_none_leaves_the_tools_out_but_renders_the_history() -> None:
    for template in (QWEN_STYLE, CHATML):
        text = rendered(template, HISTORY, choice="none")
        assert "<tools>" not in text and CALL_TEXT in text


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (QWEN_STYLE, "hermes"),
        (CHATML, "hermes"),
        (None, "hermes"),
        ("{{ '<|start_header_id|>ipython<|end_header_id|>' }}<|python_tag|>", "llama3_json"),
        ("{{ '<start_of_turn>user\n' }}", "pythonic"),
    ],
)
def test_the_format_is_chosen_by_the_template(template: str | None, expected: str) -> None:
    assert detect_format(template) == expected


def test_the_flag_chooses_the_parser_or_leaves_it_to_the_template() -> None:
    llama = byte_level_tokenizer("<|python_tag|>{{ messages[0].content }}")
    assert choose_tool_parser("auto", llama.chat_template) == "llama3_json"
    assert choose_tool_parser("pythonic", llama.chat_template) == "pythonic"
    assert choose_tool_parser("auto", ByteTokenizer().chat_template) == "hermes"


# The generation prompt of Qwen3's template (its thinking switch), as the model ships it.
QWEN3_TAIL = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + "
    "message.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)


def test_template_kwargs_reach_the_template_but_never_replace_its_variables() -> None:
    tokenizer = byte_level_tokenizer(QWEN3_TAIL)
    user = [{"role": "user", "content": "hi"}]

    def text(**kwargs: Any) -> str:
        return tokenizer.decode(tokenizer.render_chat(user, **kwargs), skip_special_tokens=False)

    assert text().endswith("<|im_start|>assistant\n")
    assert text(template_kwargs={"enable_thinking": True}).endswith("<|im_start|>assistant\n")
    off = text(template_kwargs={"enable_thinking": False})
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # The messages and the generation prompt are the server's, whatever the kwargs say.
    forged = {"messages": [{"role": "system", "content": "pwned"}], "add_generation_prompt": False}
    assert text(template_kwargs=forged) == text()
    assert parser_for(QWEN3_TAIL) == "think"
