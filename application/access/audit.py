"""Audit: each admin change written as an ``infer.audit`` log line and kept in the audit
trail (:class:`~domain.audit.AuditTrail`) for ``GET /admin/audit``. A trail that cannot be
written is logged; the change itself stands (the log line is written either way)."""

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import structlog

from domain.audit import AuditEvent, AuditTrail
from domain.errors import StoreUnavailableError

log = structlog.get_logger("infer.audit")
MAX_IN_MEMORY = 10_000


class Audit:
    def __init__(
        self, trail: AuditTrail | None = None, *, wall_clock: Callable[[], float] = time.time
    ) -> None:
        self.trail = trail if trail is not None else MemoryAuditTrail()
        self._clock = wall_clock

    def record(
        self, event: str, *, actor: str | None, subject: str, warning: bool = False, **details: Any
    ) -> None:
        (log.warning if warning else log.info)(event, actor=actor, subject=subject, **details)
        try:
            self.trail.append(AuditEvent(self._clock(), event, actor, subject, details))
        except Exception as e:
            log.error("an audit event was not stored", audited=event, error=str(e))

    def read(
        self, *, since: float | None = None, until: float | None = None, limit: int = 100
    ) -> list[AuditEvent]:
        try:
            return self.trail.read(since=since, until=until, limit=limit)
        except Exception as e:
            raise StoreUnavailableError(f"the audit trail cannot be read now: {e}") from e


class MemoryAuditTrail:
    """The newest ``max_events`` events in this process's memory (lost on restart)."""

    def __init__(self, max_events: int = MAX_IN_MEMORY) -> None:
        self._events: deque[AuditEvent] = deque(maxlen=max_events)
        self._lock = threading.Lock()

    def append(self, event: AuditEvent) -> None:
        with self._lock:
            self._events.append(event)

    def read(
        self, *, since: float | None = None, until: float | None = None, limit: int = 100
    ) -> list[AuditEvent]:
        with self._lock:
            events = list(self._events)
        kept = [
            e
            for e in reversed(events)
            if (since is None or e.at >= since) and (until is None or e.at < until)
        ]
        return kept[:limit]
