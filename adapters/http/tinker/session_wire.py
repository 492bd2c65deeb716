"""The wire forms of the session routes beyond create/list/get: a session's project, its
finish reason, the search request and its page of summaries."""

from datetime import UTC, datetime, timedelta

import msgspec

from adapters.http.tinker.codec import json as json_codec
from adapters.http.tinker.replies import iso
from application.tinker.admin import SessionPage, SessionQuery, SessionSummary, StatusQuery, micros
from domain.tinker.errors import InvalidTrainingRequest

OWNER_TYPES = frozenset({"own", "accessible", "user"})


class _Body(msgspec.Struct, kw_only=True):
    """Unknown fields are accepted and ignored (newer SDKs add fields)."""


class CreateSessionIn(json_codec.CreateSessionIn, kw_only=True):
    project_id: str | None = None


class ProjectIn(_Body):
    project_id: str


class FinishReasonIn(_Body):
    type: str


class FinishIn(_Body):
    reason: FinishReasonIn | None = None
    detail: str | None = None


class SearchOwnerIn(_Body):
    type: str = "own"
    owner_urns: list[str] | None = None


class StatusQueryIn(_Body):
    type: str
    reasons: list[str] | None = None


class CursorIn(_Body):
    last_created_at: datetime
    last_session_id: str


class SessionSearchIn(_Body):
    session_id: str | None = None
    project_ids: list[str] | None = None
    user_metadata: dict[str, str] = {}
    display_name: str | None = None
    owner: SearchOwnerIn = msgspec.field(default_factory=SearchOwnerIn)
    statuses: list[StatusQueryIn] | None = None
    limit: int = 50
    cursor: CursorIn | None = None


def search_query(body: SessionSearchIn) -> SessionQuery:
    owner = body.owner
    if owner.type not in OWNER_TYPES:
        raise InvalidTrainingRequest(f"owner.type must be own, accessible or user: {owner.type!r}")
    urns: tuple[str, ...] | None = None
    if owner.type == "user":
        if not owner.owner_urns:
            raise InvalidTrainingRequest("owner.type 'user' needs owner_urns")
        urns = tuple(owner.owner_urns)
    after: tuple[int, str] | None = None
    if body.cursor is not None:
        when = body.cursor.last_created_at
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        after = (micros(when.timestamp()), body.cursor.last_session_id)
    return SessionQuery(
        session_id=body.session_id,
        display_name=body.display_name,
        project_ids=tuple(body.project_ids) if body.project_ids is not None else None,
        user_metadata=body.user_metadata,
        owner_urns=urns,
        statuses=(
            tuple(StatusQuery(s.type, _tuple(s.reasons)) for s in body.statuses)
            if body.statuses is not None
            else None
        ),
        limit=body.limit,
        after=after,
    )


def _tuple(values: list[str] | None) -> tuple[str, ...] | None:
    return tuple(values) if values is not None else None


def summary_json(summary: SessionSummary) -> dict[str, object]:
    session, status = summary.session, summary.status
    status_json: dict[str, object] | None = None
    if status is not None:
        status_json = {"type": status.type}
        if status.type == "client_finished":
            status_json["reason"] = {"type": status.reason}
        if status.type in ("client_finished", "cancelled"):
            status_json["detail"] = status.detail
    return {
        "session_id": session.id,
        "created_at": iso(session.created_at),
        "owner": summary.owner,
        "project_id": summary.project_id,
        "status": status_json,
        "checkpoints_count": summary.checkpoints,
        "display_name": session.display_name,
        "user_metadata": dict(session.user_metadata) or None,
        "checkpoint_storage_bytes": summary.checkpoint_bytes,
    }


def page_json(page: SessionPage) -> dict[str, object]:
    cursor = None
    if page.next_after is not None:
        at, session_id = page.next_after
        when = datetime.fromtimestamp(0, UTC) + timedelta(microseconds=at)
        cursor = {"last_created_at": when.isoformat(), "last_session_id": session_id}
    return {"sessions": [summary_json(s) for s in page.sessions], "next_cursor": cursor}
