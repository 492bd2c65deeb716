"""Speculation decided per step from measured step costs (``StepCosts``, ``plan_drafts``):
drafts are verified only where their expected tokens per unit of measured time beat plain
decoding; the engine's output is the same either way."""

import pytest

from adapters.fake import ByteTokenizer
from adapters.fake.runner import FakeModelRunner, reply_script
from application.engine.engine import Engine
from application.engine.speculation import Speculator
from domain.config import EngineConfig
from domain.observer import StepStats
from domain.request import Request
from domain.sampling import SamplingParams
from domain.speculation import (
    MARGIN,
    SpeculativeConfig,
    StepCosts,
    acceptance,
    plan_drafts,
)
from tests.fakes import ListSink
from tests.support.engine_calls import add_request
from tests.support.engine_runs import run_to_end

TOKENIZER = ByteTokenizer()
CODE = "def add(a, b):\n    total = a + b\n    return total\n"
EDIT = "def add(a, b):\n    total = a - b\n    return total\n"
SPEC = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=4)

# A machine where weights dominate (drafts nearly free) and one where rows cost what they
# read (each row a full step's time): 1 and 4 sequences measured.
CHEAP = StepCosts(
    {
        1: [(0, 10.0), (1, 10.5), (2, 11.0), (3, 11.5)],
        4: [(0, 12.0), (1, 12.5), (2, 13.0), (3, 13.5), (4, 14.0), (8, 16.0), (12, 18.0)],
    }
)
LINEAR = StepCosts({1: [(0, 10.0), (1, 20.0), (2, 30.0), (3, 40.0)]})


def test_ratio_interpolates_and_knows_what_it_did_not_measure() -> None:
    assert CHEAP.ratio(1, 0) == 1.0
    assert CHEAP.ratio(1, 2) == pytest.approx(1.1)
    assert CHEAP.ratio(4, 6) == pytest.approx(15.0 / 12.0)  # between 4 and 8 drafts
    assert CHEAP.ratio(4, 16) == pytest.approx(20.0 / 12.0)  # the last two points' slope
    # 2 sequences: the 1-sequence figures, at the same share of draft rows per sequence
    assert CHEAP.ratio(2, 2) == pytest.approx(CHEAP.ratio(1, 1))
    # 3 sequences: the 1-sequence ones; a first draft row costs at least one row's there
    assert CHEAP.ratio(3, 1) == pytest.approx(CHEAP.ratio(1, 1))
    assert CHEAP.ratio(5, 0) == 1.0
    assert CHEAP.ratio(5, 1) == float("inf")  # more sequences than measured: no drafts


def test_the_likeliest_drafts_are_verified_where_they_pay() -> None:
    # 3 drafts at 60 % acceptance: 1.96 expected tokens for 1.15x the time
    assert plan_drafts(CHEAP, 1, [(3, 0.6)]) == [3]
    # where a row costs a step, no acceptance below 1 pays
    assert plan_drafts(LINEAR, 1, [(3, 0.95)]) == [0]
    # a request that keeps few of its drafts gets none; among four, the likely ones go first
    assert plan_drafts(CHEAP, 1, [(3, 0.02)]) == [0]
    counts = plan_drafts(CHEAP, 4, [(3, 0.9), (3, 0.05), (0, 0.5), (2, 0.6)])
    assert counts[0] == 3 and counts[1] == 0 and counts[2] == 0 and counts[3] >= 1
    assert plan_drafts(CHEAP, 16, [(3, 0.99)]) == [0]  # 16 sequences: not measured


def test_a_plan_beats_plain_decoding_by_the_margin_or_is_empty() -> None:
    # 1 draft at acceptance a adds a tokens for 5 % more time: pays from a > 0.05 + margin
    low = 1.05 * (1 + MARGIN) - 1 - 0.01
    assert plan_drafts(CHEAP, 1, [(1, low)]) == [0]
    assert plan_drafts(CHEAP, 1, [(1, low + 0.02)]) == [1]
    breakeven = CHEAP.breakeven(3)
    assert breakeven is not None and breakeven < 0.15
    assert LINEAR.breakeven(3) is None


