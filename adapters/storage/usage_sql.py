"""The :class:`~domain.usage.UsageLedger` port in SQL: SQLite (a file, one machine; the
default) or PostgreSQL (``postgresql://...``: every process of a fleet writes to one
database). One table, ``infer_usage``, a row per request, indexed by the time it ended.

One connection behind a lock (:class:`~adapters.storage.sql.SqlDatabase`: the ledger's
writer thread appends, the usage API's worker threads read).
"""

from collections.abc import Sequence
from pathlib import Path

from adapters.storage.sql import (
    DEFAULT_USAGE_DB,
    Dialect,
    SqlDatabase,
    check_usage_target,
    dialect_for,
    postgres_dialect,
    sqlite_dialect,
)
from domain.usage import GROUP_COLUMNS, UsageLedger, UsageQuery, UsageRecord, UsageTotals

_COLUMNS = (
    "ended_at",
    "request_id",
    "tenant_id",
    "model",
    "route",
    "kind",
    "status",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "latency_ms",
    "key_id",
)
_SCHEMA = """
CREATE TABLE IF NOT EXISTS infer_usage (
    id {id_type} PRIMARY KEY,
    ended_at DOUBLE PRECISION NOT NULL,
    request_id TEXT NOT NULL,
    tenant_id TEXT,
    model TEXT,
    route TEXT NOT NULL,
    kind TEXT NOT NULL,
    status INTEGER NOT NULL,
    prompt_tokens BIGINT NOT NULL,
    cached_tokens BIGINT NOT NULL,
    completion_tokens BIGINT NOT NULL,
    latency_ms DOUBLE PRECISION NOT NULL,
    key_id TEXT
)"""
# Columns added since the table's first version: added to an older table at open.
_ADDED = (("key_id", "TEXT"),)
_INDEX = "CREATE INDEX IF NOT EXISTS infer_usage_ended_at ON infer_usage (ended_at)"


class SqlUsageLedger:
    def __init__(self, dialect: Dialect) -> None:
        self.db = SqlDatabase(dialect, (_SCHEMA, _INDEX))
        self._param, self._floor, self.name = dialect.param, dialect.floor, dialect.name
        for column, kind in _ADDED:
            self.db.add_column("infer_usage", column, kind)

    def append(self, records: Sequence[UsageRecord]) -> None:
        if not records:
            return
        marks = ", ".join([self._param] * len(_COLUMNS))
        sql = f"INSERT INTO infer_usage ({', '.join(_COLUMNS)}) VALUES ({marks})"
        rows = [
            (
                r.ended_s,
                r.request_id,
                r.tenant_id,
                r.model,
                r.route,
                r.kind,
                r.status,
                r.prompt_tokens,
                r.cached_tokens,
                r.completion_tokens,
                r.latency_ms,
                r.key_id,
            )
            for r in records
        ]
        with self.db.transaction() as cur:
            cur.executemany(sql, rows)

    def totals(self, query: UsageQuery) -> list[UsageTotals]:
        p = self._param
        groups = [c for c in query.group_by if c in GROUP_COLUMNS]  # a fixed set of names
        bucket = self._floor.format(f"(ended_at - {p}) / {p}")
        where = [f"ended_at >= {p}", f"ended_at < {p}"]
        args: list[object] = [query.start_s, query.end_s]
        for column, values in (("tenant_id", query.tenants), ("model", query.models)):
            if values is not None:
                if not values:
                    return []
                where.append(f"{column} IN ({', '.join([p] * len(values))})")
                args += sorted(values)
        if query.kind is not None:
            where.append(f"kind = {p}")
            args.append(query.kind)
        selected = ", ".join(["b", *groups])
        sql = (
            f"SELECT {selected}, COUNT(*),"
            " SUM(CASE WHEN status >= 200 AND status < 300 THEN 1 ELSE 0 END),"
            " SUM(CASE WHEN status = 429 THEN 1 ELSE 0 END),"
            " SUM(CASE WHEN status >= 400 AND status <> 429 THEN 1 ELSE 0 END),"
            " SUM(prompt_tokens), SUM(cached_tokens), SUM(completion_tokens)"
            f" FROM (SELECT {bucket} AS b, * FROM infer_usage WHERE {' AND '.join(where)}) AS u"
            f" GROUP BY {selected} ORDER BY {selected}"
        )
        with self.db.transaction() as cur:  # its commit ends PostgreSQL's read transaction
            cur.execute(sql, [query.start_s, query.bucket_s, *args])
            rows = cur.fetchall()
        n = len(groups)
        return [
            UsageTotals(
                int(row[0]), tuple(row[1 : 1 + n]), *(int(v or 0) for v in row[1 + n : 8 + n])
            )
            for row in rows
        ]

    def prune(self, before_s: float) -> int:
        with self.db.transaction() as cur:
            cur.execute(f"DELETE FROM infer_usage WHERE ended_at < {self._param}", [before_s])
            return int(cur.rowcount or 0)

    def close(self) -> None:
        self.db.close()


def sqlite_ledger(path: str | Path) -> UsageLedger:
    """A ledger in the SQLite file ``path`` (its folder made if missing)."""
    return SqlUsageLedger(sqlite_dialect(path))


def postgres_ledger(url: str) -> UsageLedger:
    """A ledger in the PostgreSQL database at ``url``."""
    return SqlUsageLedger(postgres_dialect(url))


def open_ledger(target: str) -> UsageLedger:
    """The usage ledger in the database ``target`` names (:func:`dialect_for`)."""
    return SqlUsageLedger(dialect_for(target))


__all__ = ["DEFAULT_USAGE_DB", "check_usage_target", "open_ledger"]
