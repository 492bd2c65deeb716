"""TrainingCurves: each training run's metrics per step, as its results come, for the console.

A step is one ``optim_step``: the forward/backward results before it (the SDK sends a
call's data in chunks, each with its own metrics) are merged into that step's point by
the metric's reduction, Tinker's ``name:reduction`` (``:sum`` added, ``:mean`` averaged
over the chunks, ``:max`` / ``:min`` kept; others the last value), and the optimizer's
metrics (``grad_norm:mean``, ``learning_rate:mean``) close it. A point shows up with the
step's first forward/backward result and is updated until its ``optim_step``. Forward-only
passes (evaluations) are kept under ``forward/<name>``. Steps count from 0 for the run in
this process (a run resumed from a checkpoint starts again at 0); kept in memory, the last
``max_points`` steps of the ``max_runs`` runs updated most recently.
"""

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

MAX_POINTS = 10_000
MAX_RUNS = 256
FORWARD_PREFIX = "forward/"


@dataclass(slots=True)
class CurvePoint:
    """One step: ``metrics`` as merged so far; ``done`` once its ``optim_step`` ran."""

    step: int
    time: float  # wall clock, unix seconds, of the last result merged in
    metrics: dict[str, float] = field(default_factory=dict)
    done: bool = False
    _counts: dict[str, int] = field(default_factory=dict, repr=False)

    def merge(self, metrics: Mapping[str, float], now: float, prefix: str = "") -> None:
        for raw, value in metrics.items():
            name = prefix + raw
            value = float(value)
            old = self.metrics.get(name)
            count = self._counts.get(name, 0)
            if old is None:
                merged = value
            elif name.endswith(":sum"):
                merged = old + value
            elif name.endswith(":mean"):
                merged = old + (value - old) / (count + 1)
            elif name.endswith(":max"):
                merged = max(old, value)
            elif name.endswith(":min"):
                merged = min(old, value)
            else:
                merged = value
            self.metrics[name], self._counts[name] = merged, count + 1
        self.time = now


@dataclass(eq=False, slots=True)
class _Curve:
    points: deque[CurvePoint]
    steps: int = 0  # optim steps done


class TrainingCurves:
    def __init__(
        self,
        *,
        max_points: int = MAX_POINTS,
        max_runs: int = MAX_RUNS,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._max_points, self._max_runs, self._clock = max_points, max_runs, wall_clock
        self._runs: OrderedDict[str, _Curve] = OrderedDict()

    def _curve(self, run_id: str) -> _Curve:
        curve = self._runs.get(run_id)
        if curve is None:
            curve = self._runs[run_id] = _Curve(deque(maxlen=self._max_points))
            while len(self._runs) > self._max_runs:
                self._runs.popitem(last=False)
        else:
            self._runs.move_to_end(run_id)
        return curve

    def _open(self, curve: _Curve) -> CurvePoint:
        """The point of the step in progress (made on its first result)."""
        if curve.points and curve.points[-1].step == curve.steps:
            return curve.points[-1]
        point = CurvePoint(curve.steps, self._clock())
        curve.points.append(point)
        return point

    # --- what is recorded ---------------------------------------------------------------

    def forward_backward(
        self, run_id: str, metrics: Mapping[str, float], *, forward_only: bool = False
    ) -> None:
        """A forward/backward (or forward-only) result of ``run_id``."""
        curve = self._curve(run_id)
        prefix = FORWARD_PREFIX if forward_only else ""
        self._open(curve).merge(metrics, self._clock(), prefix)

    def optim_step(self, run_id: str, metrics: Mapping[str, float]) -> None:
        """``run_id``'s step ran: its point is complete, the next step begins."""
        curve = self._curve(run_id)
        point = self._open(curve)
        point.merge(metrics, self._clock())
        point.done = True
        curve.steps += 1

    def forget(self, run_id: str) -> None:
        self._runs.pop(run_id, None)

    # --- queries ------------------------------------------------------------------------

    def steps(self, run_id: str) -> int:
        """Optim steps recorded for ``run_id`` (0 when none)."""
        curve = self._runs.get(run_id)
        return 0 if curve is None else curve.steps

    def last(self, run_id: str) -> CurvePoint | None:
        curve = self._runs.get(run_id)
        return curve.points[-1] if curve is not None and curve.points else None

    def points(self, run_id: str, since_step: int = 0) -> list[CurvePoint]:
        """``run_id``'s points from step ``since_step`` on, oldest first (the step in
        progress last, not ``done``)."""
        curve = self._runs.get(run_id)
        if curve is None:
            return []
        found = []
        for point in reversed(curve.points):  # steps increase along the deque
            if point.step < since_step:
                break
            found.append(point)
        return found[::-1]
