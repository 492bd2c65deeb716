"""Step statistics and the observer port: what Engine.step() reports, with the fake runner."""

import itertools

import pytest

from adapters.fake import ByteTokenizer
from adapters.fake.observer import RecordingObserver
from adapters.fake.runner import FakeModelRunner, reply_script
from application.engine.engine import Engine
from domain.config import EngineConfig
from domain.errors import InvalidParameterError
from domain.sampling import SamplingParams
from tests.fakes import ListSink
from tests.support.engine_calls import add_request
from tests.support.engine_runs import run_to_end

TOKENIZER = ByteTokenizer()


class Clock:
    """Ticks by one second on every read, so every recorded time is distinct and ordered."""

    def __init__(self) -> None:
        self._ticks = itertools.count()

    def __call__(self) -> float:
        return float(next(self._ticks))


def make(text: str = "Hello", runner: FakeModelRunner | None = None, **config):
    observer = RecordingObserver()
    runner = runner or FakeModelRunner(script=reply_script(TOKENIZER, text))
    engine = Engine(
        EngineConfig(**config), runner, TOKENIZER, ListSink(), clock=Clock(), observer=observer
    )
    return engine, observer


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kwargs)


def test_each_step_is_observed_and_returned() -> None:
    engine, observer = make()
    add_request(engine, "a", "hi", greedy())
    first = engine.step()
    assert first.ran and observer.steps == [first]
    assert first.scheduler.prefill_tokens == 3 and first.scheduler.decode_tokens == 0
    assert (first.scheduler.running, first.scheduler.waiting) == (1, 0)
    assert first.sampled_tokens == 1 and first.first_tokens == ("a",)
    second = engine.step()
    assert (second.scheduler.prefill_tokens, second.scheduler.decode_tokens) == (0, 1)
    assert second.first_tokens == () and second.sampled_tokens == 1


def test_a_finished_request_reports_its_life_in_order() -> None:
    engine, observer = make("Hello")
    add_request(engine, "a", "hi", greedy())
    run_to_end(engine, max_steps=200)
    record = observer.finished["a"]
    assert record.finish_reason == "eos"
    assert (record.prompt_tokens, record.completion_tokens) == (3, 6)
    assert record.scheduled_s is not None and record.first_token_s is not None
    assert record.arrival_s < record.scheduled_s < record.first_token_s < record.finished_s
    # Reported once, in the step it ended.
    assert sum(r.request_id == "a" for s in observer.steps for r in s.finished) == 1


@pytest.mark.parametrize(
    ("params", "reason"),
    [(greedy(max_tokens=2), "length"), (greedy(stop=("ll",)), "stop")],
)
def test_finish_reasons_are_reported(params: SamplingParams, reason: str) -> None:
    engine, observer = make("Hello")
    add_request(engine, "a", "hi", params)
    run_to_end(engine, max_steps=200)
    assert observer.finished["a"].finish_reason == reason


def test_a_stop_string_hit_ends_the_request_in_the_scheduler() -> None:
    engine, observer = make("Hello there")
    add_request(engine, "a", "hi", greedy(stop=("lo",)))
    run_to_end(engine, max_steps=200)
    request_stats = observer.finished["a"]
    assert request_stats.finish_reason == "stop"
    engine.step()  # the policy released the finished request's slot
    assert engine.scheduler.counts() == (0, 0) and list(engine.output) == []


def test_chunked_prefill_counts_prompt_tokens_per_step() -> None:
    engine, observer = make("Hi", max_num_batched_tokens=8, max_num_seqs=2)
    add_request(engine, "long", "x" * 19, greedy())  # 20 prompt tokens with <bos>
    for _ in range(3):
        engine.step()
    prefill = [s.scheduler.prefill_tokens for s in observer.steps]
    assert prefill == [8, 8, 4]
    assert [s.sampled_tokens for s in observer.steps] == [0, 0, 1]


def test_an_aborted_request_is_reported_at_the_next_step() -> None:
    engine, _ = make(max_num_seqs=1)
    add_request(engine, "running", "hi", greedy())
    add_request(engine, "waiting", "hi", greedy())
    engine.step()
    engine.abort("waiting")
    engine.abort("running")
    stats = engine.step()
    ended = {r.request_id: r for r in stats.finished}
    assert {k: r.finish_reason for k, r in ended.items()} == {
        "waiting": "abort",
        "running": "abort",
    }
    assert ended["waiting"].scheduled_s is None and ended["running"].first_token_s is not None


def test_kv_usage_is_the_share_of_kv_blocks_in_use() -> None:
    engine, _ = make(max_num_seqs=4, max_model_len=256, num_kv_blocks=16)
    for name in "ab":
        add_request(engine, name, "hi", greedy())  # 3 tokens: one block each
    stats = engine.step().scheduler
    assert stats.kv_usage == 2 / 16
    assert (stats.prefix_queried_tokens, stats.prefix_hit_tokens) == (6, 0)


def test_a_failed_step_reports_its_requests_as_errors() -> None:
    class Broken(FakeModelRunner):
        def execute(self, batch):  # type: ignore[no-untyped-def]
            raise RuntimeError("device lost")

    engine, observer = make(runner=Broken())
    add_request(engine, "a", "hi", greedy())
    engine.step()
    assert observer.finished["a"].finish_reason == "error"


def test_an_observer_that_raises_does_not_break_the_engine() -> None:
    class Raising:
        def on_step(self, stats):  # type: ignore[no-untyped-def]
            raise ValueError("metrics backend down")

    engine = Engine(
        EngineConfig(),
        FakeModelRunner(script=reply_script(TOKENIZER, "ok")),
        TOKENIZER,
        sink := ListSink(),
        observer=Raising(),
    )
    add_request(engine, "a", "hi", greedy())
    run_to_end(engine, max_steps=200)
    assert "".join(o.text_delta for o in sink.of("a")) == "ok"


def test_idle_steps_report_that_nothing_ran() -> None:
    engine, observer = make()
    stats = engine.step()
    assert not stats.ran and stats.sampled_tokens == 0 and observer.steps == [stats]


def test_logit_processing_ids_are_checked_against_the_vocabulary() -> None:
    engine, _ = make()
    for params in (
        greedy(logit_bias=((10**6, 1.0),)),
        greedy(allowed_token_ids=(1, 10**6)),
    ):
        with pytest.raises(InvalidParameterError):
            add_request(engine, "a", "hi", params)
