"""Scheduler policies with hand-made runner outputs (no model, no torch)."""

from domain.config import EngineConfig
from domain.request import Request, RequestState
from domain.sampling import SamplingParams
from domain.scheduler import (
    ContinuousScheduler,
    RunnerOutput,
    SchedulerOutput,
    StaticScheduler,
)
from tests.fakes import ManualClock

EOS = 0


def request(request_id: str, prompt_len: int = 3, max_tokens: int = 8) -> Request:
    params = SamplingParams(max_tokens=max_tokens)
    return Request(request_id, list(range(1, prompt_len + 1)), params, 0.0)


def static(max_num_seqs: int = 4, timeout: float = 0.0, max_waiting: int = 64):
    config = EngineConfig(
        batching_mode="static",
        max_num_seqs=max_num_seqs,
        batch_wait_timeout=timeout,
        max_waiting_requests=max_waiting,
    )
    clock = ManualClock(100.0)
    return StaticScheduler(config, [EOS], clock=clock), clock


def ids(output: SchedulerOutput) -> list[str]:
    return [c.request.request_id for c in output.chunks]


def sample(output: SchedulerOutput, token: int = 7, **overrides: int) -> RunnerOutput:
    """Every sampling chunk gets ``token`` unless overridden by request id."""
    tokens = {c.request.request_id: token for c in output.chunks if c.samples}
    return RunnerOutput(sampled_token_ids={**tokens, **overrides})


def step(scheduler, token: int = 7, **overrides: int) -> SchedulerOutput:
    output = scheduler.schedule()
    scheduler.update_from_output(output, sample(output, token, **overrides))
    return output


# Static batching


def test_static_forms_a_batch_and_returns_it_until_it_finishes() -> None:
    scheduler, _ = static()
    for name in "abc":
        scheduler.add_request(request(name))
    first = scheduler.schedule()
    assert ids(first) == ["a", "b", "c"]
    assert [(c.start, c.num_tokens) for c in first.chunks] == [(0, 3)] * 3
    assert all(r.state is RequestState.WAITING for r in scheduler.active)  # running, not done
    assert ids(scheduler.schedule()) == ["a", "b", "c"]
    assert not scheduler.waiting


def test_static_clears_a_finished_batch_and_releases_its_requests() -> None:
    scheduler, _ = static()
    scheduler.add_request(request("a"))
    scheduler.add_request(request("b"))
    scheduler.schedule()
    for r in scheduler.active:
        r.finish("eos")
    output = scheduler.schedule()
    assert output.is_empty and sorted(output.released) == ["a", "b"]
    assert scheduler.active == [] and not scheduler.has_work()


def test_static_keeps_a_partially_finished_batch() -> None:
    scheduler, _ = static()
    for name in "abc":
        scheduler.add_request(request(name))
    step(scheduler)
    scheduler.active[0].finish("eos")
    scheduler.active[1].finish("stop")
    output = scheduler.schedule()
    assert ids(output) == ["c"] and output.chunks[0].num_tokens == 1
    assert len(scheduler.active) == 3
    scheduler.active[2].finish("length")
    assert sorted(scheduler.schedule().released) == ["a", "b", "c"]


def test_static_refuses_requests_beyond_the_batch_and_waiting_limits() -> None:
    scheduler, _ = static(max_num_seqs=2, max_waiting=1)
    for name in "abc":
        assert scheduler.add_request(request(name))
    assert not scheduler.add_request(request("d"))
    step(scheduler)  # a batch of two runs, one waits: still full
    assert scheduler.room() == 0 and not scheduler.add_request(request("d"))
    scheduler.abort("a")  # an aborted request leaves room at once
    assert scheduler.room() == 1


def test_continuous_counts_running_and_waiting_requests_against_its_capacity() -> None:
    config = EngineConfig(max_num_seqs=2, max_waiting_requests=1)
    scheduler = ContinuousScheduler(config, [EOS])
    for name in "abc":
        assert scheduler.add_request(request(name, max_tokens=2))
    assert scheduler.room() == 0
    step(scheduler)
    assert scheduler.room() == 0 and not scheduler.add_request(request("d"))
    step(scheduler)  # a and b reach max_tokens
    assert scheduler.room() == 2


def test_static_batches_at_most_max_batch_size_in_arrival_order() -> None:
    scheduler, _ = static(max_num_seqs=2)
    for name in "abcde":
        scheduler.add_request(request(name))
    batches = []
    while scheduler.has_work():
        output = scheduler.schedule()
        if output.chunks and all(c.start == 0 for c in output.chunks):  # a new batch
            batches.append(ids(output))
        for r in scheduler.active:
            r.finish("length")
    assert batches == [["a", "b"], ["c", "d"], ["e"]]


def test_static_has_work_follows_the_queue_and_the_batch() -> None:
    scheduler, _ = static()
    assert not scheduler.has_work()
    scheduler.add_request(request("a"))
    assert scheduler.has_work()
    scheduler.schedule()
    scheduler.active[0].finish("eos")
    scheduler.schedule()
    assert not scheduler.has_work()


def test_bounded_wait_dispatches_at_once_when_the_batch_is_full() -> None:
    scheduler, _ = static(max_num_seqs=4, timeout=1.0)
    for name in "abcd":
        scheduler.add_request(request(name))
    assert ids(scheduler.schedule()) == ["a", "b", "c", "d"]


def test_bounded_wait_dispatches_a_partial_batch_on_timeout() -> None:
    scheduler, clock = static(max_num_seqs=4, timeout=0.01)
    scheduler.add_request(request("a"))
    scheduler.add_request(request("b"))
    assert scheduler.schedule().is_empty
    clock.now += 0.005
    assert scheduler.schedule().is_empty
    clock.now += 0.010
    assert ids(scheduler.schedule()) == ["a", "b"]


