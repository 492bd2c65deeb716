"""The :class:`~domain.usage.UsageLedger` port in SQL: SQLite (a file, one machine; the
default) or PostgreSQL (``postgresql://...``: every process of a fleet writes to one
database). One table, ``infer_usage``, a row per request, indexed by the time it ended.

Both adapters keep one connection behind a lock (the ledger's writer thread appends, the
usage API's worker threads read); SQLite runs in WAL mode with a busy timeout, so several
processes may share a file. A transaction cut short (a crash, a full disk) leaves the table
as it was: the next start opens it as usual.
"""

import os
import sqlite3
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

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


@dataclass(frozen=True)
class Dialect:
    """How to reach one database and speak its SQL: ``connect()`` a DB-API connection,
    ``param`` its placeholder, ``floor`` SQL rounding down to an integer, ``id_type`` an
    auto-increment key, ``name`` the database for logs (no password)."""

    connect: Callable[[], Any]
    param: str
    floor: str
    id_type: str
    name: str


class SqlUsageLedger:
    def __init__(self, dialect: Dialect) -> None:
        self._connect, self._param, self._floor = dialect.connect, dialect.param, dialect.floor
        self.name = dialect.name
        self._lock = threading.Lock()
        self._conn = dialect.connect()
        with self._lock:
            cur = self._conn.cursor()
            cur.execute(_SCHEMA.format(id_type=dialect.id_type))
            cur.execute(_INDEX)
            self._conn.commit()
            for column, kind in _ADDED:
                try:
                    cur.execute(f"ALTER TABLE infer_usage ADD COLUMN {column} {kind}")
                    self._conn.commit()
                except Exception:  # there already (a new table, or added by another server)
                    self._conn.rollback()
                    cur = self._conn.cursor()

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
        with self._lock:
            try:
                self._conn.cursor().executemany(sql, rows)
                self._conn.commit()
            except BaseException:
                self._rollback()
                raise

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
        with self._lock:
            try:
                cur = self._conn.cursor()
                cur.execute(sql, [query.start_s, query.bucket_s, *args])
                rows = cur.fetchall()
                self._conn.commit()  # ends the read transaction (PostgreSQL)
            except BaseException:
                self._rollback()
                raise
        n = len(groups)
        return [
            UsageTotals(
                int(row[0]), tuple(row[1 : 1 + n]), *(int(v or 0) for v in row[1 + n : 8 + n])
            )
            for row in rows
        ]

    def prune(self, before_s: float) -> int:
        with self._lock:
            try:
                cur = self._conn.cursor()
                cur.execute(f"DELETE FROM infer_usage WHERE ended_at < {self._param}", [before_s])
                self._conn.commit()
                return int(cur.rowcount or 0)
            except BaseException:
                self._rollback()
                raise

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def _rollback(self) -> None:
        try:
            self._conn.rollback()
        except Exception:  # a broken connection: open a new one for the next call
            try:
                self._conn.close()
            finally:
                self._conn = self._connect()


def sqlite_dialect(path: str | Path) -> Dialect:
    """The SQLite file ``path`` (its folder made if missing; ``:memory:``: in memory, one
    database per connection)."""
    if str(path) == MEMORY:
        return Dialect(
            lambda: sqlite3.connect(MEMORY, check_same_thread=False),
            "?",
            "CAST({} AS INTEGER)",
            "INTEGER",
            MEMORY,
        )
    file = Path(path).expanduser()
    file.parent.mkdir(parents=True, exist_ok=True)

    def connect() -> sqlite3.Connection:
        conn = sqlite3.connect(file, timeout=30.0, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        return conn

    # Non-negative arguments only (records from the query's start on): CAST truncates.
    return Dialect(connect, "?", "CAST({} AS INTEGER)", "INTEGER", str(file))


def postgres_dialect(url: str) -> Dialect:
    """The PostgreSQL database at ``url`` (``postgresql://user@host/db``)."""
    import psycopg  # imported only when PostgreSQL is asked for

    def connect() -> Any:
        return psycopg.connect(url, connect_timeout=10)

    return Dialect(connect, "%s", "CAST(FLOOR({}) AS BIGINT)", "BIGSERIAL", _redacted(url))


def sqlite_ledger(path: str | Path) -> UsageLedger:
    """A ledger in the SQLite file ``path`` (its folder made if missing)."""
    return SqlUsageLedger(sqlite_dialect(path))


def postgres_ledger(url: str) -> UsageLedger:
    """A ledger in the PostgreSQL database at ``url``."""
    return SqlUsageLedger(postgres_dialect(url))


def _redacted(url: str) -> str:
    """``url`` without its password (for logs)."""
    parsed = urlparse(url)
    if parsed.password is None:
        return url
    return url.replace(f":{parsed.password}@", ":***@", 1)


# In the cache folder the weights and kernels use (``$INFER_CACHE_DIR``, else ~/.cache/infer).
DEFAULT_USAGE_DB = str(
    Path(os.environ.get("INFER_CACHE_DIR") or "~/.cache/infer") / "usage.sqlite3"
)
MEMORY = ":memory:"
POSTGRES = ("postgresql://", "postgres://")


def check_usage_target(target: str) -> None:
    """Raise ``ValueError`` unless ``target`` names a ledger :func:`open_ledger` opens."""
    if not target or ("://" in target and not target.startswith((*POSTGRES, "sqlite:///"))):
        raise ValueError(
            f"{target!r} is neither a file path, :memory:, sqlite:///PATH nor postgresql://..."
        )


def dialect_for(target: str) -> Dialect:
    """The database ``target`` names: ``postgresql://`` / ``postgres://`` URLs are
    PostgreSQL, ``:memory:`` a SQLite database in memory, ``sqlite:///path`` or a plain
    path a SQLite file."""
    check_usage_target(target)
    if target.startswith(POSTGRES):
        return postgres_dialect(target)
    return sqlite_dialect(target.removeprefix("sqlite:///"))


def open_ledger(target: str) -> UsageLedger:
    """The usage ledger in the database ``target`` names (:func:`dialect_for`)."""
    return SqlUsageLedger(dialect_for(target))
