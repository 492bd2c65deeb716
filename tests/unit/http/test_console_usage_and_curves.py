"""What the console's training page reads: each training run's
metrics per step (``TrainingCurves``: chunks merged by their reduction, a point per
``optim_step``, bounded in points and runs)."""

from application.tinker.curves import TrainingCurves

DAY = 86400.0


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_chunks_merge_by_reduction_and_the_step_closes_on_optim_step() -> None:
    clock = Clock(100.0)
    curves = TrainingCurves(wall_clock=clock)
    run = "s:train:0"
    assert curves.points(run) == [] and curves.steps(run) == 0
    curves.forward_backward(run, {"loss:sum": 4.0, "acc:mean": 1.0, "k:max": 1.0, "n": 1.0})
    clock.now = 101.0
    curves.forward_backward(run, {"loss:sum": 2.0, "acc:mean": 0.0, "k:max": 3.0, "n": 7.0})
    (point,) = curves.points(run)
    assert (point.step, point.done, point.time) == (0, False, 101.0)
    assert point.metrics == {"loss:sum": 6.0, "acc:mean": 0.5, "k:max": 3.0, "n": 7.0}
    curves.optim_step(run, {"grad_norm:mean": 0.25})
    (point,) = curves.points(run)  # points are read as snapshots
    assert curves.steps(run) == 1 and point.done
    assert point.metrics["grad_norm:mean"] == 0.25
    curves.forward_backward(run, {"loss:sum": 1.0})
    curves.forward_backward(run, {"loss:sum": 9.0}, forward_only=True)
    assert [p.step for p in curves.points(run)] == [0, 1]
    (latest,) = curves.points(run, since_step=1)
    assert latest.metrics == {"loss:sum": 1.0, "forward/loss:sum": 9.0}
    assert curves.last(run) == latest


def test_an_optim_step_alone_is_a_point() -> None:
    curves = TrainingCurves()
    curves.optim_step("r", {"learning_rate:mean": 0.1})
    curves.forward_backward("r", {"loss:sum": 3.0})  # a metric first seen at step 1
    curves.optim_step("r", {"learning_rate:mean": 0.2})
    points = curves.points("r")
    assert [(p.step, p.done) for p in points] == [(0, True), (1, True)]
    assert points[0].metrics == {"learning_rate:mean": 0.1}
    assert points[1].metrics == {"learning_rate:mean": 0.2, "loss:sum": 3.0}


def test_points_and_runs_are_bounded() -> None:
    curves = TrainingCurves(max_points=3, max_runs=2)
    for step in range(5):
        curves.forward_backward("a", {"loss:sum": float(step)})
        curves.optim_step("a", {})
    assert [p.step for p in curves.points("a")] == [2, 3, 4]
    assert [p.metrics["loss:sum"] for p in curves.points("a")] == [2.0, 3.0, 4.0]
    assert [p.step for p in curves.points("a", since_step=4)] == [4]
    assert curves.steps("a") == 5
    curves.optim_step("b", {})
    curves.optim_step("a", {})  # a is the most recent again
    curves.optim_step("c", {})  # b goes
    assert curves.points("b") == [] and curves.steps("a") == 6


def test_trimmed_in_batches_yet_read_within_the_bound() -> None:
    curves = TrainingCurves(max_points=16)
    for step in range(40):
        curves.forward_backward("a", {"loss:sum": float(step)})
        curves.optim_step("a", {})
    points = curves.points("a")
    assert [p.step for p in points] == list(range(24, 40))
    assert [p.metrics["loss:sum"] for p in points] == [float(s) for s in range(24, 40)]
    assert [p.step for p in curves.points("a", since_step=38)] == [38, 39]
