"""SessionManager: client sessions, their heartbeats and their end.

A session is what one SDK ``ServiceClient`` opens; its training runs and samplers hang off
it. It ends when the client finishes it (``ServiceClient.close()``) or stops sending
heartbeats for ``timeout_s`` (the SDK sends one every 10 s) while none of its work is in
flight.
"""

import time
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import structlog

from domain.tinker.errors import InvalidTrainingRequest, NotFoundError, SessionClosedError

log = structlog.get_logger(__name__)


@dataclass(eq=False)
class Session:
    id: str
    owner: str
    created_at: float
    last_heartbeat: float
    tags: list[str] = field(default_factory=list)
    user_metadata: dict[str, str] = field(default_factory=dict)
    display_name: str | None = None
    sdk_version: str | None = None
    ended: str | None = None  # "finished" | "expired" | "stopped"
    ended_at: float | None = None  # monotonic
    project_id: str | None = None  # None: the default project
    finish_reason: str | None = None  # the client's, when it finished the session
    finish_detail: str | None = None


class SessionManager:
    def __init__(
        self,
        *,
        timeout_s: float = 120.0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        id_tag: str = "",
    ) -> None:
        """``id_tag``: put in every session id (a fleet's replica id: the ingress routes a
        session's calls by it)."""
        self.timeout_s = timeout_s
        self._prefix = f"session-{id_tag}-" if id_tag else "session-"
        self._clock = clock
        self._wall_clock = wall_clock
        self._sessions: dict[str, Session] = {}

    def create(
        self,
        owner: str,
        *,
        tags: list[str] | None = None,
        user_metadata: dict[str, str] | None = None,
        display_name: str | None = None,
        sdk_version: str | None = None,
        project_id: str | None = None,
    ) -> Session:
        if project_id is not None:
            check_project_id(project_id)
        now = self._clock()
        session = Session(
            id=f"{self._prefix}{uuid.uuid4().hex[:12]}",
            owner=owner,
            created_at=self._wall_clock(),
            last_heartbeat=now,
            tags=list(tags or []),
            user_metadata=dict(user_metadata or {}),
            display_name=display_name,
            sdk_version=sdk_version,
            project_id=project_id,
        )
        self._sessions[session.id] = session
        log.info("tinker_session_created", session_id=session.id, sdk_version=sdk_version)
        return session

    def get(self, owner: str, session_id: str) -> Session:
        """The caller's session, ended or not (``NotFoundError`` for another key's)."""
        session = self._sessions.get(session_id)
        if session is None or session.owner != owner:
            raise NotFoundError(f"no session {session_id!r}")
        return session

    def live(self, owner: str, session_id: str) -> Session:
        """The caller's session, which must not have ended."""
        session = self.get(owner, session_id)
        if session.ended is not None:
            raise SessionClosedError(f"session {session_id!r} has {session.ended}")
        return session

    def heartbeat(self, owner: str, session_id: str) -> Session:
        session = self.live(owner, session_id)
        session.last_heartbeat = self._clock()
        return session

    def finish(
        self,
        owner: str,
        session_id: str,
        *,
        reason: str | None = None,
        detail: str | None = None,
    ) -> Session:
        """End the session as its client asked (``reason``: success, errored, interrupted);
        the first finish wins."""
        session = self.get(owner, session_id)
        if session.ended is None:
            session.finish_reason, session.finish_detail = reason, detail
            self.end(session, "finished")
            log.info("tinker_session_finished", session_id=session_id)
        return session

    def set_project(self, owner: str, session_id: str, project_id: str) -> Session:
        """Move the caller's session (ended or not) into ``project_id``."""
        check_project_id(project_id)
        session = self.get(owner, session_id)
        session.project_id = project_id
        return session

    def end(self, session: Session, why: str) -> None:
        if session.ended is None:
            session.ended, session.ended_at = why, self._clock()

    def forget_ended(self, older_than_s: float) -> int:
        """Drop sessions that ended more than ``older_than_s`` ago (ids only remain in
        memory until then, for listings); returns how many."""
        cutoff = self._clock() - older_than_s
        old = [
            s.id for s in self._sessions.values() if s.ended_at is not None and s.ended_at < cutoff
        ]
        for session_id in old:
            del self._sessions[session_id]
        return len(old)

    def expire_stale(self, busy: Collection[str] = ()) -> list[Session]:
        """End sessions whose last heartbeat is older than ``timeout_s``; return them.
        ``busy``: sessions with work in flight, alive whatever their heartbeats (a server
        loaded enough to delay heartbeats must not end the sessions loading it); their
        silence counts from now."""
        now = self._clock()
        for session_id in busy:
            session = self._sessions.get(session_id)
            if session is not None and session.ended is None:
                session.last_heartbeat = max(session.last_heartbeat, now)
        cutoff = now - self.timeout_s
        stale = [
            s for s in self._sessions.values() if s.ended is None and s.last_heartbeat < cutoff
        ]
        for session in stale:
            self.end(session, "expired")
            log.warning(
                "tinker_session_expired",
                session_id=session.id,
                silent_s=round(self._clock() - session.last_heartbeat, 1),
            )
        return stale

    def known(self, session_id: str) -> bool:
        """Whether ``session_id`` is still kept (live, or ended and not yet forgotten)."""
        return session_id in self._sessions

    def all(self) -> list[Session]:
        return list(self._sessions.values())

    def owned_by(self, owner: str) -> list[Session]:
        return [s for s in self._sessions.values() if s.owner == owner]


MAX_PROJECT_ID = 128


def check_project_id(project_id: str) -> None:
    """A project id: 1 to ``MAX_PROJECT_ID`` printable characters, no surrounding space."""
    if not project_id or len(project_id) > MAX_PROJECT_ID:
        raise InvalidTrainingRequest(f"project_id must be 1 to {MAX_PROJECT_ID} characters")
    if not project_id.isprintable() or project_id.strip() != project_id:
        raise InvalidTrainingRequest(
            "project_id must be printable, without leading or trailing spaces"
        )
