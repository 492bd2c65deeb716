"""The :class:`~domain.audit.AuditTrail` port in SQL, in the usage ledger's database
(``--usage-db``): table ``infer_audit``, a row per event, its details as JSON."""

import json
from typing import Any

from adapters.storage.sql import Dialect, SqlDatabase, dialect_for
from domain.audit import AuditEvent

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS infer_audit ("
    " id {id_type} PRIMARY KEY, at DOUBLE PRECISION NOT NULL, event TEXT NOT NULL,"
    " actor TEXT, subject TEXT NOT NULL, details TEXT NOT NULL)"
)
_INDEX = "CREATE INDEX IF NOT EXISTS infer_audit_at ON infer_audit (at)"


class SqlAuditTrail:
    def __init__(self, dialect: Dialect) -> None:
        self.db = SqlDatabase(dialect, (_SCHEMA, _INDEX))
        self._param = dialect.param

    def _run(self, sql: str, args: list[Any], fetch: bool = False) -> list[Any]:
        with self.db.transaction() as cur:
            cur.execute(sql, args)
            return cur.fetchall() if fetch else []

    def append(self, event: AuditEvent) -> None:
        p = self._param
        self._run(
            "INSERT INTO infer_audit (at, event, actor, subject, details)"
            f" VALUES ({p}, {p}, {p}, {p}, {p})",
            [event.at, event.event, event.actor, event.subject, json.dumps(dict(event.details))],
        )

    def read(
        self, *, since: float | None = None, until: float | None = None, limit: int = 100
    ) -> list[AuditEvent]:
        p, where, args = self._param, [], []
        if since is not None:
            where.append(f"at >= {p}")
            args.append(since)
        if until is not None:
            where.append(f"at < {p}")
            args.append(until)
        clause = f" WHERE {' AND '.join(where)}" if where else ""
        rows = self._run(
            f"SELECT at, event, actor, subject, details FROM infer_audit{clause}"
            f" ORDER BY at DESC, id DESC LIMIT {p}",
            [*args, limit],
            fetch=True,
        )
        return [
            AuditEvent(at, event, actor, subject, json.loads(d))
            for at, event, actor, subject, d in rows
        ]

    def close(self) -> None:
        self.db.close()


def open_audit_trail(target: str) -> SqlAuditTrail:
    """The audit trail in the database ``target`` names (``--usage-db``'s)."""
    return SqlAuditTrail(dialect_for(target))
