"""FutureStore: the asynchronous results the SDK polls with ``retrieve_future``.

Every long operation returns a request id at once; its coroutine runs as a task here and
its outcome (a result object or a :class:`TrainingError`) is kept until the client fetches
it. Finished futures are dropped ``ttl_s`` after they finish, so an abandoned poll leaks
nothing.
"""

import asyncio
import contextlib
import itertools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import structlog

from domain.observer import TrainingObserver, TrainingOpStats
from domain.tinker.errors import BackendFailure, NotFoundError, TrainingError

log = structlog.get_logger(__name__)


@dataclass(eq=False)
class Future:
    id: str
    owner: str
    kind: str
    created_at: float
    done_at: float | None = None
    result: object = None
    error: TrainingError | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    # For the observer: what the operation works on (set by who creates the future).
    tokens: int = 0
    run_id: str | None = None
    session_id: str | None = None
    # Called with the result when it comes, before anyone waiting is told.
    on_result: list[Callable[[object], None]] = field(default_factory=list)
    # Called with the future once it has finished, resolved or failed.
    on_done: list[Callable[["Future"], None]] = field(default_factory=list)
    task: "asyncio.Task[None] | None" = None  # the work of a future started by ``run``
    cancelled: bool = False  # cancelled by its client (``FutureStore.cancel``)

    @property
    def finished(self) -> bool:
        return self.done.is_set()


class FutureStore:
    def __init__(
        self,
        *,
        ttl_s: float = 900.0,
        clock: Callable[[], float] = time.monotonic,
        observer: TrainingObserver | None = None,
        id_tag: str = "",
    ):
        """``observer``: told of every operation that ran (metrics, traces); ``id_tag``:
        put in every future's id (a fleet's replica id, as in session ids)."""
        self._prefix = f"req-{id_tag}-" if id_tag else "req-"
        self._ttl_s = ttl_s
        self.observer = observer
        self._clock = clock
        self._futures: dict[str, Future] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._futures)

    def pending(self) -> int:
        """Futures not finished yet (queued or running)."""
        return sum(not f.finished for f in self._futures.values())

    def busy_sessions(self) -> set[str]:
        """The sessions with futures not finished yet."""
        return {f.session_id for f in self._futures.values() if not f.finished and f.session_id}

    def create(self, owner: str, kind: str) -> Future:
        self.evict_expired()
        future = Future(f"{self._prefix}{next(self._ids)}", owner, kind, self._clock())
        self._futures[future.id] = future
        return future

    def run(self, owner: str, kind: str, work: Callable[[], Awaitable[object]]) -> Future:
        """A future resolved by ``work()``, started now as a task."""
        future = self.create(owner, kind)
        task = asyncio.get_running_loop().create_task(self.settle(future, work))
        future.task = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return future

    async def settle(self, future: Future, work: Callable[[], Awaitable[object]]) -> None:
        """Run ``work()`` and resolve or fail ``future`` with its outcome."""
        start = time.monotonic()
        try:
            result = await work()
        except TrainingError as e:
            # Kept without its traceback: the frames would hold the request's tensors (and
            # a released run's adapter) for as long as the future is kept.
            self.fail(future, _bare(e))
        except asyncio.CancelledError:
            if not future.cancelled:
                self.fail(future, BackendFailure("the server shut down before this finished"))
            raise
        except Exception:
            # The details (exception text, file paths) go to the log, not to the client.
            log.exception("tinker_request_failed", request_id=future.id, kind=future.kind)
            self.fail(
                future,
                BackendFailure(f"internal error in {future.kind} (request {future.id}; logged)"),
            )
        else:
            self.resolve(future, result)
        finally:
            self._observe(future, start)

    def _observe(self, future: Future, start: float) -> None:
        if self.observer is None:
            return
        stats = TrainingOpStats(
            future.kind,
            future.owner,
            start,
            time.monotonic(),
            future.error is None,
            future.tokens,
            future.run_id,
            future.session_id,
        )
        try:
            self.observer.on_training_op(stats)
        except Exception:  # observing must never break training
            log.exception("training observer failed")

    def resolve(self, future: Future, result: object) -> None:
        if not future.finished:
            future.result, future.done_at = result, self._clock()
            for callback in future.on_result:
                try:
                    callback(result)
                except Exception:  # a hook's failure is logged, the result still served
                    log.exception("tinker_result_hook_failed", request_id=future.id)
            future.on_result.clear()
            future.done.set()
            self._done(future)

    def fail(self, future: Future, error: TrainingError) -> None:
        if not future.finished:
            future.error, future.done_at = error, self._clock()
            future.done.set()
            self._done(future)

    def _done(self, future: Future) -> None:
        callbacks, future.on_done = future.on_done, []
        future.task = None  # done with the work: the task is not kept alive by the future
        for callback in callbacks:
            try:
                callback(future)
            except Exception:  # a hook's failure is logged, the outcome still served
                log.exception("tinker_done_hook_failed", request_id=future.id)

    def cancel(self, future: Future) -> bool:
        """Stop ``future``'s work (its task is cancelled: engine requests aborted, slots
        and adapters released as the work unwinds) and fail it as cancelled; False when it
        had already finished."""
        if future.finished:
            return False
        future.cancelled = True
        task = future.task
        # Failed first: a task cancelled before it started never runs ``settle``.
        self.fail(future, CancelledByClient(f"request {future.id} was cancelled by its client"))
        if task is not None:
            task.cancel()
        return True

    def forget(self, owner: str, request_id: str) -> bool:
        """Drop a finished future of ``owner`` now (its client has its result), instead
        of ``ttl_s`` after it finished; False when unknown, another's, or not finished."""
        future = self._futures.get(request_id)
        if future is None or future.owner != owner or not future.finished:
            return False
        del self._futures[request_id]
        return True

    def get(self, owner: str, request_id: str) -> Future:
        future = self._futures.get(request_id)
        if future is None or future.owner != owner:
            raise NotFoundError(f"no future {request_id!r} (finished ones are kept a while)")
        return future

    async def wait(self, owner: str, request_id: str, timeout_s: float) -> Future:
        """The future once finished, or still pending after ``timeout_s`` (a long poll)."""
        future = self.get(owner, request_id)
        if not future.finished:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(future.done.wait(), timeout_s)
        return future

    def evict_expired(self) -> None:
        cutoff = self._clock() - self._ttl_s
        for fid in [
            f.id for f in self._futures.values() if f.done_at is not None and f.done_at < cutoff
        ]:
            del self._futures[fid]

    async def close(self) -> None:
        """Cancel running work (server shutdown); pending futures fail."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class CancelledByClient(TrainingError):
    """The client cancelled the request (``cancel_future``) before it finished."""


def _bare(error: TrainingError) -> TrainingError:
    error.__traceback__ = error.__cause__ = error.__context__ = None
    return error