def test_acceptance_starts_at_the_prior_and_follows_the_drafts() -> None:
    assert acceptance(0, 0) == 0.5
    assert acceptance(100, 0) < 0.03
    assert acceptance(100, 95) > 0.9


def _engine(costs: StepCosts | None) -> tuple[Engine, ListSink, list[int]]:
    runner = FakeModelRunner(script=reply_script(TOKENIZER, EDIT), block_size=16)
    sink, drafted = ListSink(), []

    class Drafts:
        def on_step(self, stats: StepStats) -> None:
            drafted.append(stats.drafted_tokens)

    engine = Engine(
        EngineConfig(speculative_config=SPEC),
        runner,
        TOKENIZER,
        sink,
        observer=Drafts(),
        step_costs=costs,
    )
    return engine, sink, drafted


@pytest.mark.parametrize("costs", [CHEAP, LINEAR, None])
def test_the_engine_drafts_only_where_costs_say_it_pays(costs: StepCosts | None) -> None:
    engine, sink, drafted = _engine(costs)
    add_request(engine, "r", f"Rewrite:\n{CODE}", SamplingParams(temperature=0.0, max_tokens=60))
    run_to_end(engine, max_steps=500)
    text = "".join(o.text_delta for o in sink.of("r"))
    assert text == EDIT  # the same output whatever was drafted
    if costs is LINEAR:
        assert sum(drafted) == 0
    else:  # the edit copies its prompt: drafts are kept, so they keep coming
        assert sum(drafted) > len(EDIT) // 2


def test_the_start_up_log_says_what_decides() -> None:
    assert "none" in Speculator(SPEC, 100, costs=LINEAR).policy()
    assert "per step" in Speculator(SPEC, 100, costs=CHEAP).policy()
    assert "min_acceptance" in Speculator(SPEC, 100).policy()


def test_a_rejected_request_stops_drafting_under_costs() -> None:
    speculator = Speculator(SPEC, max_model_len=200, costs=CHEAP)
    request = Request("r", [1, 2, 3, 4, 1, 2, 3, 4], SamplingParams(max_tokens=100), 0.0)
    request.generated_token_ids += [1, 2]
    speculator.propose([request], running=1)
    assert request.draft_token_ids == [3, 4, 1]  # the prior: drafts at first
    request.num_drafted, request.num_accepted = 300, 0  # none of 300 kept
    speculator.propose([request], running=1)
    assert request.draft_token_ids == []


def test_where_no_draft_can_pay_none_is_looked_up() -> None:
    # a step of 1 + k rows costing k + 1 rows: drafting never pays, so a step's requests
    # are not even indexed (64 streams of a compute-bound CPU pay nothing for it)
    request = Request("r", [1, 2, 3, 4, 1, 2, 3, 4], SamplingParams(max_tokens=100), 0.0)
    request.generated_token_ids += [1, 2]
    linear = Speculator(SPEC, max_model_len=200, costs=LINEAR)
    linear.propose([request], running=1)
    assert request.draft_token_ids == [] and linear._proposers == {}
    cheap = Speculator(SPEC, max_model_len=200, costs=CHEAP)
    cheap.propose([request], running=1)
    assert request.draft_token_ids and "r" in cheap._proposers


def test_no_drafts_while_a_running_request_is_still_prefilling() -> None:
    # two running, one sampled: the other's prompt chunk rides in the next step
    request = Request("r", [1, 2, 3, 4, 1, 2, 3, 4], SamplingParams(max_tokens=100), 0.0)
    request.generated_token_ids += [1, 2]
    speculator = Speculator(SPEC, max_model_len=200, costs=CHEAP)
    speculator.propose([request], running=2)
    assert request.draft_token_ids == []
    speculator.propose([request], running=1)  # its prompt done: drafts again
    assert request.draft_token_ids == [3, 4, 1]
