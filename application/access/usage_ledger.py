"""UsageRecorder: API requests' usage records, written to the ledger in the background.

Serving a request never waits on the database: :meth:`UsageRecorder.record` appends to an
in-memory queue, and a writer thread stores the queue every ``flush_s`` seconds in one
transaction. A ledger that fails (the database down) keeps the records queued and is
retried, with a back-off; past ``max_pending`` queued records the oldest are dropped,
counted (:attr:`UsageRecorder.dropped`) and logged, so a dead database costs memory only
up to that bound. Records older than ``retention_s`` are pruned hourly. Reads
(:meth:`totals`) first store what is queued, so a usage query sees every request that
ended before it.
"""

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

import structlog

from application.access.access import Access
from domain.errors import StoreUnavailableError
from domain.usage import UsageLedger, UsageQuery, UsageRecord, UsageTotals

log = structlog.get_logger("infer.usage")

DEFAULT_FLUSH_S = 1.0
DEFAULT_MAX_PENDING = 100_000
DEFAULT_RETENTION_DAYS = 90
DAY_S = 24 * 3600
PRUNE_EVERY_S = 3600.0
MAX_BACKOFF_S = 30.0


class UsageRecorder:
    def __init__(
        self,
        ledger: UsageLedger,
        *,
        flush_s: float = DEFAULT_FLUSH_S,
        max_pending: int = DEFAULT_MAX_PENDING,
        retention_s: float | None = DEFAULT_RETENTION_DAYS * DAY_S,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        """``retention_s`` None: records are kept for ever."""
        self.ledger, self.flush_s, self.max_pending = ledger, flush_s, max_pending
        self.retention_s, self._clock = retention_s, wall_clock
        self._pending: deque[UsageRecord] = deque()
        self._lock = threading.Lock()  # the queue
        self._writing = threading.Lock()  # one writer at a time (the thread, a reader)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._next_prune = 0.0
        self.dropped = 0
        self.failures = 0

    def record(self, record: UsageRecord) -> None:
        """Queue ``record`` (never blocks on the database)."""
        with self._lock:
            self._pending.append(record)
            if len(self._pending) > self.max_pending:
                self._pending.popleft()
                self.dropped += 1
                if self.dropped == 1 or self.dropped % 10_000 == 0:
                    log.warning(
                        "usage records dropped: the ledger is behind",
                        dropped=self.dropped,
                        max_pending=self.max_pending,
                    )

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="usage-ledger", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop the writer, store what is queued (once more), close the ledger."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30.0)
            self._thread = None
        try:
            self.flush()
        except Exception as e:
            log.error("usage records not stored at shutdown", error=str(e), lost=self.pending)
        self.ledger.close()

    def flush(self) -> int:
        """Store the queued records now (blocking); how many. Raises what the ledger
        raised (the records stay queued)."""
        with self._writing:
            with self._lock:
                batch = list(self._pending)
                self._pending.clear()
            try:
                self.ledger.append(batch)
            except BaseException:
                with self._lock:  # back in front, in order, within the bound
                    self._pending.extendleft(reversed(batch))
                    while len(self._pending) > self.max_pending:
                        self._pending.popleft()
                        self.dropped += 1
                raise
            return len(batch)

    def prune(self) -> int:
        if self.retention_s is None:
            return 0
        with self._writing:
            return self.ledger.prune(self._clock() - self.retention_s)

    async def totals(self, query: UsageQuery) -> list[UsageTotals]:
        """The ledger's sums for ``query``, queued records stored first (off the loop)."""
        return await asyncio.to_thread(self._totals, query)

    def _totals(self, query: UsageQuery) -> list[UsageTotals]:
        try:
            self.flush()
        except Exception as e:  # answer from what is stored; the writer retries
            log.warning("usage records not stored before a query", error=str(e))
        try:
            return self.ledger.totals(query)
        except Exception as e:
            raise StoreUnavailableError(f"the usage database cannot be read now: {e}") from e

    def _run(self) -> None:
        backoff = self.flush_s
        while not self._stop.is_set():
            self._wake.wait(backoff)
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                self.flush()
                if self._clock() >= self._next_prune:
                    self._next_prune = self._clock() + PRUNE_EVERY_S
                    if pruned := self.prune():
                        log.info("usage records pruned", records=pruned)
                backoff = self.flush_s
            except Exception as e:
                self.failures += 1
                backoff = min(MAX_BACKOFF_S, max(backoff, self.flush_s) * 2)
                log.error(
                    "usage records not stored; retrying",
                    error=str(e),
                    pending=self.pending,
                    retry_in_s=backoff,
                )


class MemoryUsageLedger:
    """The ledger in this process's memory (``--usage-db :memory:`` is SQLite's; this one
    serves apps built without a database, as in tests): lost on restart."""

    def __init__(self) -> None:
        self._records: list[UsageRecord] = []
        self._lock = threading.Lock()

    def append(self, records: Sequence[UsageRecord]) -> None:
        with self._lock:
            self._records.extend(records)

    def totals(self, query: UsageQuery) -> list[UsageTotals]:
        sums: dict[tuple[int, tuple[str | None, ...]], list[int]] = {}
        with self._lock:
            records = list(self._records)
        for r in records:
            if not query.start_s <= r.ended_s < query.end_s:
                continue
            if query.tenants is not None and r.tenant_id not in query.tenants:
                continue
            if query.models is not None and r.model not in query.models:
                continue
            if query.kind is not None and r.kind != query.kind:
                continue
            bucket = int((r.ended_s - query.start_s) // query.bucket_s)
            group = tuple(getattr(r, column) for column in query.group_by)
            row = sums.setdefault((bucket, group), [0] * 7)
            ok, limited = 200 <= r.status < 300, r.status == 429
            for i, value in enumerate(
                (
                    1,
                    ok,
                    limited,
                    r.status >= 400 and not limited,
                    r.prompt_tokens,
                    r.cached_tokens,
                    r.completion_tokens,
                )
            ):
                row[i] += int(value)
        return [
            UsageTotals(bucket, group, *row)
            for (bucket, group), row in sorted(sums.items(), key=lambda kv: _order(kv[0]))
        ]

    def prune(self, before_s: float) -> int:
        with self._lock:
            kept = [r for r in self._records if r.ended_s >= before_s]
            pruned, self._records = len(self._records) - len(kept), kept
        return pruned

    def close(self) -> None:
        pass


def _order(key: tuple[int, tuple[str | None, ...]]) -> tuple[int, tuple[tuple[bool, str], ...]]:
    """Buckets in order, then groups (None first, as SQL sorts NULLs in SQLite)."""
    bucket, group = key
    return bucket, tuple((value is not None, value or "") for value in group)


async def seed_daily_quotas(access: Access, recorder: UsageRecorder) -> int:
    """Count what each tenant with a daily quota used in the last 24 hours (the ledger's
    requests under ``/v1/``, but those refused with a 429, and their tokens) into its day
    windows: daily quotas survive a restart when their counters live in memory. How many
    tenants were seeded."""
    if access.keyring is None or access.quotas is None:
        return 0
    daily = {
        t.id: t
        for t in access.keyring.tenants
        if t.limits.requests_per_day is not None or t.limits.tokens_per_day is not None
    }
    if not daily:
        return 0
    now = time.time()
    query = UsageQuery(
        now - DAY_S, now + 1, DAY_S + 1, group_by=("tenant_id",), tenants=frozenset(daily)
    )
    seeded = 0
    for row in await recorder.totals(query):
        tenant = daily.get(row.group[0] or "")
        if tenant is not None:
            used = row.prompt_tokens + row.completion_tokens
            await access.quotas.seed(tenant, row.requests - row.rate_limited, used)
            seeded += 1
    return seeded
