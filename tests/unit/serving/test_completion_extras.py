"""vLLM's request extras in the completion use case and the input processor, with fakes:
``best_of``'s candidates (reserved, admitted, ranked), ``bad_words`` tokenized as vLLM
does, ``truncate_prompt_tokens``, and the parameters' own checks."""

from collections.abc import AsyncIterator, Sequence
from typing import Any, ClassVar

import pytest

from application.engine.input_processor import InputProcessor
from application.engine.request_checks import RequestChecks
from application.serving.completions import BestOf, PromptJob
from domain.config import EngineConfig
from domain.errors import InvalidParameterError
from domain.request import StepOutput
from domain.sampling import SamplingParams
from tests.unit.serving.test_completions import caller, service


async def test_best_of_reserves_and_admits_every_candidate_with_logprobs() -> None:
    who, group, limits, _ = caller()
    job = PromptJob(params=SamplingParams(max_tokens=4), prompts=[[7, 8, 9]], n=2, best_of=5)
    started = await service().complete(job, who)
    assert limits.reserved == [3 + 4 * 5]
    [(ids, _, params, n)] = group.admitted
    assert (len(ids), n, params.logprobs) == (5, 5, 0)  # ranked by their tokens' logprobs
    assert len(started.streams) == 2  # the n best come back


@pytest.mark.parametrize(("best_of", "n"), [(1, 2), (17, 1)])
async def test_best_of_below_n_or_beyond_the_engine_names_best_of(best_of: int, n: int) -> None:
    job = PromptJob(params=SamplingParams(), prompts=["a"], n=n, best_of=best_of)
    with pytest.raises(InvalidParameterError) as error:
        await service().complete(job, caller()[0])
    assert error.value.param == "best_of"


def out(token: int | None, logprob: float | None, error: str | None = None) -> StepOutput:
    return StepOutput("r", token, "x", token is None, logprob=logprob, error=error)


async def replay(outputs: Sequence[StepOutput]) -> AsyncIterator[StepOutput]:
    for o in outputs:
        yield o


async def collect(streams: Sequence[AsyncIterator[StepOutput]]) -> list[list[StepOutput]]:
    return [[o async for o in s] for s in streams]


async def test_best_of_keeps_the_highest_cumulative_logprobs_best_first() -> None:
    # Cumulative: -2.0, -1.5 (three tokens), -1.0 (one token), -1.5 (tie: the earlier wins).
    candidates = [
        [out(1, -1.0), out(2, -1.0), out(None, None)],
        [out(1, -0.5), out(2, -0.5), out(3, -0.5)],
        [out(4, -1.0)],
        [out(5, -1.5)],
    ]
    chosen = await collect(BestOf([replay(c) for c in candidates], 2).streams())
    assert chosen == [candidates[2], candidates[1]]


async def test_a_failed_candidate_is_chosen_so_that_its_error_shows() -> None:
    candidates = [[out(1, -0.1)], [out(None, None, error="boom")]]
    chosen = await collect(BestOf([replay(c) for c in candidates], 1).streams())
    assert chosen[0][0].error == "boom"


class SpacedTokenizer:
    """Words as whole tokens, a leading space marked (SentencePiece / byte-level BPE)."""

    VOCAB: ClassVar = {
        "bad": [10],
        " bad": [11],
        "two words": [12, 13],
        " two words": [14, 13],
        "x": [20],
    }
    vocab_size = 100

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self.VOCAB.get(text, [30, 31, 32][: len(text)]))


def inputs(**config: Any) -> InputProcessor:
    engine_config = EngineConfig(**config)
    tokenizer: Any = SpacedTokenizer()
    checks = RequestChecks(engine_config, tokenizer, room=lambda: 8)
    return InputProcessor(engine_config, tokenizer, checks)


async def test_bad_words_are_tokenized_with_and_without_a_leading_space() -> None:
    words = await inputs().bad_words(["bad", "  two words"])
    assert words == ((10,), (11,), (12, 13), (14, 13))
    # " x" tokenizes to another length: the word alone.
    assert await inputs().bad_words(["x"]) == ((20,),)


@pytest.mark.parametrize(
    ("words", "config"), [(["w"] * 3, {"max_stop_strings": 2}), (["abcd"], {"max_stop_bytes": 3})]
)
async def test_bad_words_obey_the_stop_limits(words: list[str], config: dict) -> None:
    with pytest.raises(InvalidParameterError) as error:
        await inputs(**config).bad_words(words)
    assert error.value.param == "bad_words"


def test_truncation_keeps_the_last_tokens() -> None:
    processor = inputs(max_model_len=3)
    assert processor.truncate([1, 2, 3, 4, 5], 2) == [4, 5]
    assert processor.truncate([1, 2, 3, 4, 5], -1) == [3, 4, 5]  # the context's length
    assert processor.truncate([1, 2], None) == [1, 2]
    with pytest.raises(InvalidParameterError) as error:
        processor.truncate([1, 2], 0)
    assert error.value.param == "truncate_prompt_tokens"


@pytest.mark.parametrize(
    ("field", "value"),
    [("bad_words", ((),)), ("bad_words", ((1, -1),)), ("prompt_ranks", True)],
)
def test_the_new_parameters_are_checked(field: str, value: object) -> None:
    with pytest.raises(InvalidParameterError) as error:
        SamplingParams(**{field: value})  # type: ignore[arg-type]
    assert error.value.param == field


def test_bad_words_are_logits_processing() -> None:
    assert SamplingParams(bad_words=((1, 2),)).processes_logits
