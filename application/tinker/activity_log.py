"""AuditLog: each tenant's Tinker operations that change what it owns, for ``/audit``.

Sessions (created, finished, expired, moved into a project), training runs (created) and
checkpoints (saved, deleted, expired, published, unpublished, ttl set) are recorded as
``<resource>_<action>`` events with who did it. The log is in memory: the newest
``max_entries`` per tenant, for at most ``max_tenants`` tenants (the least recently
active dropped), lost on restart. :class:`AuditedCheckpoints` and :class:`AuditedSessions`
are the catalogs that record their changes here.

Principals are named by URNs made from the tenant id (never from an API key).
"""

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from typing import Any

from application.tinker.checkpoints import CheckpointStore
from application.tinker.sessions import Session, SessionManager
from domain.tinker.errors import InvalidTrainingRequest
from domain.tinker.ports import CheckpointStorage
from domain.tinker.values import CheckpointRecord, CheckpointRef, RunRecord, checkpoint_id

MAX_ENTRIES = 10_000
MAX_TENANTS = 1024
SERVER = "tml:service:infer"  # the actor of what the server does on its own (expiry)
# ``event_type`` -> the resource its events are about (None: all).
EVENT_TYPES: dict[str, str | None] = {
    "all": None,
    "checkpoints": "checkpoint",
    "projects": "project",
    "teams": "team",
    "organizations": "organization",
}


def user_urn(tenant: str) -> str:
    """The URN of the principal a tenant is (its API keys act as it)."""
    return f"tml:user:{tenant}"


def org_urn(tenant: str) -> str:
    """The URN of a tenant's organization: each tenant is its own."""
    return f"tml:organization:{tenant}"


@dataclass(frozen=True, slots=True)
class AuditEntry:
    timestamp: float  # unix seconds
    resource: str
    action: str
    details: Mapping[str, object] = field(default_factory=dict)
    model_id: str | None = None
    tinker_path: str | None = None

    @property
    def event(self) -> str:
        return f"{self.resource}_{self.action}"


class AuditLog:
    def __init__(
        self,
        *,
        max_entries: int = MAX_ENTRIES,
        max_tenants: int = MAX_TENANTS,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._max_entries = max_entries
        self._max_tenants = max_tenants
        self._clock = wall_clock
        self._logs: OrderedDict[str, deque[AuditEntry]] = OrderedDict()
        self._lock = threading.Lock()  # checkpoints are written from worker threads

    def record(
        self,
        owner: str,
        resource: str,
        action: str,
        details: Mapping[str, object] | None = None,
        *,
        actor: str | None = None,
        model_id: str | None = None,
        tinker_path: str | None = None,
    ) -> None:
        """One event of ``owner``'s; ``actor``: who did it (default: the owner)."""
        entry = AuditEntry(
            self._clock(),
            resource,
            action,
            {"actor": actor or user_urn(owner), **(details or {})},
            model_id,
            tinker_path,
        )
        with self._lock:
            log = self._logs.get(owner)
            if log is None:
                log = self._logs[owner] = deque(maxlen=self._max_entries)
                while len(self._logs) > self._max_tenants:
                    self._logs.popitem(last=False)
            else:
                self._logs.move_to_end(owner)
            log.append(entry)

    def entries(
        self, owner: str, *, event_type: str = "all", day: date | None = None
    ) -> list[AuditEntry]:
        """``owner``'s events of one UTC day (default: today), oldest first."""
        if event_type not in EVENT_TYPES:
            raise InvalidTrainingRequest(
                f"event_type must be one of {', '.join(EVENT_TYPES)}, not {event_type!r}"
            )
        resource = EVENT_TYPES[event_type]
        day = day or datetime.fromtimestamp(self._clock(), UTC).date()
        start = datetime(day.year, day.month, day.day, tzinfo=UTC).timestamp()
        end = start + timedelta(days=1).total_seconds()
        with self._lock:
            log = list(self._logs.get(owner, ()))
        return [
            e
            for e in log
            if start <= e.timestamp < end and (resource is None or e.resource == resource)
        ]


class AuditedCheckpoints(CheckpointStore):
    """The checkpoint catalog, its changes recorded in ``audit``; ``on_saved``: told of
    every checkpoint saved (usage)."""

    def __init__(
        self,
        storage: CheckpointStorage,
        audit: AuditLog,
        *,
        on_saved: Callable[[CheckpointRecord], None] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(storage, **kwargs)
        self.audit = audit
        self._on_saved = on_saved

    def save_run(self, run: RunRecord) -> None:
        new = run.run_id not in self.runs
        super().save_run(run)
        if new:
            details = {"model_id": run.run_id, "base_model": run.base_model}
            self.audit.record(
                run.owner, "training_run", "create", {**details, "session_id": run.session_id}
            )

    def write(self, *args: Any, **kwargs: Any) -> CheckpointRecord:
        record = super().write(*args, **kwargs)
        self._checkpoint(record.owner, "create", record, {"size_bytes": record.size_bytes})
        if self._on_saved is not None:
            self._on_saved(record)
        return record

    def delete(self, owner: str, ref: CheckpointRef) -> None:
        super().delete(owner, ref)
        path = f"tinker://{ref.run_id}/{checkpoint_id(ref.kind, ref.name)}"
        details = {"model_id": ref.run_id, "tinker_path": path}
        self.audit.record(
            owner, "checkpoint", "delete", details, model_id=ref.run_id, tinker_path=path
        )

    def set_ttl(self, owner: str, ref: CheckpointRef, ttl_seconds: int | None) -> None:
        super().set_ttl(owner, ref, ttl_seconds)
        self._checkpoint(owner, "ttl_set", self.get(owner, ref), {"ttl_seconds": ttl_seconds})

    def set_public(self, owner: str, ref: CheckpointRef, public: bool) -> None:
        super().set_public(owner, ref, public)
        self._checkpoint(owner, "publish" if public else "unpublish", self.get(owner, ref))

    def delete_expired(self) -> list[CheckpointRecord]:
        expired = super().delete_expired()
        for record in expired:
            self._checkpoint(record.owner, "expire", record, actor=SERVER)
        return expired

    def _checkpoint(
        self,
        owner: str,
        action: str,
        record: CheckpointRecord,
        details: Mapping[str, object] | None = None,
        *,
        actor: str | None = None,
    ) -> None:
        self.audit.record(
            owner,
            "checkpoint",
            action,
            {"model_id": record.run_id, "tinker_path": record.tinker_path, **(details or {})},
            actor=actor,
            model_id=record.run_id,
            tinker_path=record.tinker_path,
        )


class AuditedSessions(SessionManager):
    """The sessions, their creation, end and project changes recorded in ``audit``."""

    def __init__(self, audit: AuditLog, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.audit = audit

    def create(self, owner: str, **kwargs: Any) -> Session:
        session = super().create(owner, **kwargs)
        details: dict[str, object] = {"session_id": session.id}
        if session.project_id is not None:
            details["project_id"] = session.project_id
        self.audit.record(owner, "session", "create", details)
        return session

    def set_project(self, owner: str, session_id: str, project_id: str) -> Session:
        session = super().set_project(owner, session_id, project_id)
        details = {"session_id": session_id, "project_id": project_id}
        self.audit.record(owner, "project", "session_set", details)
        return session

    def end(self, session: Session, why: str) -> None:
        ended = session.ended is None
        super().end(session, why)
        if ended:
            actions = {"finished": "finish", "expired": "expire", "stopped": "stop"}
            actor = None if why == "finished" else SERVER
            details = {"session_id": session.id}
            self.audit.record(session.owner, "session", actions.get(why, why), details, actor=actor)
