"""The usage recorder: requests never wait on the database; a failing ledger keeps the
records queued and retried; the queue is bounded (the oldest dropped, counted); a query
stores what is queued first; closing stores the rest; old records are pruned."""

import asyncio
import threading
import time
from collections.abc import Sequence

import pytest

from application.access.usage_ledger import MemoryUsageLedger, UsageRecorder
from domain.usage import COMPLETIONS, UsageQuery, UsageRecord, UsageTotals


def rec(at: float, request_id: str = "r") -> UsageRecord:
    return UsageRecord(at, request_id, "acme", "m", "/v1/completions", COMPLETIONS, 200, 3, 0, 2)


class FlakyLedger(MemoryUsageLedger):
    """Fails while ``down`` is set; ``slow``: each append waits for it to be cleared."""

    def __init__(self) -> None:
        super().__init__()
        self.down = threading.Event()
        self.appends = 0

    def append(self, records: Sequence[UsageRecord]) -> None:
        self.appends += 1
        if self.down.is_set():
            raise ConnectionError("database down")
        super().append(records)


def total(ledger: MemoryUsageLedger) -> int:
    return sum(r.requests for r in ledger.totals(UsageQuery(0, 10**10, 10**10)))


def wait_until(condition: object, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_the_writer_stores_queued_records_in_the_background() -> None:
    ledger = MemoryUsageLedger()
    recorder = UsageRecorder(ledger, flush_s=0.02, retention_s=None)
    recorder.start()
    for i in range(5):
        recorder.record(rec(1000 + i))
    wait_until(lambda: total(ledger) == 5)
    assert recorder.pending == 0
    recorder.close()


def test_a_failing_ledger_keeps_records_in_order_and_retries() -> None:
    ledger = FlakyLedger()
    ledger.down.set()
    recorder = UsageRecorder(ledger, flush_s=0.01, retention_s=None)
    recorder.start()
    recorder.record(rec(1, "a"))
    wait_until(lambda: recorder.failures >= 2)
    recorder.record(rec(2, "b"))
    assert total(ledger) == 0 and recorder.pending == 2
    ledger.down.clear()
    wait_until(lambda: total(ledger) == 2, timeout=10)
    assert [r.request_id for r in ledger._records] == ["a", "b"]
    recorder.close()


def test_the_queue_is_bounded_dropping_the_oldest() -> None:
    ledger = FlakyLedger()
    ledger.down.set()
    recorder = UsageRecorder(ledger, max_pending=3)
    for i in range(5):
        recorder.record(rec(i, f"r{i}"))
    assert (recorder.pending, recorder.dropped) == (3, 2)
    with pytest.raises(ConnectionError):
        recorder.flush()
    assert recorder.pending == 3  # put back, still within the bound
    ledger.down.clear()
    assert recorder.flush() == 3
    assert [r.request_id for r in ledger._records] == ["r2", "r3", "r4"]


def test_a_query_stores_the_queue_first() -> None:
    ledger = MemoryUsageLedger()
    recorder = UsageRecorder(ledger, flush_s=3600)  # the writer would wait an hour
    recorder.start()
    recorder.record(rec(50))
    rows: list[UsageTotals] = asyncio.run(recorder.totals(UsageQuery(0, 100, 100)))
    assert [r.requests for r in rows] == [1]
    recorder.close()


def test_a_query_answers_from_the_ledger_when_it_cannot_store() -> None:
    ledger = FlakyLedger()
    ledger.append([rec(10)])
    ledger.down.set()
    recorder = UsageRecorder(ledger)
    recorder.record(rec(20))
    rows = asyncio.run(recorder.totals(UsageQuery(0, 100, 100)))
    assert [r.requests for r in rows] == [1] and recorder.pending == 1


def test_close_stores_what_is_left() -> None:
    ledger = MemoryUsageLedger()
    recorder = UsageRecorder(ledger, flush_s=3600)
    recorder.start()
    recorder.record(rec(1))
    recorder.close()
    assert total(ledger) == 1


def test_old_records_are_pruned() -> None:
    now = [10_000.0]
    ledger = MemoryUsageLedger()
    ledger.append([rec(100), rec(9_000), rec(9_999)])
    recorder = UsageRecorder(ledger, retention_s=1_500, wall_clock=lambda: now[0])
    assert recorder.prune() == 1 and total(ledger) == 2
    assert UsageRecorder(ledger, retention_s=None).prune() == 0
