"""TinkerService: the one object the HTTP adapter talks to (seed 002's ServerState).

It holds the components, checks that a session is live before work is accepted for it,
and ends what hangs off a session when the session finishes or stops sending heartbeats.
"""

import asyncio
import contextlib
from pathlib import Path

import structlog

from application.tinker.checkpoints import CheckpointStore
from application.tinker.fair import FairScheduler
from application.tinker.futures import FutureStore
from application.tinker.sampling import SamplingController
from application.tinker.sessions import Session, SessionManager
from application.tinker.training import TrainingController
from domain.training import (
    CheckpointStorage,
    SamplingBackend,
    TinkerLimits,
    TrainingBackend,
)

log = structlog.get_logger(__name__)


class TinkerService:
    def __init__(
        self,
        backend: TrainingBackend,
        sampler: SamplingBackend,
        storage: CheckpointStorage,
        *,
        session_timeout_s: float = 120.0,
        future_ttl_s: float = 900.0,
        maintenance_interval_s: float = 5.0,
        long_poll_s: float = 30.0,
        ended_session_retention_s: float = 24 * 3600.0,
        limits: TinkerLimits | None = None,
    ) -> None:
        self.storage = storage
        self.limits = limits or TinkerLimits()
        self.futures = FutureStore(ttl_s=future_ttl_s)
        self.sessions = SessionManager(timeout_s=session_timeout_s)
        self.checkpoints = CheckpointStore(storage)
        self.scheduler = FairScheduler()
        self.training = TrainingController(
            backend, self.checkpoints, self.futures, limits=self.limits, scheduler=self.scheduler
        )
        self.sampling = SamplingController(
            sampler, self.training, self.checkpoints, self.futures, discard_folder=storage.discard
        )
        self.long_poll_s = long_poll_s
        self.ended_session_retention_s = ended_session_retention_s
        self._interval_s = maintenance_interval_s
        self._task: asyncio.Task[None] | None = None

    # --- lifecycle --------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._maintain())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for session in self.sessions.all():
            if session.ended is None:
                self._end(session, "stopped")
        await self.scheduler.close()
        await self.futures.close()

    async def _maintain(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                self.maintain()
            except Exception:
                log.exception("tinker_maintenance_failed")

    def maintain(self) -> None:
        """Expire silent sessions and checkpoints past their ttl; drop old futures."""
        for session in self.sessions.expire_stale():
            self._end(session, "expired")
        self.sessions.forget_ended(self.ended_session_retention_s)
        self.checkpoints.delete_expired()
        self.futures.evict_expired()

    # --- sessions ---------------------------------------------------------------------

    def live_session(self, owner: str, session_id: str) -> Session:
        return self.sessions.live(owner, session_id)

    def finish_session(self, owner: str, session_id: str) -> None:
        session = self.sessions.get(owner, session_id)
        if session.ended is None:
            self.sessions.finish(owner, session_id)
            self._end(session, "finished")

    def _end(self, session: Session, why: str) -> None:
        self.sessions.end(session, why)
        self.training.end_session(session.id, why)
        self.sampling.end_session(session.id)

    def scratch_folder(self) -> Path:
        return self.storage.scratch()
