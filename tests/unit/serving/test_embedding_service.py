"""EmbeddingService: checks, batching of concurrent requests, the bounded queue."""

import asyncio
import threading
from collections.abc import Sequence

import pytest

from adapters.fake.embedder import CLS_ID, SEP_ID, FakeEmbedder
from application.serving.embeddings import EmbeddingLimits, EmbeddingService
from domain.errors import InvalidParameterError, QueueFullError


class GatedEmbedder(FakeEmbedder):
    """Each ``embed`` call waits for the gate (set it to let calls through)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.entered = threading.Event()

    def embed(self, inputs: Sequence[Sequence[int]]) -> list[list[float]]:
        self.entered.set()
        assert self.gate.wait(10)
        return super().embed(inputs)


class FailingEmbedder(FakeEmbedder):
    def embed(self, inputs: Sequence[Sequence[int]]) -> list[list[float]]:
        raise RuntimeError("model broke")


async def entered(embedder: GatedEmbedder) -> None:
    assert await asyncio.to_thread(embedder.entered.wait, 10)


async def test_prepare_tokenizes_texts_and_keeps_token_ids_in_order() -> None:
    service = EmbeddingService(FakeEmbedder(), "m")
    prepared = await service.prepare(["ab", [5, 6], "c"])
    assert prepared == [[CLS_ID, 97, 98, SEP_ID], [5, 6], [CLS_ID, 99, SEP_ID]]


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ([], "must not be empty"),
        ([""], "input[0] is an empty string"),
        (["a", []], "input[1] has no tokens"),
        ([list(range(17))], "input[0] has 17 tokens; the model takes at most 16"),
        ([[1, 258]], "outside the vocabulary"),
        ([[-1]], "outside the vocabulary"),
        (["a"] * 4, "4 inputs; at most 3"),
        (["x" * 101], "input[0] is over 100 bytes"),
    ],
)
async def test_bad_inputs_are_refused_naming_input(
    inputs: list[str | list[int]], message: str
) -> None:
    limits = EmbeddingLimits(max_embedding_inputs=3, max_input_bytes=100)
    service = EmbeddingService(FakeEmbedder(), "m", limits)
    with pytest.raises(InvalidParameterError, match=message.replace("[", r"\[")) as caught:
        await service.prepare(inputs)
    assert caught.value.param == "input"


async def test_embed_returns_each_requests_vectors() -> None:
    embedder = FakeEmbedder()
    service = EmbeddingService(embedder, "m")
    try:
        a, b = await asyncio.gather(service.embed([[1, 2]]), service.embed([[3], [4, 4]]))
    finally:
        await service.stop()
    assert a == embedder.embed([[1, 2]])
    assert b == embedder.embed([[3], [4, 4]])


async def test_requests_arriving_during_a_call_share_the_next_one() -> None:
    embedder = GatedEmbedder()
    service = EmbeddingService(embedder, "m")
    try:
        first = asyncio.ensure_future(service.embed([[1]]))
        await entered(embedder)  # the first call runs (and waits at the gate)
        others = [asyncio.ensure_future(service.embed([[i], [i, i]])) for i in range(2, 6)]
        await asyncio.sleep(0.01)
        embedder.gate.set()
        await asyncio.gather(first, *others)
    finally:
        await service.stop()
    assert embedder.calls == [[[1]], [[i, *extra] for i in range(2, 6) for extra in ([], [i])]]


async def test_a_call_takes_whole_requests_up_to_the_batch_limit() -> None:
    embedder = GatedEmbedder()
    service = EmbeddingService(embedder, "m", EmbeddingLimits(embedding_batch_inputs=3))
    try:
        first = asyncio.ensure_future(service.embed([[1]]))
        await entered(embedder)
        others = [asyncio.ensure_future(service.embed([[i], [i]])) for i in (2, 3, 4)]
        await asyncio.sleep(0.01)
        embedder.gate.set()
        await asyncio.gather(first, *others)
    finally:
        await service.stop()
    assert [len(call) for call in embedder.calls] == [1, 2, 2, 2]


async def test_a_full_queue_refuses_and_frees_as_calls_run() -> None:
    embedder = GatedEmbedder()
    service = EmbeddingService(embedder, "m", EmbeddingLimits(max_embedding_queue=3))
    try:
        running = asyncio.ensure_future(service.embed([[1]]))
        await entered(embedder)  # taken off the queue: the queue is empty again
        waiting = asyncio.ensure_future(service.embed([[2], [3]]))
        await asyncio.sleep(0)
        with pytest.raises(QueueFullError):
            await service.embed([[4], [5]])
        embedder.gate.set()
        await asyncio.gather(running, waiting)
        assert len(await service.embed([[4], [5], [6]])) == 3
    finally:
        await service.stop()


async def test_a_caller_that_left_is_not_computed() -> None:
    embedder = GatedEmbedder()
    service = EmbeddingService(embedder, "m")
    try:
        first = asyncio.ensure_future(service.embed([[1]]))
        await entered(embedder)
        gone = asyncio.ensure_future(service.embed([[2]]))
        kept = asyncio.ensure_future(service.embed([[3]]))
        await asyncio.sleep(0)
        gone.cancel()
        embedder.gate.set()
        await asyncio.gather(first, kept)
    finally:
        await service.stop()
    assert embedder.calls == [[[1]], [[3]]]


async def test_a_failed_call_fails_its_requests_and_the_worker_goes_on() -> None:
    service = EmbeddingService(FailingEmbedder(), "m")
    try:
        results = await asyncio.gather(
            service.embed([[1]]), service.embed([[2]]), return_exceptions=True
        )
        assert all(isinstance(r, RuntimeError) for r in results)
        with pytest.raises(RuntimeError, match="model broke"):
            await service.embed([[3]])
    finally:
        await service.stop()


async def test_stop_fails_the_requests_still_waiting() -> None:
    embedder = GatedEmbedder()
    service = EmbeddingService(embedder, "m")
    first = asyncio.ensure_future(service.embed([[1]]))
    await entered(embedder)
    waiting = asyncio.ensure_future(service.embed([[2]]))
    await asyncio.sleep(0)
    await service.stop()
    embedder.gate.set()
    for request in (first, waiting):
        with pytest.raises(QueueFullError, match="shutting down"):
            await request


def test_limits_must_be_positive() -> None:
    with pytest.raises(InvalidParameterError) as caught:
        EmbeddingLimits(max_embedding_queue=0)
    assert caught.value.param == "max_embedding_queue"
