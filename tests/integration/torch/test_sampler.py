"""The batched torch sampler: filters, penalties, seeds and logprobs, on small CPU tensors."""

from collections.abc import Sequence

import pytest
import torch
from torch.testing import assert_close

from adapters.torch.cpu.kernels import cpu_kernels
from adapters.torch.runtime.sampler import (
    SampledTokens,
    TokenSampler,
    _sample_rows,
    apply_min_p,
    apply_penalties,
    apply_top_k,
    apply_top_p,
    filtered_probs,
    make_generator,
    sample_from_probs,
)
from domain.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def _logits(batch: int, vocab: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def _sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None] | None = None,
    output_ids: Sequence[Sequence[int]] | None = None,
) -> SampledTokens:
    rows = len(params)
    return TokenSampler().sample(
        logits,
        params,
        prompt_ids=[[] for _ in range(rows)],
        output_ids=output_ids or [[] for _ in range(rows)],
        generators=generators or [None] * rows,
    )


def _draws(logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> torch.Tensor:
    """``n`` ids sampled from one ``[V]`` row, as one batch of ``n`` identical rows."""
    torch.manual_seed(seed)
    return torch.tensor(_sample(logits.expand(n, -1), [params] * n).token_ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_picks_the_argmax(dtype: torch.dtype) -> None:
    logits = _logits(5, 300).to(dtype)
    assert _sample(logits, [GREEDY] * 5).token_ids == logits.float().argmax(-1).tolist()


def test_greedy_breaks_ties_toward_the_lowest_id_even_in_a_sampled_batch() -> None:
    logits = torch.zeros(2, 10)
    logits[:, [7, 3, 8]] = 5.0
    assert _sample(logits, [GREEDY, GREEDY]).token_ids == [3, 3]
    assert _sample(logits, [GREEDY, SamplingParams()]).token_ids[0] == 3


@pytest.mark.parametrize("seed", [1234, -1, -(2**63), 2**63 - 1])  # any 64-bit signed seed
def test_the_same_seed_gives_the_same_tokens(seed: int) -> None:
    logits = _logits(1, 500, scale=1.0)
    params = [SamplingParams(temperature=1.0, top_p=0.95, seed=seed)]

    def run() -> list[int]:
        generator = make_generator(seed, "cpu")
        return [_sample(logits, params, [generator]).token_ids[0] for _ in range(20)]

    assert run() == run()


def test_a_seeded_row_gets_the_same_tokens_alone_or_batched() -> None:
    logits = _logits(4, 500, scale=1.0)
    params = SamplingParams(temperature=0.9, top_k=100, top_p=0.9, min_p=0.01)
    others = [SamplingParams(), GREEDY, SamplingParams(top_p=0.5, seed=7)]

    def run(batched: bool) -> list[int]:
        generator = make_generator(99, "cpu")
        if not batched:
            return [_sample(logits[2:3], [params], [generator]).token_ids[0] for _ in range(20)]
        generators = [None, None, generator, make_generator(7, "cpu")]
        rows = [others[0], others[1], params, others[2]]
        return [_sample(logits, rows, generators).token_ids[2] for _ in range(20)]

    assert run(batched=False) == run(batched=True)


def test_different_seeds_give_different_tokens() -> None:
    logits = torch.zeros(1, 1000)  # uniform: two seeds agreeing on 20 draws is ~1e-60
    params = [SamplingParams()]
    first, second = make_generator(1, "cpu"), make_generator(2, "cpu")
    tokens_1 = [_sample(logits, params, [first]).token_ids[0] for _ in range(20)]
    tokens_2 = [_sample(logits, params, [second]).token_ids[0] for _ in range(20)]
    assert tokens_1 != tokens_2


def test_top_k_never_samples_outside_the_k_most_likely_tokens() -> None:
    logits = _logits(1, 200, scale=1.0)[0]
    draws = _draws(logits, SamplingParams(top_k=5), 3000)
    assert set(draws.tolist()) == set(logits.topk(5).indices.tolist())


def test_apply_top_k_keeps_ties_and_leaves_disabled_rows_alone() -> None:
    logits = torch.tensor([[1.0, 4.0, 3.0, 3.0, 0.0], [1.0, 4.0, 3.0, 3.0, 0.0]])
    out = apply_top_k(logits, [2, 0])
    inf = float("-inf")
    assert_close(out[0], torch.tensor([inf, 4.0, 3.0, 3.0, inf]))
    assert_close(out[1], logits[1])


def test_apply_top_p_keeps_the_smallest_set_reaching_top_p() -> None:
    probs = torch.tensor([0.0625, 0.5, 0.1875, 0.25]).expand(5, -1)  # exact in binary
    out = apply_top_p(probs, [0.7, 0.75, 0.76, 0.1, 1.0])
    expected = [
        [0.0, 0.5, 0.0, 0.25],  # 0.5 < 0.7 <= 0.5 + 0.25
        [0.0, 0.5, 0.0, 0.25],  # reaching top_p exactly is enough
        [0.0, 0.5, 0.1875, 0.25],
        [0.0, 0.5, 0.0, 0.0],  # the top token always stays
        [0.0625, 0.5, 0.1875, 0.25],  # 1.0 disables
    ]
    assert_close(out, torch.tensor(expected))


def test_apply_top_p_matches_a_sort_based_nucleus() -> None:
    generator = torch.Generator().manual_seed(3)
    for _ in range(50):
        logits = (
            torch.randn(8, 700, generator=generator) * torch.rand(8, 1, generator=generator) * 8
        )
        probs = torch.softmax(logits, dim=-1)
        top_p = torch.rand(8, generator=generator).clamp(min=0.01).tolist()
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.double().cumsum(-1) - sorted_probs.double()
        keep_sorted = mass_before < torch.tensor(top_p, dtype=torch.float64)[:, None]
        keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
        assert torch.equal(apply_top_p(probs, top_p) > 0, keep)


def test_top_p_samples_the_renormalized_nucleus() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    draws = _draws(logits, SamplingParams(top_p=0.7), 8000)
    counts = torch.bincount(draws, minlength=4)
    assert counts[2:].sum() == 0
    assert abs(counts[0] / 8000 - 0.625) < 0.02  # 0.5 / (0.5 + 0.3)


def test_apply_min_p_drops_tokens_below_a_fraction_of_the_top() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]])
    out = apply_min_p(probs, [0.3, 0.0])
    assert_close(out, torch.tensor([[0.5, 0.3, 0.15, 0.0], [0.5, 0.3, 0.15, 0.05]]))


