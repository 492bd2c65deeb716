"""The records databases' common SQL: where a ``--usage-db`` target leads (a SQLite file,
``:memory:``, PostgreSQL), how each speaks (:class:`Dialect`), and :class:`SqlDatabase`: one
connection behind a lock, each call one transaction, rolled back when it fails (a broken
connection replaced for the next call). The usage ledger, the rollouts and the audit trail
each keep their tables in it.

SQLite runs in WAL mode with a busy timeout, so several processes may share a file. A
transaction cut short (a crash, a full disk) leaves the tables as they were: the next start
opens them as usual.
"""

import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar
from urllib.parse import urlparse

T = TypeVar("T")


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


class SqlDatabase:
    """One connection to ``dialect``'s database, shared by threads (a lock)."""

    def __init__(self, dialect: Dialect, schema: tuple[str, ...] = ()) -> None:
        """``schema``: statements run at once (``CREATE ... IF NOT EXISTS``; ``{id_type}``
        replaced by the dialect's auto-increment key)."""
        self.dialect, self.param, self.name = dialect, dialect.param, dialect.name
        self._lock = threading.Lock()
        self._conn = dialect.connect()
        with self.transaction() as cur:
            for statement in schema:
                cur.execute(statement.format(id_type=dialect.id_type))

    @contextmanager
    def transaction(self) -> Iterator[Any]:
        """A cursor whose statements commit together when the block ends, or roll back."""
        with self._lock:
            try:
                yield self._conn.cursor()
                self._conn.commit()
            except BaseException:
                self._rollback()
                raise

    def add_column(self, table: str, column: str, kind: str) -> None:
        """``column`` added to an older ``table`` (nothing when it has it already)."""
        try:
            with self.transaction() as cur:
                cur.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
        except Exception:  # there already (a new table, or added by another server)
            pass

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
                self._conn = self.dialect.connect()


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


class TableStore(Generic[T]):
    """Items kept by name as text (``<table>``: ``name``, ``<column>``, ``updated_at``) and a
    version row (``<table>_version``) bumped in the same transaction as every change, which
    the servers sharing the database poll: the rollouts, the runtime LoRA adapters.
    ``name_of``, ``encode``, ``decode``: an item's name, its text, and back."""

    def __init__(
        self,
        dialect: Dialect,
        table: str,
        column: str,
        name_of: Callable[[T], str],
        encode: Callable[[T], str],
        decode: Callable[[str, str], T],
    ) -> None:
        self.table, self.column, self._param = table, column, dialect.param
        self._name_of, self._encode, self._decode = name_of, encode, decode
        self.db = SqlDatabase(
            dialect,
            (
                f"CREATE TABLE IF NOT EXISTS {table} (name TEXT PRIMARY KEY,"
                f" {column} TEXT NOT NULL, updated_at DOUBLE PRECISION NOT NULL)",
                f"CREATE TABLE IF NOT EXISTS {table}_version ("
                " id INTEGER PRIMARY KEY, version BIGINT NOT NULL)",
            ),
        )

    def _run(self, statements: list[tuple[str, list[Any]]], fetch: bool = False) -> list[Any]:
        """``statements`` in one transaction; the last one's rows (``fetch``)."""
        rows: list[Any] = []
        with self.db.transaction() as cur:
            for sql, args in statements:
                cur.execute(sql, args)
                if fetch:
                    rows = cur.fetchall()
        return rows

    def _bump(self) -> tuple[str, list[Any]]:
        table = f"{self.table}_version"
        return (
            f"INSERT INTO {table} (id, version) VALUES (1, 1)"
            f" ON CONFLICT (id) DO UPDATE SET version = {table}.version + {self._param}",
            [1],
        )

    def load(self) -> list[T]:
        """Every stored item, by name."""
        sql = f"SELECT name, {self.column} FROM {self.table} ORDER BY name"
        return [self._decode(name, value) for name, value in self._run([(sql, [])], True)]

    def save(self, item: T) -> None:
        """Store ``item`` (replacing the one of its name)."""
        p = self._param
        upsert = (
            f"INSERT INTO {self.table} (name, {self.column}, updated_at) VALUES ({p}, {p}, {p})"
            f" ON CONFLICT (name) DO UPDATE SET {self.column} = excluded.{self.column},"
            " updated_at = excluded.updated_at"
        )
        args = [self._name_of(item), self._encode(item), time.time()]
        self._run([(upsert, args), self._bump()])

    def delete(self, name: str) -> None:
        sql = f"DELETE FROM {self.table} WHERE name = {self._param}"
        self._run([(sql, [name]), self._bump()])

    def version(self) -> int:
        """A number that changes whenever an item is saved or deleted."""
        sql = f"SELECT version FROM {self.table}_version WHERE id = 1"
        rows = self._run([(sql, [])], True)
        return int(rows[0][0]) if rows else 0

    def close(self) -> None:
        self.db.close()
