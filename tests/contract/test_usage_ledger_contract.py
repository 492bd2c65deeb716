"""The usage ledger port held against each adapter: in memory, SQLite (a file and
``:memory:``) and a real PostgreSQL server (Debian's, started here).

Records are summed per bucket from the query's start and per group; statuses are sorted
into succeeded (2xx), rate limited (429) and failed (other 4xx / 5xx / 499); filters by
tenant, model and kind; pruning drops what ended before a time; an append is all or
nothing."""

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from adapters.storage.usage_sql import open_ledger
from application.access.usage_ledger import MemoryUsageLedger
from domain.usage import COMPLETIONS, EMBEDDINGS, UsageLedger, UsageQuery, UsageRecord

T0 = 1_700_000_000.0  # a whole minute


def _postgres(url: str) -> UsageLedger:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS infer_usage")
    return open_ledger(url)


@pytest.fixture(params=["memory", "sqlite-file", "sqlite-memory", "postgres"])
def ledger(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[UsageLedger]:
    makers: dict[str, Callable[[], UsageLedger]] = {
        "memory": MemoryUsageLedger,
        "sqlite-file": lambda: open_ledger(str(tmp_path / "deep" / "usage.sqlite3")),
        "sqlite-memory": lambda: open_ledger(":memory:"),
        "postgres": lambda: _postgres(request.getfixturevalue("postgres_url")),
    }
    made = makers[request.param]()
    yield made
    made.close()


def rec(
    at: float,
    tenant: str | None = "acme",
    model: str | None = "m1",
    status: int = 200,
    prompt: int = 10,
    completion: int = 5,
    cached: int = 0,
    kind: str = COMPLETIONS,
) -> UsageRecord:
    return UsageRecord(
        ended_s=at,
        request_id=f"r{at}",
        tenant_id=tenant,
        model=model,
        route="/v1/chat/completions",
        kind=kind,
        status=status,
        prompt_tokens=prompt,
        cached_tokens=cached,
        completion_tokens=completion,
        latency_ms=12.5,
    )


def test_sums_per_bucket_and_group(ledger: UsageLedger) -> None:
    ledger.append(
        [
            rec(T0 + 1, cached=4),
            rec(T0 + 30, tenant="beta", prompt=7, completion=1),
            rec(T0 + 59.5, model="m2", completion=3),
            rec(T0 + 61),  # the next minute
            rec(T0 + 120),  # past the query's end
            rec(T0 - 0.5),  # before its start
        ]
    )
    by_tenant = ledger.totals(UsageQuery(T0, T0 + 120, 60, group_by=("tenant_id",)))
    assert [(t.bucket, t.group, t.requests, t.prompt_tokens) for t in by_tenant] == [
        (0, ("acme",), 2, 20),
        (0, ("beta",), 1, 7),
        (1, ("acme",), 1, 10),
    ]
    first = by_tenant[0]
    assert (first.completion_tokens, first.cached_tokens, first.succeeded) == (8, 4, 2)
    by_model = ledger.totals(UsageQuery(T0, T0 + 60, 60, group_by=("tenant_id", "model")))
    assert [(t.group, t.requests) for t in by_model] == [
        (("acme", "m1"), 1),
        (("acme", "m2"), 1),
        (("beta", "m1"), 1),
    ]
    whole = ledger.totals(UsageQuery(T0, T0 + 3600, 3600))
    assert [(t.bucket, t.group, t.requests) for t in whole] == [(0, (), 5)]


def test_statuses_are_sorted_into_succeeded_limited_and_failed(ledger: UsageLedger) -> None:
    ledger.append(
        [
            rec(T0, status=200),
            rec(T0, status=201),
            rec(T0, status=429, prompt=0, completion=0),
            rec(T0, status=400, prompt=0, completion=0),
            rec(T0, status=499, completion=2),
            rec(T0, status=503, prompt=0, completion=0),
        ]
    )
    (row,) = ledger.totals(UsageQuery(T0, T0 + 1, 60))
    assert (row.requests, row.succeeded, row.rate_limited, row.failed) == (6, 2, 1, 3)
    assert (row.prompt_tokens, row.completion_tokens) == (30, 12)


def test_filters_by_tenant_model_and_kind(ledger: UsageLedger) -> None:
    ledger.append(
        [
            rec(T0, tenant="acme"),
            rec(T0, tenant="beta"),
            rec(T0, tenant=None),  # an open server's caller
            rec(T0, model="m2"),
            rec(T0, kind=EMBEDDINGS, completion=0),
        ]
    )

    def count(**filters: object) -> int:
        rows = ledger.totals(UsageQuery(T0, T0 + 60, 60, **filters))  # type: ignore[arg-type]
        return sum(r.requests for r in rows)

    assert count() == 5
    assert count(tenants=frozenset({"beta"})) == 1
    assert count(tenants=frozenset({"acme", "beta"})) == 4
    assert count(tenants=frozenset()) == 0
    assert count(models=frozenset({"m2"})) == 1
    assert count(kind=EMBEDDINGS) == 1
    assert count(kind=COMPLETIONS, tenants=frozenset({"acme"})) == 2
    keyless = ledger.totals(UsageQuery(T0, T0 + 60, 60, group_by=("tenant_id",)))
    assert {r.group for r in keyless} == {("acme",), ("beta",), (None,)}


def test_prune_drops_what_ended_before(ledger: UsageLedger) -> None:
    ledger.append([rec(T0 + i * 100) for i in range(5)])
    assert ledger.prune(T0 + 250) == 3
    rows = ledger.totals(UsageQuery(T0, T0 + 1000, 1000))
    assert [r.requests for r in rows] == [2]
    assert ledger.prune(T0) == 0


def test_an_empty_append_and_an_empty_range(ledger: UsageLedger) -> None:
    ledger.append([])
    assert ledger.totals(UsageQuery(T0, T0 + 60, 60)) == []
    ledger.append([rec(T0 + 5)])
    assert ledger.totals(UsageQuery(T0 + 10, T0 + 10, 60)) == []


def test_a_sqlite_file_keeps_records_across_opens(tmp_path: Path) -> None:
    path = str(tmp_path / "usage.sqlite3")
    first = open_ledger(path)
    first.append([rec(T0), rec(T0 + 1)])
    first.close()
    again = open_ledger(f"sqlite:///{path}")
    assert [r.requests for r in again.totals(UsageQuery(T0, T0 + 60, 60))] == [2]
    again.close()


def test_a_bad_target_is_refused() -> None:
    for target in ("redis://localhost/0", "", "mysql://db/x"):
        with pytest.raises(ValueError, match="neither a file path"):
            open_ledger(target)


def test_a_failed_append_stores_nothing(tmp_path: Path) -> None:
    ledger = open_ledger(str(tmp_path / "usage.sqlite3"))
    broken = rec(T0)
    object.__setattr__(broken, "status", object())  # not storable: the batch fails
    with pytest.raises(Exception):  # noqa: B017 (sqlite3's own error type)
        ledger.append([rec(T0 + 1), broken])
    assert ledger.totals(UsageQuery(T0, T0 + 60, 60)) == []
    ledger.append([rec(T0 + 2)])  # the connection still works
    assert [r.requests for r in ledger.totals(UsageQuery(T0, T0 + 60, 60))] == [1]
    ledger.close()


def test_an_unopenable_database_is_a_named_error_but_the_default_falls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from adapters.storage import factory
    from domain.errors import InvalidParameterError

    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the database's folder would be
    with pytest.raises(InvalidParameterError) as e:
        factory.build_usage_recorder(str(blocked / "usage.sqlite3"), 90)
    assert e.value.param == "usage_db"

    def refuse(target: str) -> UsageLedger:
        raise PermissionError("read-only home")

    monkeypatch.setattr(factory, "open_ledger", refuse)
    recorder = factory.build_usage_recorder(factory.DEFAULT_USAGE_DB, 90)
    assert isinstance(recorder.ledger, MemoryUsageLedger)


def test_an_older_table_gains_the_key_column(tmp_path: Path) -> None:
    """A ledger file written before ``key_id`` existed opens, keeps its rows and records
    keys from then on."""
    import sqlite3

    path = tmp_path / "old.sqlite3"
    conn = sqlite3.connect(path)
    conn.execute(
        "CREATE TABLE infer_usage (id INTEGER PRIMARY KEY, ended_at DOUBLE PRECISION NOT NULL,"
        " request_id TEXT NOT NULL, tenant_id TEXT, model TEXT, route TEXT NOT NULL,"
        " kind TEXT NOT NULL, status INTEGER NOT NULL, prompt_tokens BIGINT NOT NULL,"
        " cached_tokens BIGINT NOT NULL, completion_tokens BIGINT NOT NULL,"
        " latency_ms DOUBLE PRECISION NOT NULL)"
    )
    conn.execute(
        "INSERT INTO infer_usage VALUES (1, ?, 'r0', 'acme', 'm1', '/v1/completions',"
        " 'completions', 200, 1, 0, 1, 1.0)",
        (T0,),
    )
    conn.commit()
    conn.close()
    ledger = open_ledger(str(path))
    ledger.append(
        [
            UsageRecord(
                T0 + 1, "r1", "acme", "m1", "/v1/completions", COMPLETIONS, 200, key_id="key_1"
            )
        ]
    )
    rows = ledger.totals(UsageQuery(T0, T0 + 60, 60, group_by=("key_id",)))
    assert [(r.group, r.requests) for r in rows] == [((None,), 1), (("key_1",), 1)]
    ledger.close()
    open_ledger(str(path)).close()  # opened again: the column is there already
