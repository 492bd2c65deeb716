"""The reasoning split: thinking told from the answer, whole and streamed in any pieces,
where the thinking starts read from the prompt; and the grammar of a constrained answer
held back until the thinking ends."""

from typing import Any

import pytest

from adapters.torch.runtime.structured import GrammarStep
from application.serving.reasoning import Reasoning, parser_for, reasoning_for
from domain.request import Request
from domain.sampling import SamplingParams, StructuredOutput

QWEN3 = "<think>\nThe user wants 2 + 2.\nThat is 4.\n</think>\n\nThe answer is 4."


def streamed(reasoning: Reasoning, text: str, size: int) -> tuple[str, str]:
    stream = reasoning.stream()
    parts = [stream.feed(text[i : i + size]) for i in range(0, len(text), size)]
    parts.append(stream.finish())
    return "".join(p.reasoning for p in parts), "".join(p.content for p in parts)


def test_a_qwen3_answer_splits_into_thinking_and_answer() -> None:
    thinking, answer = Reasoning().split(QWEN3)
    assert thinking == "The user wants 2 + 2.\nThat is 4."
    assert answer == "The answer is 4."


@pytest.mark.parametrize("size", [1, 2, 3, 4, 7, 9, 1000])
def test_streamed_pieces_of_any_size_split_as_the_whole(size: int) -> None:
    assert streamed(Reasoning(), QWEN3, size) == Reasoning().split(QWEN3)


def test_an_answer_without_thinking_is_all_content_untouched() -> None:
    text = "  Hello <b>there</b>, no thinking here."
    assert Reasoning().split(text) == (None, text)
    for size in (1, 3, 50):
        assert streamed(Reasoning(), text, size) == ("", text)


def test_a_prompt_that_opened_the_thinking_starts_the_output_inside_it() -> None:
    # DeepSeek-R1's template ends the prompt with "<think>\n": no tag of the model's own.
    reasoning = reasoning_for("<|Assistant|><think>\n", "think")
    assert reasoning == Reasoning(starts_inside=True)
    assert reasoning.split("Hmm, 7 * 6.\n</think>\n\n42") == ("Hmm, 7 * 6.", "42")
    # Cut by max_tokens before </think>: all of it was thinking.
    assert reasoning.split("Hmm, 7 * 6 is") == ("Hmm, 7 * 6 is", "")
    assert streamed(reasoning, "Hmm, 7 * 6.\n</think>\n\n42", 2) == ("Hmm, 7 * 6.", "42")


def test_a_prompt_that_closed_the_thinking_gets_an_answer_only() -> None:
    # Qwen3 with enable_thinking: false renders an empty <think></think> itself.
    reasoning = reasoning_for("<|im_start|>assistant\n<think>\n\n</think>\n\n", "think")
    assert reasoning == Reasoning(starts_inside=False)
    assert reasoning.split("Just 4.") == (None, "Just 4.")
    assert reasoning_for("anything", "none") is None


def test_a_tag_split_across_pieces_never_leaks_into_either_part() -> None:
    pieces = ["<th", "ink>", "a</", "thi", "nk", ">", "b"]
    stream = Reasoning().stream()
    out = [stream.feed(p) for p in pieces] + [stream.finish()]
    assert "".join(p.reasoning for p in out) == "a"
    assert "".join(p.content for p in out) == "b"
    assert all("<" not in p.reasoning + p.content for p in out)


def test_the_parser_follows_the_template_unless_the_flag_says() -> None:
    assert parser_for("{{ '<think>' }}{{ messages }}") == "think"
    assert parser_for("{{ messages }}") == "none"
    assert parser_for(None) == "none"
    assert parser_for("{{ messages }}", "deepseek_r1") == "think"
    assert parser_for("{{ '<think>' }}", "none") == "none"
    with pytest.raises(ValueError, match="reasoning-parser"):
        parser_for(None, "granite")


def test_a_grammar_held_back_until_the_thinking_ends() -> None:
    close = (151668,)

    def constrained_part(generated: list[int], start_after: tuple[int, ...]) -> object:
        return StructuredOutput("json_object", start_after=start_after).constrained_tokens(
            generated
        )

    assert constrained_part([1, 2, 3], ()) == [1, 2, 3]
    assert constrained_part([1, 2, 3], close) is None
    assert constrained_part([1, 151668, 7, 8], close) == [7, 8]
    assert constrained_part([1, 9, 5, 9, 5, 6], (9, 5, 6)) == []
    assert constrained_part([9, 5], (9, 5, 6)) is None


class Matchers:
    """GrammarMatchers that note the rows they are asked to fill."""

    vocab_size = 64

    def __init__(self) -> None:
        self.filled: list[list[tuple[str, list[int]]]] = []

    def fill(self, rows: Any, bitmask: Any) -> None:
        self.filled.append([(request_id, list(tokens)) for request_id, _, tokens in rows])

    def advance(self, request_id: str, token_id: int) -> None:
        pass

    def release(self, request_id: str) -> None:
        pass


def test_the_grammar_step_masks_a_thinking_row_only_after_its_close_tag() -> None:
    close = (9,)
    thinking = StructuredOutput("json_object", start_after=close)
    params = SamplingParams(max_tokens=8, structured=thinking)
    request = Request("r1", [1, 2], params, 0.0)
    free = Request("r0", [1], SamplingParams(max_tokens=8), 0.0)
    matchers = Matchers()
    step = GrammarStep(matchers)
    request.generated_token_ids += [5, 6]  # thinking: no mask, no matcher
    assert step.begin([free, request]) is None
    request.generated_token_ids += [9, 7]  # </think>, then the answer's first token
    masks = step.begin([free, request])
    assert masks is not None and masks.rows == [1]
    masks.result()
    assert matchers.filled == [[("r1", [7])]]  # the matcher starts at the answer
