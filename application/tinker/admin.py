"""What a tenant may ask about its own sessions and usage: session search, usage by hour,
checkpoint storage now. Every answer covers the caller's own sessions and checkpoints
only (another tenant's are never matched, named or not).

A session's status as Tinker reports it: ``active`` while it runs, ``client_finished``
(with the client's reason) once its client finished it, ``cancelled`` when the server
stopped, and none when its heartbeats stopped (neither finished nor known to run).
Sessions not moved into a project are in :data:`DEFAULT_PROJECT`.
"""

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Literal

from application.tinker.activity_log import user_urn
from application.tinker.billing import UsageEvent, UsageMeter
from application.tinker.checkpoints import CheckpointStore
from application.tinker.sessions import Session, SessionManager
from domain.tinker.errors import InvalidTrainingRequest, NotFoundError

DEFAULT_PROJECT = "default"
MAX_LIMIT = 200
MAX_OWNER_URNS = 10
FINISH_REASONS = frozenset({"success", "errored", "interrupted"})
StatusType = Literal["active", "cancelled", "failed", "client_finished"]
STATUS_TYPES: frozenset[str] = frozenset({"active", "cancelled", "failed", "client_finished"})
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def micros(ts: float) -> int:
    """Unix seconds as the whole microseconds a timestamp on the wire carries."""
    return (datetime.fromtimestamp(ts, UTC) - _EPOCH) // timedelta(microseconds=1)


@dataclass(frozen=True, slots=True)
class StatusQuery:
    type: str
    reasons: tuple[str, ...] | None = None  # client_finished's reasons (None: any)


@dataclass(frozen=True, slots=True)
class SessionQuery:
    session_id: str | None = None
    display_name: str | None = None
    project_ids: tuple[str, ...] | None = None
    user_metadata: Mapping[str, str] = field(default_factory=dict)
    owner_urns: tuple[str, ...] | None = None  # None: the caller's own
    statuses: tuple[StatusQuery, ...] | None = None
    limit: int = 50
    after: tuple[int, str] | None = None  # the last page's last (created_at µs, id)


@dataclass(frozen=True, slots=True)
class SessionStatus:
    type: StatusType
    reason: str | None = None  # client_finished: success, errored, interrupted
    detail: str | None = None


@dataclass(frozen=True, slots=True)
class SessionSummary:
    session: Session
    owner: str  # the owner's URN
    project_id: str
    status: SessionStatus | None
    checkpoints: int
    checkpoint_bytes: int


@dataclass(frozen=True, slots=True)
class SessionPage:
    sessions: list[SessionSummary]
    next_after: tuple[int, str] | None  # None: no more


@dataclass(frozen=True, slots=True)
class UsageReport:
    events: list[UsageEvent]
    owner: str  # the owner's URN
    projects: dict[str, str]  # session id -> its project (sessions still known)
    metadata: dict[str, dict[str, str] | None]  # session id -> its user_metadata


@dataclass(frozen=True, slots=True)
class StorageRow:
    project_id: str | None  # None: the session is no longer known
    owner: str
    checkpoints: int
    size_bytes: int


def session_status(session: Session) -> SessionStatus | None:
    if session.ended is None:
        return SessionStatus("active")
    if session.ended == "finished":
        reason = session.finish_reason or "success"
        return SessionStatus("client_finished", reason, session.finish_detail)
    if session.ended == "stopped":
        return SessionStatus("cancelled", detail="the server stopped")
    return None  # expired: its client went silent


def check_query(query: SessionQuery) -> None:
    if not 1 <= query.limit <= MAX_LIMIT:
        raise InvalidTrainingRequest(f"limit must be in 1..{MAX_LIMIT}")
    if query.display_name is not None and not query.display_name.strip():
        raise InvalidTrainingRequest("display_name must not be empty")
    if query.owner_urns is not None and not 1 <= len(query.owner_urns) <= MAX_OWNER_URNS:
        raise InvalidTrainingRequest(f"owner_urns must hold 1 to {MAX_OWNER_URNS} URNs")
    if query.statuses is not None:
        if not query.statuses:
            raise InvalidTrainingRequest("statuses must not be empty (leave it out: any)")
        for status in query.statuses:
            if status.type not in STATUS_TYPES:
                raise InvalidTrainingRequest(f"unknown session status {status.type!r}")
            if status.reasons is not None:
                if status.type != "client_finished" or not status.reasons:
                    raise InvalidTrainingRequest("reasons: client_finished only, not empty")
                for reason in status.reasons:
                    if reason not in FINISH_REASONS:
                        raise InvalidTrainingRequest(f"unknown finish reason {reason!r}")


