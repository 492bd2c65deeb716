"""Several observers as one: each step's (or Tinker operation's) statistics go to every
observer in turn; one that raises is logged and skipped, never the others or the engine."""

from collections.abc import Sequence

import structlog

from domain.observer import StepObserver, StepStats, TrainingObserver, TrainingOpStats

log = structlog.get_logger(__name__)


class ObserverGroup:
    def __init__(self, observers: Sequence[StepObserver]) -> None:
        self.observers = tuple(observers)

    def on_step(self, stats: StepStats) -> None:
        for observer in self.observers:
            try:
                observer.on_step(stats)
            except Exception:  # observing must never break serving
                log.exception("step observer failed", observer=type(observer).__name__)


class TrainingObserverGroup:
    def __init__(self, observers: Sequence[TrainingObserver]) -> None:
        self.observers = tuple(observers)

    def on_training_op(self, stats: TrainingOpStats) -> None:
        for observer in self.observers:
            try:
                observer.on_training_op(stats)
            except Exception:  # observing must never break training
                log.exception("training observer failed", observer=type(observer).__name__)
