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

import math
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

MAX_POINTS = 10_000
MAX_RUNS = 64  # about 0.4 MB a run of 10,000 steps with three metrics
FORWARD_PREFIX = "forward/"


@dataclass(frozen=True, slots=True)
class CurvePoint:
    """One step as read: its metrics merged so far; ``done`` once its ``optim_step`` ran."""

    step: int
    time: float  # wall clock, unix seconds, of the last result merged in
    done: bool
    metrics: dict[str, float]


@dataclass(eq=False, slots=True)
class _Curve:
    """One run's points, column by column (point ``i`` is step ``first + i``; steps are
    consecutive); a metric's column holds NaN where a step has no value of it."""

    first: int = 0
    steps: int = 0  # optim steps done
    times: "array[float]" = field(default_factory=lambda: array("d"))
    done: "array[int]" = field(default_factory=lambda: array("b"))
    columns: dict[str, "array[float]"] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)  # merges into the open step

    def open(self, now: float) -> int:
        """The index of the step in progress (a new point on its first result)."""
        if self.times and self.first + len(self.times) - 1 == self.steps:
            return len(self.times) - 1
        self.times.append(now)
        self.done.append(0)
        for column in self.columns.values():
            column.append(math.nan)
        self.counts.clear()
        return len(self.times) - 1

    def merge(self, i: int, metrics: Mapping[str, float], prefix: str = "") -> None:
        """``metrics`` into point ``i``, by each metric's reduction."""
        for raw, given in metrics.items():
            name, value = prefix + raw, float(given)
            column = self.columns.get(name)
            if column is None:
                column = self.columns[name] = array("d", [math.nan]) * len(self.times)
            old, count = column[i], self.counts.get(name, 0)
            if count == 0 or math.isnan(old):
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
            column[i] = merged
            self.counts[name] = count + 1

    def trim(self, keep: int) -> None:
        """Keep the last ``keep`` points (trimmed in batches: deleting is a copy)."""
        extra = len(self.times) - keep
        if extra < max(1, keep // 8):
            return
        del self.times[:extra]
        del self.done[:extra]
        for column in self.columns.values():
            del column[:extra]
        self.first += extra

    def point(self, i: int) -> CurvePoint:
        metrics = {n: c[i] for n, c in self.columns.items() if not math.isnan(c[i])}
        return CurvePoint(self.first + i, self.times[i], bool(self.done[i]), metrics)


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
            curve = self._runs[run_id] = _Curve()
            while len(self._runs) > self._max_runs:
                self._runs.popitem(last=False)
        else:
            self._runs.move_to_end(run_id)
        return curve

    # --- what is recorded ---------------------------------------------------------------

    def forward_backward(
        self, run_id: str, metrics: Mapping[str, float], *, forward_only: bool = False
    ) -> None:
        """A forward/backward (or forward-only) result of ``run_id``."""
        curve = self._curve(run_id)
        now = self._clock()
        i = curve.open(now)
        curve.merge(i, metrics, FORWARD_PREFIX if forward_only else "")
        curve.times[i] = now

    def optim_step(self, run_id: str, metrics: Mapping[str, float]) -> None:
        """``run_id``'s step ran: its point is complete, the next step begins."""
        curve = self._curve(run_id)
        now = self._clock()
        i = curve.open(now)
        curve.merge(i, metrics)
        curve.times[i], curve.done[i] = now, 1
        curve.steps += 1
        curve.trim(self._max_points)

    def forget(self, run_id: str) -> None:
        self._runs.pop(run_id, None)

    # --- queries ------------------------------------------------------------------------

    def steps(self, run_id: str) -> int:
        """Optim steps recorded for ``run_id`` (0 when none)."""
        curve = self._runs.get(run_id)
        return 0 if curve is None else curve.steps

    def last(self, run_id: str) -> CurvePoint | None:
        curve = self._runs.get(run_id)
        if curve is None or not curve.times:
            return None
        return curve.point(len(curve.times) - 1)

    def points(self, run_id: str, since_step: int = 0) -> list[CurvePoint]:
        """``run_id``'s last ``max_points`` points from step ``since_step`` on, oldest
        first (the step in progress last, not ``done``)."""
        curve = self._runs.get(run_id)
        if curve is None:
            return []
        count = len(curve.times)
        start = max(0, since_step - curve.first, count - self._max_points)
        return [curve.point(i) for i in range(start, count)]
