"""Speculative decoding on the torch runner with tiny models of each family: greedy output
and its logprobs are the same token for token with drafts verified in the step's forward;
seeded sampling is reproducible; and sampled output follows the model's distribution (a
chi-square test of many seeded samples against the plain sampler's). The same with a draft
model (the target itself: every draft right; another tiny model: nearly every one wrong),
its long prompts caught up in chunks and its KV pool emptied at the end."""

from collections import Counter
from pathlib import Path

import pytest
import torch

from adapters.fake import ByteTokenizer
from adapters.torch.loading.loader import load_model
from adapters.torch.runtime.runner import TorchModelRunner
from application.engine.engine import Engine
from domain.config import EngineConfig
from domain.observer import StepStats
from domain.sampling import SamplingParams
from domain.speculation import SpeculativeConfig
from tests.fakes import ListSink
from tests.support.engine_calls import add_request
from tests.support.tiny_models import save_tiny_model

TOKENIZER = ByteTokenizer()
# Prompt lookup from one token on: a tiny random model's output is drafted as soon as it
# writes a token it wrote (or read) before, and it loops quickly.
SPEC = SpeculativeConfig(
    num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3, disable_by_batch_size=None
)
PROMPT = "the cat sat on the mat and the cat sat on the hat"


class Drafts:
    def __init__(self) -> None:
        self.drafted = self.accepted = 0

    def on_step(self, stats: StepStats) -> None:
        self.drafted += stats.drafted_tokens
        self.accepted += stats.accepted_tokens


@pytest.fixture(scope="module", params=["llama", "qwen3", "gemma3"])
def model(request, tmp_path_factory):
    folder: Path = tmp_path_factory.mktemp(request.param)
    save_tiny_model(request.param, folder)
    model = load_model(folder, dtype=torch.float32)
    model.tiny_family = request.param  # the draft-model tests' other model's family
    return model


DRAFT = SpeculativeConfig(
    method="draft_model", model="tiny", num_speculative_tokens=3, disable_by_batch_size=None
)


def run(model, spec, prompts, params, max_num_seqs: int = 8, draft=None, **config_fields):
    """Each prompt's outputs and the drafts' counts; ``draft``: the draft model."""
    config = EngineConfig(
        max_num_seqs=max_num_seqs, max_model_len=192, speculative_config=spec, **config_fields
    )
    sink, drafts = ListSink(), Drafts()
    engine = Engine(
        config,
        TorchModelRunner(model, config),
        TOKENIZER,
        sink,
        observer=drafts,
        vocab_size=model.config.vocab_size,
        draft=TorchModelRunner(draft, config) if draft is not None else None,
    )
    pending = list(enumerate(zip(prompts, params, strict=True)))[::-1]
    while pending or engine.has_work():
        while pending and engine.scheduler.room() > 0:  # as many as the engine holds
            i, (prompt, p) = pending.pop()
            add_request(engine, f"r{i}", prompt, p)
        engine.step()
    if draft is not None:  # every request's draft KV went back
        speculator = engine.speculator
        assert speculator is not None and speculator.draft is not None
        assert speculator.draft.blocks.usage == 0.0
    return [sink.of(f"r{i}") for i in range(len(prompts))], drafts


def test_greedy_output_and_logprobs_are_the_same(model) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)
    prompts = [PROMPT, "a b a b a b", "xyz"]
    plain, _ = run(model, None, prompts, [greedy] * 3)
    fast, drafts = run(model, SPEC, prompts, [greedy] * 3)
    assert drafts.accepted > 0, "the tiny model's loops were meant to be drafted"
    for want, got in zip(plain, fast, strict=True):
        assert [o.token_id for o in got] == [o.token_id for o in want]
        assert [o.completion_tokens for o in got] == list(range(1, 41))
        for a, b in zip(want, got, strict=True):
            assert b.logprob == pytest.approx(a.logprob, abs=1e-4)
            assert [t for t, _ in b.top_logprobs or ()] == [t for t, _ in a.top_logprobs or ()]


