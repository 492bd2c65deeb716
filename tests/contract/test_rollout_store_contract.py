"""The rollout store port held against SQLite (a file, ``:memory:``) and a real
PostgreSQL: rollouts saved, replaced, deleted and read back whole (targets, weights,
pinned tenants, rollback policy); the version changes with every change; a second store
on the same database sees the first's changes."""

from pathlib import Path

import pytest

from adapters.storage.rollouts_sql import SqlRolloutStore, open_rollout_store
from domain.rollout import RollbackPolicy, Rollout, RolloutTarget

CANARY = Rollout(
    "support",
    (RolloutTarget("v1", 90), RolloutTarget("v2", 10, frozenset({"beta", "gamma"}))),
)
QUIET = Rollout("quiet", (RolloutTarget("v1", 1),), rollback=None)
TUNED = Rollout("support", (RolloutTarget("v2", 1),), RollbackPolicy(0.5, 5, 10))


@pytest.fixture(params=["sqlite-file", "postgres"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "postgres":
        import psycopg

        url: str = request.getfixturevalue("postgres_url")
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("DROP TABLE IF EXISTS infer_rollouts, infer_rollouts_version")
        return url
    return str(tmp_path / "usage.sqlite3")


def test_saved_rollouts_read_back_whole(target: str) -> None:
    store = open_rollout_store(target)
    assert store.load() == [] and store.version() == 0
    store.save(CANARY)
    store.save(QUIET)
    assert store.load() == [QUIET, CANARY]  # by name
    first = store.version()
    store.save(TUNED)  # replaces its name's
    assert store.load() == [QUIET, TUNED] and store.version() != first
    store.delete("quiet")
    assert store.load() == [TUNED]
    store.close()


def test_a_second_store_sees_the_changes(target: str) -> None:
    one, two = open_rollout_store(target), open_rollout_store(target)
    seen = two.version()
    one.save(CANARY)
    assert two.version() != seen and two.load() == [CANARY]
    one.delete("support")
    assert two.load() == []
    one.close()
    two.close()


def test_memory_is_one_database_per_store() -> None:
    store: SqlRolloutStore = open_rollout_store(":memory:")
    store.save(CANARY)
    assert store.load() == [CANARY]
    assert open_rollout_store(":memory:").load() == []