def test_min_p_never_samples_dropped_tokens() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    draws = _draws(logits, SamplingParams(min_p=0.35), 2000)
    assert set(draws.tolist()) == {0, 1}


def test_apply_penalties_follows_hf_and_openai_semantics() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0], [2.0, -1.0, 0.5, 3.0, -2.0]])
    out = apply_penalties(
        logits,
        prompt_ids=[[0, 1], [0]],
        output_ids=[[3, 3, 4], [1, 1]],
        repetition=[2.0, 1.0],
        presence=[0.5, 0.25],
        frequency=[0.1, 1.0],
    )
    # Row 0: repetition on {0, 1, 3, 4}; presence + frequency * count on 3 (x2) and 4 (x1).
    row_0 = [2.0 / 2, -1.0 * 2, 0.5, 3.0 / 2 - 0.5 - 0.2, -2.0 * 2 - 0.5 - 0.1]
    # Row 1: repetition 1 is neutral; token 1 occurs twice in the output.
    row_1 = [2.0, -1.0 - 0.25 - 2.0, 0.5, 3.0, -2.0]
    assert_close(out, torch.tensor([row_0, row_1]))


def test_penalties_touch_only_the_rows_that_ask_for_them() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0], [3.0, 2.9, 0.0]])
    penalized = SamplingParams(temperature=0.0, frequency_penalty=1.0)
    result = _sample(logits, [penalized, GREEDY], output_ids=[[0], [0]])
    assert result.token_ids == [1, 0]


def test_repetition_penalty_counts_prompt_tokens() -> None:
    logits = torch.tensor([[3.0, 2.0, 0.0]])
    penalized = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    result = TokenSampler().sample(
        logits, [penalized], prompt_ids=[[0]], output_ids=[[]], generators=[None]
    )
    assert result.token_ids == [1]  # 3.0 / 2 < 2.0


def test_raw_logprobs_come_from_the_model_distribution_with_sorted_top_n() -> None:
    logits = _logits(3, 50)
    params = [
        SamplingParams(
            temperature=0.5, top_k=3, repetition_penalty=1.5, logprobs=4, logprobs_mode="raw"
        ),
        SamplingParams(logprobs=0, logprobs_mode="raw"),
        SamplingParams(),
    ]
    result = _sample(logits, params, output_ids=[[1, 2], [], []])
    expected = torch.log_softmax(logits, dim=-1)
    _assert_logprobs(result, expected)


def test_processed_logprobs_are_of_the_distribution_sampled_from() -> None:
    """Penalized logits over the temperature (greedy rows: not divided), before top-k."""
    logits = _logits(3, 50)
    params = [
        SamplingParams(temperature=0.5, top_k=3, repetition_penalty=1.5, logprobs=4),
        SamplingParams(temperature=0.0, frequency_penalty=1.0, logprobs=0),
        SamplingParams(),
    ]
    result = _sample(logits, params, output_ids=[[1, 2], [3], []])
    penalized = apply_penalties(
        logits, [[], [], []], [[1, 2], [3], []], [1.5, 1, 1], [0] * 3, [0, 1, 0]
    )
    expected = torch.log_softmax(penalized / torch.tensor([0.5, 1.0, 1.0])[:, None], dim=-1)
    _assert_logprobs(result, expected)
    assert result.token_ids[1] == int(penalized[1].argmax())


