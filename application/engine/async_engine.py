"""The engine loop as one background asyncio task, and per-request output queues.

The loop runs ``Engine.step()`` (synchronous) and then yields to the event loop a few
times, so each step's tokens travel through the HTTP layer's coroutines to the sockets
before the next step starts; it sleeps on an event (no polling) when there is no work.

The step runs on the event loop's own thread on purpose: the model was loaded (and ran its
first OpenMP parallel regions) on this thread, and when a second thread also runs OpenMP
regions, libgomp sees more threads than cores and stops spinning between regions, so every
parallel op pays a thread wake-up (measured: a small add 4.5 -> 17.5 us; the model ~20%
slower, 622 vs 730-775 tok/s at 64 streams), which costs more than the streams' Python work
a worker thread would overlap.

Request preparation (tokenizing, chat rendering) runs on the thread pool of its
:class:`InputProcessor` (``.inputs``) instead.

A request's work belongs to whoever queued it: :class:`RequestGroup` holds the requests one
caller (an HTTP request) queued, and closing it aborts every one still running, whatever
ended the caller (an error after queueing, a client gone before its stream was read).
"""

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Sequence

import structlog

from application.engine.engine import Engine, EngineLoad
from application.engine.engine_client import AdmittingClient
from application.engine.input_processor import InputProcessor
from domain.config import EngineConfig
from domain.observer import StepObserver
from domain.ports import GrammarCompiler, ModelRunner, Tokenizer
from domain.request import AdmitCall, Request, StepOutput
from domain.scheduler import Scheduler
from domain.speculation import StepCosts

log = structlog.get_logger(__name__)
LOOP_CRASHED = "internal error: the engine loop stopped (details in the server log)"

# A static batch still filling up: re-check after this long instead of spinning.
_WAITING_FOR_BATCH_S = 0.001
# Event-loop passes after each step (see _loop); each costs microseconds when idle.
_FLUSH_PASSES = 8


class QueueOutputSink:
    """OutputSink feeding one asyncio.Queue per request (unbounded: the engine never waits)."""

    def __init__(self) -> None:
        self._queues: dict[str, asyncio.Queue[StepOutput]] = {}

    def open(self, request_id: str) -> asyncio.Queue[StepOutput]:
        queue: asyncio.Queue[StepOutput] = asyncio.Queue()
        self._queues[request_id] = queue
        return queue

    def close(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def publish(self, output: StepOutput) -> None:
        queue = self._queues.get(output.request_id)
        if queue is not None:  # a closed stream (client gone) drops its outputs
            queue.put_nowait(output)

    def fail(self, request_id: str, error: str) -> None:
        """End the request's stream (if open) with ``error``."""
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(StepOutput(request_id, None, "", finished=True, error=error))

    def fail_all(self, error: str) -> None:
        """End every open stream with ``error`` (the engine loop died)."""
        for request_id, queue in self._queues.items():
            queue.put_nowait(StepOutput(request_id, None, "", finished=True, error=error))

    def __len__(self) -> int:
        return len(self._queues)


class AsyncEngine(AdmittingClient):
    """The engine and its output queues, driven by one background task.

    It builds its own :class:`QueueOutputSink`, :class:`Engine` (the keyword arguments go
    to ``Engine``) and :class:`InputProcessor` over the engine's checks; ``.engine``,
    ``.sink`` and ``.inputs`` expose them."""

    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        tokenizer: Tokenizer,
        *,
        vocab_size: int | None = None,
        observer: StepObserver | None = None,
        scheduler: Scheduler | None = None,
        clock: Callable[[], float] = time.monotonic,
        grammar: GrammarCompiler | None = None,
        draft: ModelRunner | None = None,
        step_costs: StepCosts | None = None,
    ) -> None:
        """``draft``, ``step_costs``: :class:`Engine`'s."""
        self.sink = QueueOutputSink()
        self.engine = Engine(
            config,
            runner,
            tokenizer,
            self.sink,
            scheduler=scheduler,
            clock=clock,
            vocab_size=vocab_size,
            observer=observer,
            grammar=grammar,
            draft=draft,
            step_costs=step_costs,
        )
        self.inputs = InputProcessor(config, tokenizer, self.engine.checks)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the loop on the running event loop (again after ``stop``, on any loop)."""
        if self.healthy:
            raise RuntimeError("the engine loop is already running")
        self._wake = asyncio.Event()  # a fresh one: an Event binds to the loop it first waits on
        self._task = asyncio.create_task(self._run(), name="engine-loop")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            # A crash was logged and reported to every stream when it happened.
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        self.inputs.close()

    async def idle(self) -> None:
        """Wait until the engine has no work left (the loop's next step releases what
        finished requests held), or the loop is not running."""
        while self.healthy and self.engine.has_work():
            await asyncio.sleep(0)

    def load(self) -> EngineLoad:
        """The engine now (requests running and waiting, the KV pool's use, prefix-cache
        counts): what a fleet's router and its operators read."""
        return self.engine.load()

    def take_evicted(self) -> list[bytes]:
        """The prefix cache's blocks evicted since the last call, by hash (a fleet's replica
        reports them to the router)."""
        return self.engine.take_evicted()

    @property
    def healthy(self) -> bool:
        """The loop task is running (not crashed, not stopped)."""
        return self._task is not None and not self._task.done()

    def submit(self, call: AdmitCall) -> list[AsyncIterator[StepOutput]]:
        """Queue ``call``'s prompts all together or none (``Engine.admit``); one output
        stream per request id. A stream left early aborts its request; one never read does
        not: queue through a :class:`RequestGroup` where that can happen."""
        queues = [self.sink.open(request_id) for request_id in call.request_ids]
        try:
            requests = self.engine.admit(call)
        except Exception:
            for request_id in call.request_ids:
                self.sink.close(request_id)
            raise
        self._wake.set()
        return [self._drain(r, q) for r, q in zip(requests, queues, strict=True)]

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort requests (those done are left alone) and drop their output streams."""
        for request_id in request_ids:
            self.engine.abort(request_id)
            self.sink.close(request_id)

    def fail(self, request_ids: Sequence[str], error: str) -> None:
        """Abort requests, their streams ending with ``error`` (a deadline passed)."""
        for request_id in request_ids:
            self.sink.fail(request_id, error)
        self.abort(request_ids)

    async def _drain(
        self, request: Request, queue: asyncio.Queue[StepOutput]
    ) -> AsyncIterator[StepOutput]:
        try:
            while True:
                output = await queue.get()
                yield output
                if output.finished:
                    return
        finally:  # synchronous cleanup: it must run even when the consumer is cancelled
            if not request.is_done:
                self.engine.abort(request.request_id)
            self.sink.close(request.request_id)

    async def _run(self) -> None:
        try:
            await self._loop()
        except Exception:  # a bug, not a bad request: end every stream, then stop
            log.exception("engine loop crashed")
            self.sink.fail_all(LOOP_CRASHED)
            raise

    async def _loop(self) -> None:
        while True:
            if not self.engine.has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            if not self.engine.step().ran:  # a static batch still filling up
                await asyncio.sleep(_WAITING_FOR_BATCH_S)
                continue
            # A token reaches its socket through a few coroutine hand-offs (queue -> SSE
            # generator -> response -> transport); one pass of the loop per hand-off.
            for _ in range(_FLUSH_PASSES):
                await asyncio.sleep(0)
