"""The console's engine timeline (``adapters/observability/timeline.py``): steps folded into
one bucket per wall-clock second, silent seconds carried over, TTFT from the request's
arrival to its first token, inter-token latency between steps, the window bounded."""

from adapters.observability.timeline import EngineTimeline
from domain.observer import RequestStart, RequestStats, SchedulerStats, StepRow, StepStats
from domain.sampling import SamplingParams


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def step(
    time_s: float,
    running: int = 1,
    waiting: int = 0,
    *,
    prefill: int = 0,
    sampled: int = 1,
    rows: tuple[StepRow, ...] = (StepRow("a", 0, 1),),
    **extra: object,
) -> StepStats:
    scheduler = SchedulerStats(running, waiting, prefill, len(rows), 0.25, 0, 0)
    return StepStats(
        True,
        time_s,
        scheduler,
        sampled_tokens=sampled,
        rows=rows,
        **extra,  # type: ignore[arg-type]
    )


def test_steps_of_a_second_are_one_point_once_the_second_is_over() -> None:
    clock = Clock(1000.2)
    timeline = EngineTimeline(clock=clock)
    start = RequestStart("a", arrival_s=10.0, prompt_tokens=5, params=SamplingParams())
    timeline.on_step(
        step(10.5, prefill=5, started=(start,), first_tokens=("a",), rows=(StepRow("a", 5, 0),))
    )
    clock.now = 1000.6
    timeline.on_step(step(10.6, running=2, waiting=1))
    timeline.on_step(step(10.7, running=1, waiting=0))
    assert timeline.points() == []  # the second is still filling
    clock.now = 1001.1
    (point,) = timeline.points()
    assert point["t"] == 1000
    assert (point["running"], point["waiting"]) == (1, 0)  # after the last step
    assert (point["running_max"], point["waiting_max"]) == (2, 1)
    assert (point["generation_tps"], point["prompt_tps"]) == (3, 5)
    assert point["ttft_s"] == 0.5
    assert point["itl_s"] == 0.1  # 10.5 -> 10.6 -> 10.7, one decode row each
    assert point["kv_usage"] == 0.25 and point["kv_cached"] == 0.0
    assert point["prefix_hit_rate"] is None  # nothing looked up


def test_silent_seconds_carry_the_gauges_and_count_nothing() -> None:
    clock = Clock(1000.0)
    timeline = EngineTimeline(clock=clock)
    timeline.on_step(step(1.0, running=2, waiting=3))
    clock.now = 1004.5
    points = timeline.points()
    assert [p["t"] for p in points] == [1000, 1001, 1002, 1003]
    assert all((p["running"], p["waiting"]) == (2, 3) for p in points)
    assert [p["generation_tps"] for p in points] == [1, 0, 0, 0]
    assert timeline.points(since=1002) == points[3:]


def test_the_prefix_hit_rate_and_finished_requests() -> None:
    clock = Clock(50.0)
    timeline = EngineTimeline(clock=clock)
    scheduler = SchedulerStats(1, 0, 8, 0, 0.5, prefix_queried_tokens=32, prefix_hit_tokens=24)
    done = RequestStats("a", 1.0, 1.1, 1.2, 2.0, "eos", 32, 4)
    timeline.on_step(StepStats(True, 2.0, scheduler, finished=(done,)))
    clock.now = 51.0
    (point,) = timeline.points()
    assert point["prefix_hit_rate"] == 0.75
    assert point["finished"] == 1


def test_the_window_is_bounded() -> None:
    clock = Clock(0.0)
    timeline = EngineTimeline(window_s=5, clock=clock)
    for second in range(20):
        clock.now = float(second)
        timeline.on_step(step(float(second)))
    clock.now = 20.0
    assert [p["t"] for p in timeline.points()] == [16, 17, 18, 19]
    clock.now = 1000.0  # long idle: at most a window of silent seconds is made up
    assert len(timeline.points()) == 4
    assert len(timeline._buckets) <= 6


def test_no_inter_token_latency_across_an_idle_engine() -> None:
    clock = Clock(0.0)
    timeline = EngineTimeline(clock=clock)
    timeline.on_step(step(1.0, running=0))  # the last request ended: idle next
    timeline.on_step(step(5.0))
    clock.now = 1.0
    (point,) = timeline.points()
    assert point["itl_s"] is None
