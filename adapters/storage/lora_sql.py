"""The :class:`~domain.lora_adapters.AdapterStore` port in SQL, in the usage ledger's
database (``--usage-db``: SQLite or PostgreSQL): table ``infer_lora_adapters`` (a row per
adapter loaded at run time) and ``infer_lora_adapters_version`` (one row, bumped in the same
transaction as every change, which the servers poll)."""

import time
from typing import Any

from adapters.storage.sql import Dialect, SqlDatabase, dialect_for
from domain.lora_adapters import RuntimeAdapter

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS infer_lora_adapters ("
    " name TEXT PRIMARY KEY, path TEXT NOT NULL, updated_at DOUBLE PRECISION NOT NULL)",
    "CREATE TABLE IF NOT EXISTS infer_lora_adapters_version ("
    " id INTEGER PRIMARY KEY, version BIGINT NOT NULL)",
)


class SqlAdapterStore:
    def __init__(self, dialect: Dialect) -> None:
        self.db = SqlDatabase(dialect, _SCHEMA)
        self._param = dialect.param

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
        return (
            "INSERT INTO infer_lora_adapters_version (id, version) VALUES (1, 1)"
            " ON CONFLICT (id) DO UPDATE SET"
            f" version = infer_lora_adapters_version.version + {self._param}",
            [1],
        )

    def load(self) -> list[RuntimeAdapter]:
        sql = "SELECT name, path FROM infer_lora_adapters ORDER BY name"
        return [RuntimeAdapter(name, path) for name, path in self._run([(sql, [])], True)]

    def save(self, adapter: RuntimeAdapter) -> None:
        p = self._param
        upsert = (
            f"INSERT INTO infer_lora_adapters (name, path, updated_at) VALUES ({p}, {p}, {p})"
            " ON CONFLICT (name) DO UPDATE SET path = excluded.path,"
            " updated_at = excluded.updated_at"
        )
        self._run([(upsert, [adapter.name, adapter.path, time.time()]), self._bump()])

    def delete(self, name: str) -> None:
        sql = f"DELETE FROM infer_lora_adapters WHERE name = {self._param}"
        self._run([(sql, [name]), self._bump()])

    def version(self) -> int:
        sql = "SELECT version FROM infer_lora_adapters_version WHERE id = 1"
        rows = self._run([(sql, [])], True)
        return int(rows[0][0]) if rows else 0

    def close(self) -> None:
        self.db.close()


def open_adapter_store(target: str) -> SqlAdapterStore:
    """The runtime adapters kept in the database ``target`` names (``--usage-db``'s)."""
    return SqlAdapterStore(dialect_for(target))
