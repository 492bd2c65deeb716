"""The runner's prompt scores on crafted logits: draws follow the distribution at the
request's temperature, with the model's logprobs; target ids get theirs."""

import math

import pytest
import torch

from adapters.torch.runtime.prompt_scores import ScoredSpan, position_uniforms, score_prompts
from domain.sampling import SamplingParams

PROBS = [0.5, 0.3, 0.15, 0.05, 0.0]  # the last id can never be drawn


def rows(count: int) -> torch.Tensor:
    """``count`` rows of logits whose softmax is ``PROBS`` (shifted: logits, not logprobs)."""
    logits = torch.tensor([math.log(p) if p else -math.inf for p in PROBS]) + 3.0
    return logits.repeat(count, 1)


def span(count: int, **params: object) -> ScoredSpan:
    return ScoredSpan("r", 0, count, SamplingParams(prompt_logprobs=True, **params))  # type: ignore[arg-type]


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_draws_follow_the_distribution_at_the_temperature(temperature: float) -> None:
    count, k = 400, 20
    scores = score_prompts(
        rows(count), [0] * count, [span(count, prompt_samples=k, temperature=temperature, seed=3)]
    )
    draws = scores.samples["r"]
    assert len(draws) == count and all(len(row) == k for row in draws)
    tempered = torch.softmax(rows(1)[0] / temperature, dim=-1).tolist()
    seen = [0] * len(PROBS)
    for row in draws:
        for token, logprob in row:
            seen[token] += 1
            # the model's logprob (temperature 1), whatever the temperature drawn at
            assert logprob == pytest.approx(math.log(PROBS[token]), abs=1e-5)
    total = count * k
    assert seen[-1] == 0
    for observed, p in zip(seen, tempered, strict=True):  # 8000 draws: within 4 sigma
        assert abs(observed / total - p) <= 4 * math.sqrt(p * (1 - p) / total) + 1e-9


def test_target_ids_get_the_model_logprobs_of_their_rows() -> None:
    logits = torch.randn(3, 6, generator=torch.Generator().manual_seed(0))
    table = ((1, 4), (), (0, 2, 5))
    scores = score_prompts(logits, [0, 0, 0], [span(3, prompt_target_ids=table)])
    expected = torch.log_softmax(logits, dim=-1)
    got = scores.targets["r"]
    assert [len(row) for row in got] == [2, 0, 3]
    for r, (ids, values) in enumerate(zip(table, got, strict=True)):
        assert values == pytest.approx([expected[r, t].item() for t in ids], abs=1e-6)


def test_uniforms_are_a_function_of_seed_row_and_draw() -> None:
    whole = position_uniforms(7, 0, 10, 5)
    assert whole.shape == (10, 5) and ((whole >= 0) & (whole < 1)).all()
    assert (position_uniforms(7, 4, 3, 5) == whole[4:7]).all()  # chunked: the same rows
    assert (position_uniforms(7, 0, 10, 2) == whole[:, :2]).all()  # fewer draws: a prefix
    assert (position_uniforms(8, 0, 10, 5) != whole).all()
    assert (position_uniforms(-1, 0, 2, 2) == position_uniforms(2**64 - 1, 0, 2, 2)).all()
    big = position_uniforms(1, 0, 1000, 20)
    assert abs(big.mean() - 0.5) < 0.01 and len(set(big.flatten().tolist())) == big.size
