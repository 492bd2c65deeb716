"""``n`` choices of one prompt share its prefill: the first computes the prompt, the others
wait, fork its full KV blocks and run only the rest of the prompt (under a block: blocks of
16 positions here; no model, no torch)."""

import pytest

from adapters.fake import ByteTokenizer
from adapters.fake.runner import FakeModelRunner
from application.engine.engine import Engine
from domain.config import EngineConfig
from domain.errors import InvalidParameterError, QueueFullError
from domain.request import AdmitCall, Request, RequestContext
from domain.sampling import SamplingParams
from domain.scheduler import ContinuousScheduler, RunnerOutput, ScheduledChunk
from tests.fakes import ListSink

PROMPT = list(range(10, 30))  # 20 tokens
PARAMS = SamplingParams(max_tokens=3, ignore_eos=True)


def engine(budget: int = 512, batch: int = 8, **config) -> tuple[Engine, FakeModelRunner]:
    runner = FakeModelRunner()
    cfg = EngineConfig(max_num_seqs=batch, max_num_batched_tokens=budget, **config)
    return Engine(cfg, runner, ByteTokenizer(), ListSink()), runner


def chunks(runner: FakeModelRunner) -> list[list[tuple[str, int, int]]]:
    """Per step: (request id, start, tokens) of each chunk."""
    return [[_row(c) for c in step.chunks] for step in runner.steps]


def _row(chunk: ScheduledChunk) -> tuple[str, int, int]:
    return chunk.request.request_id, chunk.start, chunk.num_tokens


def run(e: Engine) -> int:
    """Steps until done; returns the prefill tokens computed."""
    prefill = 0
    while e.has_work():
        prefill += e.step().scheduler.prefill_tokens
    return prefill


def test_choices_wait_for_the_first_and_fork_its_prompt() -> None:
    e, runner = engine()
    e.admit(AdmitCall(("a", "b", "c"), (PROMPT,), PARAMS, 3))
    prefill = run(e)
    steps = chunks(runner)
    assert steps[0] == [("a", 0, 19)]  # all but the last token; b and c wait
    # Every choice runs the rest of the prompt (b and c share a's first block), and samples.
    assert steps[1] == [("a", 19, 1), ("b", 16, 4), ("c", 16, 4)]
    tables = {c.request.request_id: c.block_table for c in runner.steps[1].chunks}
    assert tables["a"][0] == tables["b"][0] == tables["c"][0]
    assert len({tables[r][1] for r in "abc"}) == 3  # the partial block is each one's own
    assert prefill == 20 + 4 + 4
    outputs = e.sink.outputs  # type: ignore[attr-defined]
    assert {o.request_id for o in outputs if o.finished} == {"a", "b", "c"}


def test_a_chunked_prefill_is_waited_for_to_its_end() -> None:
    e, runner = engine(budget=8)
    e.admit(AdmitCall(("a", "b"), (PROMPT,), PARAMS, 2))
    run(e)
    steps = chunks(runner)
    assert steps[:3] == [
        [("a", 0, 8)],
        [("a", 8, 8)],
        [("a", 16, 3)],
    ]
    assert steps[3] == [("a", 19, 1), ("b", 16, 4)]


def test_a_choice_whose_source_ended_prefills_itself() -> None:
    e, runner = engine(budget=8)
    e.admit(AdmitCall(("a", "b"), (PROMPT,), PARAMS, 2))
    e.step()  # a computed 8 of 20 tokens
    e.abort("a")
    prefill = run(e)
    assert chunks(runner)[1][0] == ("b", 0, 8)
    assert prefill == 20


def test_a_choice_whose_source_was_preempted_prefills_itself() -> None:
    config = EngineConfig(max_num_seqs=2, max_num_batched_tokens=32)
    scheduler = ContinuousScheduler(config)
    # a is the younger, so the one preempted for the urgent request.
    a = Request("a", PROMPT, PARAMS, 1.0)
    a.shares_prefill = True
    b = Request("b", PROMPT, PARAMS, 0.0, prefill_source_id="a")
    for r in (a, b):
        scheduler.add_request(r)
    first = scheduler.schedule()
    assert [_row(c) for c in first.chunks] == [("a", 0, 19)]  # b admitted, waiting
    scheduler.update_from_output(first, RunnerOutput())
    scheduler.add_request(Request("u", [1, 2], PARAMS, 2.0, context=RequestContext(priority=5)))
    second = scheduler.schedule()
    assert second.preempted == ["a"]
    # b starts from a's first block, cached when a freed it (prefix caching).
    assert ("b", 16, 4) in [_row(c) for c in second.chunks]


def test_choices_of_several_prompts_share_within_their_prompt() -> None:
    e, runner = engine()
    other = list(range(40, 45))
    e.admit(AdmitCall(("a0", "a1", "b0", "b1"), (PROMPT, other), PARAMS, 2))
    prefill = run(e)
    assert ("a1", 16, 4) in chunks(runner)[1]
    assert ("b1", 0, 5) in chunks(runner)[1]  # no full block to share
    assert prefill == 20 + 5 + 4 + 5
    requests = [c.request for c in runner.steps[1].chunks]
    assert [r.prompt_token_ids for r in requests] == [PROMPT, PROMPT, other, other]


def test_prompt_logprobs_and_one_token_prompts_are_not_shared() -> None:
    scored = SamplingParams(max_tokens=2, prompt_logprobs=True)
    e, runner = engine()
    e.admit(AdmitCall(("a", "b"), (PROMPT,), scored, 2))
    e.admit(AdmitCall(("c", "d"), ([5],), PARAMS, 2))
    run(e)
    first: dict[str, int] = {}
    for step in chunks(runner):
        for request_id, start, _ in step:
            first.setdefault(request_id, start)
    assert first == {"a": 0, "b": 0, "c": 0, "d": 0}


def test_seeded_choices_draw_from_seed_plus_their_index() -> None:
    e, _ = engine()
    requests = e.admit(AdmitCall(("a", "b", "c"), (PROMPT,), SamplingParams(seed=7), 3))
    assert [r.sampling_params.seed for r in requests] == [7, 8, 9]
    unseeded = e.admit(AdmitCall(("d", "e"), (PROMPT,), SamplingParams(), 2))
    assert [r.sampling_params.seed for r in unseeded] == [None, None]
    assert SamplingParams(seed=2**63 - 1).for_choice(1).seed == -(2**63)


def test_n_is_limited_and_counts_against_the_queue() -> None:
    e, _ = engine(batch=2, max_waiting_requests=3, max_n=4)
    with pytest.raises(InvalidParameterError) as error:
        e.checks.check_room(1, 5)
    assert error.value.param == "n"
    with pytest.raises(InvalidParameterError):
        e.checks.check_room(1, 0)
    e.checks.check_room(1, 4)
    e.admit(AdmitCall(("a", "b"), (PROMPT,), PARAMS, 2))
    with pytest.raises(QueueFullError):
        e.checks.check_room(1, 4)


def test_min_tokens_must_fit_in_max_tokens() -> None:
    with pytest.raises(InvalidParameterError) as error:
        SamplingParams(max_tokens=3, min_tokens=4)
    assert error.value.param == "min_tokens"
    assert SamplingParams(max_tokens=3, min_tokens=3).min_tokens == 3


def test_choices_share_even_when_the_first_token_ends_every_choice() -> None:
    e, runner = engine()
    e.admit(AdmitCall(("a", "b"), (PROMPT,), SamplingParams(max_tokens=1), 2))
    assert run(e) == 20 + 4
    assert chunks(runner)[1] == [("a", 19, 1), ("b", 16, 4)]
