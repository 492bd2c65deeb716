"""A StepObserver that records every step's statistics, for tests."""

from domain.observer import RequestStats, StepStats


class RecordingObserver:
    def __init__(self) -> None:
        self.steps: list[StepStats] = []

    def on_step(self, stats: StepStats) -> None:
        self.steps.append(stats)

    @property
    def finished(self) -> dict[str, RequestStats]:
        """Every ended request's record, by id."""
        return {r.request_id: r for step in self.steps for r in step.finished}
