"""The OutputSink port's contract, held by every implementation: ``publish`` never blocks
nor raises (the engine calls it inside its step) and keeps each request's outputs in order."""

import asyncio
from collections.abc import Callable

import pytest

from application.engine.async_engine import QueueOutputSink
from domain.ports import OutputSink
from domain.request import StepOutput
from tests.fakes import ListSink

Reader = Callable[[], list[StepOutput]]


def _queue_sink() -> tuple[OutputSink, Callable[[str], Reader]]:
    sink = QueueOutputSink()

    def reader(request_id: str) -> Reader:
        queue = sink.open(request_id)
        return lambda: drain(queue)

    return sink, reader


def _list_sink() -> tuple[OutputSink, Callable[[str], Reader]]:
    sink = ListSink()
    return sink, lambda request_id: lambda: sink.of(request_id)


def drain(queue: "asyncio.Queue[StepOutput]") -> list[StepOutput]:
    outputs = []
    while not queue.empty():
        outputs.append(queue.get_nowait())
    return outputs


@pytest.fixture(params=[_queue_sink, _list_sink], ids=["queue", "list"])
def sink_and_reader(request):
    return request.param()


def output(request_id: str, token: int, *, finished: bool = False) -> StepOutput:
    return StepOutput(request_id, token, chr(97 + token % 26), finished=finished)


def test_each_requests_outputs_keep_their_order(sink_and_reader) -> None:
    sink, reader = sink_and_reader
    read = {request_id: reader(request_id) for request_id in ("a", "b", "c")}
    for token in range(50):  # interleaved across the requests, as a step publishes
        for request_id in read:
            sink.publish(output(request_id, token, finished=token == 49))
    for request_id, outputs in read.items():
        got = outputs()
        assert [o.request_id for o in got] == [request_id] * 50
        assert [o.token_id for o in got] == list(range(50))
        assert [o.finished for o in got] == [False] * 49 + [True]


def test_publish_never_blocks_nor_waits_for_a_reader(sink_and_reader) -> None:
    sink, reader = sink_and_reader
    outputs = reader("r")
    for token in range(10_000):  # nobody reads meanwhile: nothing bounds the backlog
        sink.publish(output("r", token))
    assert len(outputs()) == 10_000


def test_publish_for_a_request_nobody_listens_to_does_not_raise(sink_and_reader) -> None:
    sink, reader = sink_and_reader
    outputs = reader("listened")
    sink.publish(output("unknown", 1))
    sink.publish(StepOutput("unknown", None, "", finished=True, error="boom"))
    sink.publish(output("listened", 2))
    assert [o.token_id for o in outputs()] == [2]


# --- QueueOutputSink: one queue per open request -------------------------------------


def test_the_queue_sink_drops_outputs_of_closed_and_unknown_requests() -> None:
    sink = QueueOutputSink()
    kept, closed = sink.open("kept"), sink.open("closed")
    sink.publish(output("closed", 1))
    sink.close("closed")
    sink.close("closed")  # twice: harmless
    sink.close("never-opened")
    for request_id in ("closed", "unknown", "kept"):
        sink.publish(output(request_id, 2))
    assert [o.token_id for o in drain(kept)] == [2]
    assert [o.token_id for o in drain(closed)] == [1]  # nothing after close
    assert len(sink) == 1


def test_the_queue_sink_fails_every_open_stream() -> None:
    sink = QueueOutputSink()
    queues = [sink.open(f"r{i}") for i in range(3)]
    sink.fail_all("engine gone")
    for queue in queues:
        [last] = drain(queue)
        assert last.finished and last.error == "engine gone" and last.token_id is None