def test_seeded_sampling_with_drafts_is_reproducible(model) -> None:
    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=30, ignore_eos=True)
    first, drafts = run(model, SPEC, [PROMPT], [seeded])
    again, _ = run(model, SPEC, [PROMPT], [seeded])
    assert drafts.drafted > 0
    assert [o.token_id for o in first[0]] == [o.token_id for o in again[0]]


def chi_square(a: Counter[tuple[int, ...]], b: Counter[tuple[int, ...]]) -> tuple[float, int]:
    """Two-sample chi-square statistic over the bins either sample has, and its degrees of
    freedom (equal sample sizes)."""
    bins = set(a) | set(b)
    stat = sum((a[k] - b[k]) ** 2 / (a[k] + b[k]) for k in bins)
    return stat, len(bins) - 1


@pytest.fixture(scope="module")
def other(model, tmp_path_factory):
    """Another tiny model of the family (other random weights): its drafts are wrong."""
    folder: Path = tmp_path_factory.mktemp("other")
    save_tiny_model(model.tiny_family, folder, seed=1)
    return load_model(folder, dtype=torch.float32)


def test_a_draft_models_greedy_output_is_the_targets(model, other) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)
    long = " ".join(f"w{i}" for i in range(30))  # 120 tokens: caught up in chunks of 32
    prompts = [PROMPT, "xyz", long]
    plain, _ = run(model, None, prompts, [greedy] * 3, max_num_batched_tokens=32)
    itself, right = run(model, DRAFT, prompts, [greedy] * 3, draft=model, max_num_batched_tokens=32)
    wrong, missed = run(model, DRAFT, prompts, [greedy] * 3, draft=other)
    assert right.drafted > 60 and right.accepted >= 0.9 * right.drafted
    assert missed.drafted > 0 and missed.accepted < 0.5 * missed.drafted
    for want, *got in zip(plain, itself, wrong, strict=True):
        for outputs in got:
            assert [o.token_id for o in outputs] == [o.token_id for o in want]
            for a, b in zip(want, outputs, strict=True):
                assert b.logprob == pytest.approx(a.logprob, abs=1e-4)


def test_a_draft_model_survives_preemption(model) -> None:
    # A pool of 12 blocks of 16 for three requests of 60+ tokens: they take turns.
    greedy = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    prompts = [PROMPT, "a b a b a b", "hello hello"]
    plain, _ = run(model, None, prompts, [greedy] * 3, num_kv_blocks=12)
    fast, drafts = run(model, DRAFT, prompts, [greedy] * 3, draft=model, num_kv_blocks=12)
    assert drafts.accepted > 0
    assert [[o.token_id for o in f] for f in fast] == [[o.token_id for o in p] for p in plain]


@pytest.mark.parametrize("model", ["llama"], indirect=True)
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_sampled_output_follows_the_models_distribution(model, method) -> None:
    # Four tokens allowed, the prompt made of them: every token drafts (lookup from one
    # token), so nearly every step verifies drafts; the joint law of tokens 2 and 3 must
    # not move.
    allowed = tuple(TOKENIZER.encode("ABCD", add_special_tokens=False))
    prompt = "ABCADBCDABDCABCD"
    n = 1200

    def samples(spec, draft=None):
        params = [
            SamplingParams(
                temperature=1.0, seed=i, max_tokens=3, ignore_eos=True, allowed_token_ids=allowed
            )
            for i in range(n)
        ]
        outputs, drafts = run(model, spec, [prompt] * n, params, max_num_seqs=64, draft=draft)
        return Counter(tuple(o.token_id for o in out[1:]) for out in outputs), drafts

    plain, _ = samples(None)
    # the draft model (the target, greedy, under the same allowed ids) drafts its argmax
    fast, drafts = samples(SPEC, None) if method == "ngram" else samples(DRAFT, model)
    assert drafts.drafted >= n and 0 < drafts.accepted < drafts.drafted
    stat, dof = chi_square(plain, fast)
    # 16 bins (15 degrees of freedom): the 0.1% critical value is 37.7
    assert dof <= 15 and stat < 37.7, (stat, plain, fast)
