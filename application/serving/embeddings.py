"""Embeddings for concurrent requests, batched: one forward at a time, off the event loop.

Requests queue their (tokenized) inputs; one worker task takes every request waiting, up to
``embedding_batch_inputs`` inputs (a request's inputs always run together), and runs them through
the :class:`Embedder` in one call in a thread. Requests that arrive meanwhile wait for the
next call, so under load each call serves many requests and an idle server answers at once.
Beyond ``max_embedding_queue`` waiting inputs a request is refused (``QueueFullError``).
"""

import asyncio
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import structlog

from domain.errors import InvalidParameterError, QueueFullError
from domain.ports import Embedder

log = structlog.get_logger(__name__)
# One input: a text, or token ids taken as they are (special tokens included).
EmbeddingInput = str | Sequence[int]


@dataclass(frozen=True)
class EmbeddingLimits:
    # Named as the flags of `infer serve`.
    max_embedding_inputs: int = 2048  # OpenAI's limit
    max_embedding_queue: int = 4096
    embedding_batch_inputs: int = 256
    max_input_bytes: int = 1 << 20  # UTF-8 size of one text (the chat face's max_prompt_bytes)

    def __post_init__(self) -> None:
        for name in (
            "max_embedding_inputs",
            "max_embedding_queue",
            "embedding_batch_inputs",
            "max_input_bytes",
        ):
            if getattr(self, name) < 1:
                raise InvalidParameterError(name, "must be at least 1")


@dataclass(frozen=True)
class _Job:
    inputs: list[list[int]]
    future: "asyncio.Future[list[list[float]]]"


class EmbeddingService:
    """``model_name``: the name clients ask for."""

    def __init__(
        self, embedder: Embedder, model_name: str, limits: EmbeddingLimits | None = None
    ) -> None:
        self.embedder, self.model_name = embedder, model_name
        self.limits = limits or EmbeddingLimits()
        self._jobs: deque[_Job] = deque()
        self._queued = 0  # inputs in self._jobs
        self._wake = asyncio.Event()
        self._worker: asyncio.Task[None] | None = None

    @property
    def max_tokens(self) -> int:
        return self.embedder.max_tokens

    @property
    def dimensions(self) -> int:
        return self.embedder.dimensions

    async def prepare(self, inputs: Sequence[EmbeddingInput]) -> list[list[int]]:
        """Every input as token ids (texts tokenized off the event loop, truncated to
        ``max_tokens``); ``InvalidParameterError`` naming ``input`` for a bad one."""
        self._check(inputs)
        texts = [text for text in inputs if isinstance(text, str)]
        tokenized = iter(await asyncio.to_thread(self.embedder.tokenize, texts) if texts else [])
        return [next(tokenized) if isinstance(x, str) else list(x) for x in inputs]

    async def embed(self, inputs: list[list[int]]) -> list[list[float]]:
        """One vector per input, from the next batched call (``QueueFullError``: too many
        inputs wait already)."""
        if self._queued + len(inputs) > self.limits.max_embedding_queue:
            raise QueueFullError(
                f"{self._queued} embedding inputs are waiting (at most "
                f"{self.limits.max_embedding_queue}); retry later"
            )
        self._start_worker()
        job = _Job(inputs, asyncio.get_running_loop().create_future())
        self._jobs.append(job)
        self._queued += len(inputs)
        self._wake.set()
        return await job.future

    async def stop(self) -> None:
        """End the worker; requests still waiting fail."""
        if self._worker is not None:
            self._worker.cancel()
            if self._worker.get_loop() is asyncio.get_running_loop():
                await asyncio.gather(self._worker, return_exceptions=True)
            self._worker = None
        while self._jobs:
            self._finish(self._take(), error=_shutting_down())

    def _check(self, inputs: Sequence[EmbeddingInput]) -> None:
        limits = self.limits
        if not inputs:
            raise InvalidParameterError("input", "must not be empty")
        if len(inputs) > limits.max_embedding_inputs:
            raise InvalidParameterError(
                "input", f"{len(inputs)} inputs; at most {limits.max_embedding_inputs}"
            )
        for i, x in enumerate(inputs):
            if isinstance(x, str):
                self._check_text(i, x)
            else:
                self._check_ids(i, x)

    def _check_text(self, i: int, text: str) -> None:
        if not text:
            raise InvalidParameterError("input", f"input[{i}] is an empty string")
        if len(text.encode("utf-8", "surrogatepass")) > self.limits.max_input_bytes:
            raise InvalidParameterError(
                "input", f"input[{i}] is over {self.limits.max_input_bytes} bytes"
            )

    def _check_ids(self, i: int, ids: Sequence[int]) -> None:
        if not ids:
            raise InvalidParameterError("input", f"input[{i}] has no tokens")
        if len(ids) > self.max_tokens:
            raise InvalidParameterError(
                "input",
                f"input[{i}] has {len(ids)} tokens; the model takes at most {self.max_tokens}",
            )
        vocab = self.embedder.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise InvalidParameterError(
                "input", f"input[{i}] has a token id outside the vocabulary [0, {vocab})"
            )

    def _start_worker(self) -> None:
        """The worker runs on the loop of the requests (a new loop gets a new worker)."""
        loop = asyncio.get_running_loop()
        if self._worker is None or self._worker.done() or self._worker.get_loop() is not loop:
            self._wake = asyncio.Event()
            self._worker = loop.create_task(self._work())

    async def _work(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while jobs := self._take():
                await self._run(jobs)

    def _take(self) -> list[_Job]:
        """The waiting requests of the next call: the first, then more while they fit in
        ``embedding_batch_inputs``; those whose caller left are dropped."""
        jobs: list[_Job] = []
        size = 0
        while self._jobs:
            job = self._jobs[0]
            if jobs and size + len(job.inputs) > self.limits.embedding_batch_inputs:
                break
            self._jobs.popleft()
            self._queued -= len(job.inputs)
            if not job.future.done():
                jobs.append(job)
                size += len(job.inputs)
        return jobs

    async def _run(self, jobs: list[_Job]) -> None:
        inputs = [ids for job in jobs for ids in job.inputs]
        try:
            vectors = await asyncio.to_thread(self.embedder.embed, inputs)
        except asyncio.CancelledError:  # stopped
            self._finish(jobs, error=_shutting_down())
            raise
        except Exception as e:
            log.exception("embedding failed", inputs=len(inputs))
            self._finish(jobs, error=e)
        else:
            self._finish(jobs, vectors=vectors)

    @staticmethod
    def _finish(
        jobs: list[_Job],
        vectors: list[list[float]] | None = None,
        error: Exception | None = None,
    ) -> None:
        start = 0
        for job in jobs:
            end = start + len(job.inputs)
            if job.future.done():  # the caller left meanwhile
                pass
            elif error is not None:
                job.future.set_exception(error)
            else:
                assert vectors is not None
                job.future.set_result(vectors[start:end])
            start = end


def _shutting_down() -> QueueFullError:
    return QueueFullError("the server is shutting down; retry")
