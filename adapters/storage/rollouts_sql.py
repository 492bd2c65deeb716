"""The :class:`~domain.rollout.RolloutStore` port in SQL, in the usage ledger's database
(``--usage-db``: SQLite or PostgreSQL): table ``infer_rollouts`` (a row per rollout, its
targets and rollback policy as JSON) and ``infer_rollouts_version`` (one row, bumped in the
same transaction as every change, which the servers poll)."""

import json
import time
from typing import Any

from adapters.storage.sql import Dialect, SqlDatabase, dialect_for
from domain.rollout import RollbackPolicy, Rollout, RolloutTarget

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS infer_rollouts ("
    " name TEXT PRIMARY KEY, spec TEXT NOT NULL, updated_at DOUBLE PRECISION NOT NULL)",
    "CREATE TABLE IF NOT EXISTS infer_rollouts_version ("
    " id INTEGER PRIMARY KEY, version BIGINT NOT NULL)",
)


def rollout_spec(rollout: Rollout) -> str:
    policy = rollout.rollback
    return json.dumps(
        {
            "targets": [
                {"model": t.model, "weight": t.weight, "tenants": sorted(t.tenants)}
                for t in rollout.targets
            ],
            "rollback": None
            if policy is None
            else {
                "max_error_rate": policy.max_error_rate,
                "min_requests": policy.min_requests,
                "window": policy.window,
            },
        }
    )


def rollout_of(name: str, spec: str) -> Rollout:
    data = json.loads(spec)
    targets = tuple(
        RolloutTarget(t["model"], float(t["weight"]), frozenset(t["tenants"]))
        for t in data["targets"]
    )
    policy = data["rollback"]
    return Rollout(name, targets, None if policy is None else RollbackPolicy(**policy))


class SqlRolloutStore:
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

    def _bump(self) -> list[tuple[str, list[Any]]]:
        p = self._param
        return [
            (
                f"INSERT INTO infer_rollouts_version (id, version) VALUES (1, 1)"
                f" ON CONFLICT (id) DO UPDATE SET version = infer_rollouts_version.version + {p}",
                [1],
            )
        ]

    def load(self) -> list[Rollout]:
        rows = self._run([("SELECT name, spec FROM infer_rollouts ORDER BY name", [])], True)
        return [rollout_of(name, spec) for name, spec in rows]

    def save(self, rollout: Rollout) -> None:
        p = self._param
        upsert = (
            f"INSERT INTO infer_rollouts (name, spec, updated_at) VALUES ({p}, {p}, {p})"
            " ON CONFLICT (name) DO UPDATE SET spec = excluded.spec,"
            " updated_at = excluded.updated_at"
        )
        self._run([(upsert, [rollout.name, rollout_spec(rollout), time.time()]), *self._bump()])

    def delete(self, name: str) -> None:
        sql = f"DELETE FROM infer_rollouts WHERE name = {self._param}"
        self._run([(sql, [name]), *self._bump()])

    def version(self) -> int:
        rows = self._run([("SELECT version FROM infer_rollouts_version WHERE id = 1", [])], True)
        return int(rows[0][0]) if rows else 0

    def close(self) -> None:
        self.db.close()


def open_rollout_store(target: str) -> SqlRolloutStore:
    """The rollouts kept in the database ``target`` names (``--usage-db``'s)."""
    return SqlRolloutStore(dialect_for(target))