def test_bounded_wait_timer_restarts_for_each_batch() -> None:
    scheduler, clock = static(max_num_seqs=4, timeout=0.01)
    scheduler.add_request(request("a"))
    scheduler.schedule()
    clock.now += 0.02
    scheduler.schedule()
    scheduler.active[0].finish("eos")
    clock.now += 1.0  # long after the first timer: a stale deadline would dispatch at once
    scheduler.add_request(request("b"))
    assert scheduler.schedule().is_empty
    clock.now += 0.011
    assert ids(scheduler.schedule()) == ["b"]


# Runner output application (both policies share it)


def test_eos_in_a_batch_finishes_only_that_request() -> None:
    scheduler, _ = static()
    scheduler.add_request(request("a"))
    scheduler.add_request(request("b"))
    step(scheduler, a=EOS)
    a, b = scheduler.active
    assert (a.state, a.finish_reason) == (RequestState.FINISHED, "eos")
    assert not b.is_done and b.generated_token_ids == [7]


def test_max_tokens_finishes_with_length() -> None:
    scheduler, _ = static()
    scheduler.add_request(request("a", max_tokens=3))
    for _ in range(3):
        step(scheduler)
    r = scheduler.active[0]
    assert (r.generated_token_ids, r.finish_reason) == ([7, 7, 7], "length")


def test_a_stop_token_id_finishes_with_stop() -> None:
    scheduler, _ = static()
    r = Request("a", [1, 2], SamplingParams(stop_token_ids=(9,)), 0.0)
    scheduler.add_request(r)
    step(scheduler, a=9)
    assert r.finish_reason == "stop"


# Continuous batching


def continuous(max_num_seqs: int = 4, budget: int = 64) -> ContinuousScheduler:
    config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    return ContinuousScheduler(config, [EOS])


def test_continuous_admits_a_request_into_a_running_batch() -> None:
    scheduler = continuous()
    scheduler.add_request(request("a"))
    step(scheduler)
    scheduler.add_request(request("b", prompt_len=5))
    output = step(scheduler)
    assert [(c.request.request_id, c.start, c.num_tokens) for c in output.chunks] == [
        ("a", 3, 1),
        ("b", 0, 5),
    ]


def test_continuous_retires_a_finished_request_and_fills_its_slot() -> None:
    scheduler = continuous(max_num_seqs=2)
    for name in "abc":
        scheduler.add_request(request(name))
    first = step(scheduler, a=EOS)
    assert ids(first) == ["a", "b"]
    second = scheduler.schedule()
    assert second.released == ["a"]
    assert ids(second) == ["b", "c"]


def test_an_aborted_request_frees_its_slot_at_the_next_step() -> None:
    scheduler = continuous(max_num_seqs=1)
    scheduler.add_request(request("a"))
    scheduler.add_request(request("b"))
    step(scheduler)
    aborted = scheduler.abort("a")
    assert aborted is not None and aborted.finish_reason == "abort"
    output = scheduler.schedule()
    assert output.released == ["a"] and ids(output) == ["b"]


def test_aborting_a_waiting_request_removes_it_from_the_queue() -> None:
    scheduler = continuous()
    scheduler.add_request(request("a"))
    assert scheduler.abort("a") is not None
    assert scheduler.abort("a") is None and scheduler.abort("missing") is None
    assert not scheduler.has_work()


def test_the_token_budget_chunks_a_long_prompt_across_steps() -> None:
    scheduler = continuous(budget=8)
    scheduler.add_request(request("a", prompt_len=3))
    step(scheduler)
    scheduler.add_request(request("b", prompt_len=20))
    chunks = []
    for _ in range(4):
        output = step(scheduler)
        assert sum(c.num_tokens for c in output.chunks) <= 8
        chunks.append([(c.request.request_id, c.start, c.num_tokens) for c in output.chunks])
    assert chunks[0] == [("a", 3, 1), ("b", 0, 7)]
    assert chunks[1] == [("a", 4, 1), ("b", 7, 7)]
    assert chunks[2] == [("a", 5, 1), ("b", 14, 6)]  # the prompt's last chunk samples
    assert chunks[3] == [("a", 6, 1), ("b", 20, 1)]
    b = scheduler.running[1]
    assert b.generated_token_ids == [7, 7]


def test_a_partial_prompt_chunk_does_not_sample() -> None:
    scheduler = continuous(budget=4)
    scheduler.add_request(request("a", prompt_len=10))
    output = scheduler.schedule()
    assert not output.chunks[0].samples
    scheduler.update_from_output(output, RunnerOutput())
    r = scheduler.running[0]
    assert (r.num_computed_tokens, r.generated_token_ids) == (4, [])


def test_continuous_runs_at_most_max_batch_size_requests() -> None:
    scheduler = continuous(max_num_seqs=2)
    for name in "abcd":
        scheduler.add_request(request(name))
    assert ids(scheduler.schedule()) == ["a", "b"]
    assert len(scheduler.waiting) == 2


def test_the_adapters_running_and_waiting_are_reported_once_each() -> None:
    scheduler = ContinuousScheduler(EngineConfig(max_num_seqs=2), [EOS])
    for rid, adapter in (("a", "sql"), ("b", None), ("c", "chat"), ("d", "sql")):
        r = request(rid)
        r.adapter_id = adapter
        assert scheduler.add_request(r)
    assert scheduler.adapters() == ((), ("chat", "sql"))  # all waiting
    scheduler.schedule()  # two admitted: a (sql) and b (the base model)
    assert scheduler.adapters() == (("sql",), ("chat", "sql"))
