"""The audit trail port held against memory, SQLite and a real PostgreSQL: events read
back whole (details as JSON), newest first, within [since, until), at most ``limit``."""

from pathlib import Path

import pytest

from adapters.storage.audit_sql import open_audit_trail
from application.access.audit import Audit, MemoryAuditTrail
from domain.audit import AuditEvent, AuditTrail


@pytest.fixture(params=["memory", "sqlite-file", "postgres"])
def trail(request: pytest.FixtureRequest, tmp_path: Path) -> AuditTrail:
    if request.param == "memory":
        return MemoryAuditTrail()
    if request.param == "postgres":
        import psycopg

        url: str = request.getfixturevalue("postgres_url")
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("DROP TABLE IF EXISTS infer_audit")
        return open_audit_trail(url)
    return open_audit_trail(str(tmp_path / "usage.sqlite3"))


def test_events_read_back_newest_first_within_the_range(trail: AuditTrail) -> None:
    for i in range(5):
        details = {"n": i, "names": ["a", "b"], "nested": {"x": None}}
        trail.append(AuditEvent(100.0 + i, f"event {i}", "ops" if i else None, "tenant:t", details))
    events = trail.read()
    assert [e.event for e in events] == [f"event {i}" for i in (4, 3, 2, 1, 0)]
    assert events[0].details == {"n": 4, "names": ["a", "b"], "nested": {"x": None}}
    assert (events[0].actor, events[-1].actor, events[0].subject) == ("ops", None, "tenant:t")
    assert [e.at for e in trail.read(since=101, until=103)] == [102.0, 101.0]
    assert [e.at for e in trail.read(limit=2)] == [104.0, 103.0]


def test_a_trail_that_fails_does_not_fail_the_change() -> None:
    class Broken(MemoryAuditTrail):
        def append(self, event: AuditEvent) -> None:
            raise OSError("disk full")

    audit = Audit(Broken())
    audit.record("tenant created", actor="ops", subject="tenant:t")  # logged, not raised
    assert audit.read() == []