class TinkerAdmin:
    def __init__(
        self, sessions: SessionManager, checkpoints: CheckpointStore, usage: UsageMeter
    ) -> None:
        self._sessions = sessions
        self._checkpoints = checkpoints
        self.usage = usage

    def _checkpoint_totals(self, owner: str) -> dict[str | None, tuple[int, int]]:
        """session id (None: unknown) -> (checkpoints, bytes) of ``owner``'s checkpoints."""
        totals: dict[str | None, tuple[int, int]] = {}
        for record in self._checkpoints.find(owner):
            run = self._checkpoints.runs.get(record.run_id)
            session_id = run.session_id if run is not None else None
            count, size = totals.get(session_id, (0, 0))
            totals[session_id] = (count + 1, size + record.size_bytes)
        return totals

    def search(self, owner: str, query: SessionQuery) -> SessionPage:
        """``owner``'s sessions matching ``query``, newest first, one page."""
        check_query(query)
        if query.owner_urns is not None and user_urn(owner) not in query.owner_urns:
            return SessionPage([], None)
        totals = self._checkpoint_totals(owner)
        found: list[tuple[tuple[int, str], SessionSummary]] = []
        for session in self._sessions.owned_by(owner):
            key = (micros(session.created_at), session.id)
            if query.after is not None and key >= query.after:
                continue
            summary = SessionSummary(
                session,
                user_urn(owner),
                session.project_id or DEFAULT_PROJECT,
                session_status(session),
                *totals.get(session.id, (0, 0)),
            )
            if _matches(summary, query):
                found.append((key, summary))
        found.sort(key=lambda item: item[0], reverse=True)
        page = found[: query.limit]
        more = len(found) > query.limit
        return SessionPage([s for _, s in page], page[-1][0] if more else None)

    def usage_report(self, owner: str, start: float, end: float) -> UsageReport:
        events = self.usage.events(owner, start, end)
        projects: dict[str, str] = {}
        metadata: dict[str, dict[str, str] | None] = {}
        for session_id in {e.key.session_id for e in events if e.key.session_id is not None}:
            try:
                session = self._sessions.get(owner, session_id)
            except NotFoundError:
                continue
            projects[session_id] = session.project_id or DEFAULT_PROJECT
            metadata[session_id] = dict(session.user_metadata) or None
        return UsageReport(events, user_urn(owner), projects, metadata)

    def storage(self, owner: str, project_id: str | None) -> list[StorageRow]:
        """``owner``'s checkpoints stored now, by project (of each one's session)."""
        rows: dict[str | None, tuple[int, int]] = {}
        for session_id, (count, size) in self._checkpoint_totals(owner).items():
            project = self._project_of(owner, session_id)
            old_count, old_size = rows.get(project, (0, 0))
            rows[project] = (old_count + count, old_size + size)
        return [
            StorageRow(project, user_urn(owner), count, size)
            for project, (count, size) in sorted(rows.items(), key=lambda r: r[0] or "")
            if project_id is None or project == project_id
        ]

    def _project_of(self, owner: str, session_id: str | None) -> str | None:
        if session_id is None:
            return None
        try:
            session = self._sessions.get(owner, session_id)
        except NotFoundError:
            return None
        return session.project_id or DEFAULT_PROJECT


def _matches(summary: SessionSummary, query: SessionQuery) -> bool:
    session = summary.session
    if query.session_id is not None or query.display_name is not None:
        by_id = query.session_id is not None and session.id == query.session_id
        by_name = query.display_name is not None and _name_matches(
            session.display_name, query.display_name
        )
        if not (by_id or by_name):
            return False
    if query.project_ids is not None and summary.project_id not in query.project_ids:
        return False
    for key, value in query.user_metadata.items():
        if session.user_metadata.get(key) != value:
            return False
    if query.statuses is not None:
        status = summary.status
        if status is None:
            return False
        return any(
            q.type == status.type and (q.reasons is None or status.reason in q.reasons)
            for q in query.statuses
        )
    return True


def _name_matches(name: str | None, wanted: str) -> bool:
    """Each word of ``wanted`` appears in ``name``, case-insensitively."""
    if name is None:
        return False
    name = name.casefold()
    return all(word in name for word in wanted.casefold().split())
