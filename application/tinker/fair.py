"""Tenants take turns: training work one piece at a time, sampling slots in the engine.

:class:`FairScheduler` runs training jobs — each a generator of pieces (micro-batches of a
forward/backward, or a single step) — one piece at a time in a worker thread, taking
turns between tenants (API keys) and, within a tenant, between its jobs. A tenant's long
forward/backward therefore delays another tenant's step by one piece, not by the whole
call. :class:`FairSlots` hands out a bounded number of slots (Tinker sampling requests in
the serving engine) the same way.
"""

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from domain.tinker.ports import Steps

T = TypeVar("T")


@dataclass(eq=False)
class _Job:
    steps: Steps[Any]
    done: asyncio.Future[Any]
    pieces: int = 0


def _advance(steps: Steps[Any]) -> tuple[bool, Any]:
    """Run one piece: (finished, value)."""
    try:
        next(steps)
    except StopIteration as stop:
        return True, stop.value
    return False, None


class FairScheduler:
    """One piece of work at a time, tenants served round-robin (then their jobs)."""

    def __init__(self, *, to_thread: Callable[..., Any] = asyncio.to_thread) -> None:
        self._to_thread = to_thread
        # tenant -> its jobs; a dict keeps insertion order: the next tenant is the first key.
        self._tenants: dict[str, deque[_Job]] = {}
        self._worker: asyncio.Task[None] | None = None
        self._running: str | None = None  # whose piece runs now

    def __len__(self) -> int:
        """Jobs waiting or running."""
        return sum(len(jobs) for jobs in self._tenants.values())

    def others(self, tenant: str) -> int:
        """Other tenants with work waiting or running (that ``tenant``'s work takes turns
        with)."""
        busy = {t for t, jobs in self._tenants.items() if jobs}
        if self._running is not None:
            busy.add(self._running)
        return len(busy - {tenant})

    async def run(self, tenant: str, steps: Steps[T]) -> T:
        """Run ``steps`` to the end, taking turns with every other tenant's work; its value.

        Cancelling the caller drops the job before its next piece."""
        job = _Job(steps, asyncio.get_running_loop().create_future())
        self._tenants.setdefault(tenant, deque()).append(job)
        if self._worker is None or self._worker.done():
            self._worker = asyncio.get_running_loop().create_task(self._work())
        try:
            return await asyncio.shield(job.done)
        except asyncio.CancelledError:
            job.done.cancel()
            raise

    async def _work(self) -> None:
        while self._tenants:
            tenant = next(iter(self._tenants))
            jobs = self._tenants.pop(tenant)
            job = jobs.popleft()
            if job.done.done():  # cancelled while waiting
                job.steps.close()
            else:
                self._running = tenant
                try:
                    finished, value = await self._to_thread(_advance, job.steps)
                except asyncio.CancelledError:
                    job.done.cancel()
                    raise
                except BaseException as e:  # the job failed: its caller gets the error
                    if not job.done.done():
                        job.done.set_exception(e)
                else:
                    job.pieces += 1
                    if job.done.done():
                        job.steps.close()
                    elif finished:
                        job.done.set_result(value)
                    else:
                        jobs.append(job)  # its next piece after the other jobs' turns
                finally:
                    self._running = None
            if jobs:  # the tenant goes to the back of the line
                self._tenants[tenant] = jobs

    async def close(self) -> None:
        """Stop: waiting jobs are cancelled (a piece already running finishes)."""
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
            self._worker = None
        for jobs in self._tenants.values():
            for job in jobs:
                job.done.cancel()
                job.steps.close()
        self._tenants.clear()


@dataclass(eq=False)
class _Waiter:
    granted: asyncio.Future[None]


@dataclass(eq=False)
class FairSlots:
    """At most ``size`` holders at once; waiters get freed slots tenant by tenant."""

    size: int
    _held: int = 0
    _waiting: dict[str, deque[_Waiter]] = field(default_factory=dict)

    @property
    def held(self) -> int:
        return self._held

    def waiting(self, tenant: str) -> int:
        """``tenant``'s requests waiting for a slot (all slots are held)."""
        return len(self._waiting.get(tenant, ()))

    @contextlib.asynccontextmanager
    async def slot(self, tenant: str) -> AsyncIterator[None]:
        await self._acquire(tenant)
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, tenant: str) -> None:
        if self._held < self.size and not self._waiting:
            self._held += 1
            return
        waiter = _Waiter(asyncio.get_running_loop().create_future())
        self._waiting.setdefault(tenant, deque()).append(waiter)
        try:
            await waiter.granted
        except asyncio.CancelledError:
            if waiter.granted.done() and not waiter.granted.cancelled():
                self._release()  # granted just before the cancel: pass the slot on
            else:
                self._forget(tenant, waiter)
            raise

    def _forget(self, tenant: str, waiter: _Waiter) -> None:
        queue = self._waiting.get(tenant)
        if queue is not None and waiter in queue:
            queue.remove(waiter)
            if not queue:
                del self._waiting[tenant]

    def _release(self) -> None:
        self._held -= 1
        while self._waiting and self._held < self.size:
            tenant = next(iter(self._waiting))
            queue = self._waiting.pop(tenant)
            waiter = queue.popleft()
            if queue:  # the tenant's next waiter goes to the back of the line
                self._waiting[tenant] = queue
            if not waiter.granted.done():
                self._held += 1
                waiter.granted.set_result(None)
