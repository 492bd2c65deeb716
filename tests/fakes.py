"""Shared test doubles: one definition of each fake the tests use (port fakes with a real
implementation of their own live in adapters/fake/)."""

from domain.request import StepOutput


class ListSink:
    """OutputSink that keeps every output in order (tests read them after the steps)."""

    def __init__(self) -> None:
        self.outputs: list[StepOutput] = []

    def publish(self, output: StepOutput) -> None:
        self.outputs.append(output)

    def of(self, request_id: str) -> list[StepOutput]:
        return [o for o in self.outputs if o.request_id == request_id]