def _assert_logprobs(result: SampledTokens, expected: torch.Tensor) -> None:
    assert result.logprobs is not None and result.top_logprobs is not None
    chosen = expected.gather(1, torch.tensor(result.token_ids)[:, None]).squeeze(1)
    assert_close(torch.tensor(result.logprobs), chosen)
    top = expected[0].topk(4)
    assert [i for i, _ in result.top_logprobs[0]] == top.indices.tolist()
    assert_close(torch.tensor([v for _, v in result.top_logprobs[0]]), top.values)
    assert result.top_logprobs[1:] == [[], []]


def test_no_logprobs_unless_a_row_asks() -> None:
    result = _sample(_logits(2, 50), [GREEDY, SamplingParams()])
    assert result.logprobs is None and result.top_logprobs is None


def test_each_row_of_a_mixed_batch_gets_its_own_parameters() -> None:
    logits = _logits(1, 100, scale=1.0).expand(4, -1).clone()
    top_2 = set(logits[0].topk(2).indices.tolist())
    params = [GREEDY, SamplingParams(top_k=1), SamplingParams(top_k=2), SamplingParams()]
    torch.manual_seed(0)
    seen: list[set[int]] = [set(), set(), set(), set()]
    for _ in range(100):
        for row, token in zip(seen, _sample(logits, params).token_ids, strict=True):
            row.add(token)
    argmax = int(logits[0].argmax())
    assert seen[0] == seen[1] == {argmax}
    assert seen[2] == top_2
    assert len(seen[3]) > 10


def test_temperature_sampling_follows_the_softmax_of_scaled_logits() -> None:
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0, 0.2, -2.0])
    n = 20000
    counts = torch.bincount(_draws(logits, SamplingParams(temperature=0.7), n), minlength=8)
    expected = torch.softmax(logits / 0.7, dim=-1) * n
    chi_square = float(((counts - expected) ** 2 / expected).sum())
    assert chi_square < 30.0  # 7 degrees of freedom: p ~ 1e-4


def test_sample_from_probs_inverts_the_cdf_and_never_picks_zero_probability() -> None:
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.25, 0.0]]).expand(4, -1)
    uniforms = torch.tensor([0.0, 0.49, 0.5, 1.0 - 2**-53], dtype=torch.float64)
    assert sample_from_probs(probs, uniforms).tolist() == [1, 1, 3, 3]


def test_the_input_logits_are_left_untouched() -> None:
    logits = _logits(2, 50)
    before = logits.clone()
    params = SamplingParams(top_k=5, top_p=0.5, min_p=0.1, repetition_penalty=2.0, logprobs=2)
    _sample(logits, [params, GREEDY], output_ids=[[1, 2, 3], [4]])
    assert torch.equal(logits, before)


@pytest.mark.skipif(cpu_kernels() is None, reason="no AVX512-BF16 or no C++ toolchain")
@pytest.mark.parametrize(("dtype", "vocab"), [(torch.float32, 1000), (torch.bfloat16, 1003)])
def test_the_cpu_kernel_draws_what_the_tensor_pipeline_draws(
    dtype: torch.dtype, vocab: int
) -> None:
    # TokenSampler.sample runs the fused CPU kernel on CPUs that have it; the tensor pipeline
    # (GPUs, other CPUs) must pick the same token from the same uniform.
    kinds = [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_k=20),
        SamplingParams(temperature=0.9, top_p=0.8),
        SamplingParams(temperature=1.0, top_p=0.3, min_p=0.1),
        SamplingParams(temperature=1.5, min_p=0.05),
        SamplingParams(temperature=0.5, top_k=5, top_p=0.95, min_p=0.02),
        SamplingParams(top_k=1),
        GREEDY,
    ]
    params = [kinds[i % len(kinds)] for i in range(70)]
    logits = _logits(len(params), vocab, seed=5).to(dtype)  # 1003: vector loops' tails
    logits[3, :500] = float("-inf")  # a row with half its vocabulary masked out
    uniforms = torch.rand(
        len(params), dtype=torch.float64, generator=torch.Generator().manual_seed(6)
    )
    uniforms[[p.greedy for p in params]] = 0.0
    logits[6:8, 900] = logits[6:8, 7] = logits[6:8].max() + 1  # ties at the top: the first id
    expected = sample_from_probs(filtered_probs(logits.float(), params), uniforms)
    assert _sample_rows(cpu_kernels(), logits, params, uniforms).tolist() == expected.tolist()
    for r in range(len(kinds)):  # a row alone (one stream's step: the calling thread only)
        alone = _sample_rows(
            cpu_kernels(), logits[r : r + 1], params[r : r + 1], uniforms[r : r + 1]
        )
        assert alone.tolist() == expected[r : r + 1].tolist()
