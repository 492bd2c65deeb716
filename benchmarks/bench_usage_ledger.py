"""The usage ledger's cost: what recording a request costs the serving path, how fast each
database stores records, and how long a usage query over many takes.

    .venv/bin/python benchmarks/bench_usage_ledger.py [--records 200000]

- ``record()``: the only work on a request's path (a queue append under a lock), per call.
- store: records per second written by the writer thread's batches (one transaction each,
  1,000 records a batch, as a busy server's second would hold), SQLite file (WAL) and
  PostgreSQL (Debian's, started here when installed), side by side.
- query: a 30-day usage query per day, grouped by tenant and model, over all the records.
Every number is from this run, this machine; the ratios say how much room a server has:
a server answering R requests a second uses R / (store rate) of the writer thread.
"""

import argparse
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from adapters.storage.usage_sql import open_ledger  # noqa: E402
from application.access.usage_ledger import MemoryUsageLedger, UsageRecorder  # noqa: E402
from domain.usage import COMPLETIONS, UsageLedger, UsageQuery, UsageRecord  # noqa: E402

DAY = 86400.0


def records(n: int, start: float) -> list[UsageRecord]:
    rng = random.Random(0)
    return [
        UsageRecord(
            ended_s=start + rng.random() * 30 * DAY,
            request_id=f"chatcmpl-{i:032x}",
            tenant_id=f"tenant-{rng.randrange(50)}",
            model=rng.choice(["smollm2", "support-v1", "support-v2"]),
            route="/v1/chat/completions",
            kind=COMPLETIONS,
            status=200 if rng.random() > 0.02 else 429,
            prompt_tokens=rng.randrange(20, 2000),
            cached_tokens=rng.randrange(0, 1000),
            completion_tokens=rng.randrange(1, 500),
            latency_ms=rng.random() * 5000,
        )
        for i in range(n)
    ]


def cpu_name() -> str:
    """The CPU's model name, its vCPUs and its widest vector ISA."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or "unknown CPU"
    name = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "")
    flags = set(next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), []))
    isa = next((i for f, i in ISAS if f in flags), "no AVX2")
    cpus = sum(ln.startswith("processor") for ln in lines)
    return f"{name or 'unknown CPU'}, {cpus} vCPUs, {isa}"


ISAS = (("avx512_bf16", "AVX-512 + BF16"), ("avx512f", "AVX-512"), ("avx2", "AVX2"))


def time_record(n: int, batch: list[UsageRecord]) -> float:
    recorder = UsageRecorder(MemoryUsageLedger(), max_pending=n + 1)
    started = time.perf_counter()
    for record in batch[:n]:
        recorder.record(record)
    return (time.perf_counter() - started) / n


def time_store(ledger: UsageLedger, batch: list[UsageRecord], size: int = 1000) -> float:
    started = time.perf_counter()
    for i in range(0, len(batch), size):
        ledger.append(batch[i : i + size])
    return len(batch) / (time.perf_counter() - started)


def time_query(ledger: UsageLedger, start: float, runs: int = 5) -> float:
    query = UsageQuery(start, start + 30 * DAY, int(DAY), group_by=("tenant_id", "model"))
    times = []
    for _ in range(runs):
        began = time.perf_counter()
        rows = ledger.totals(query)
        times.append(time.perf_counter() - began)
    assert rows, "no rows"
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=200_000)
    args = parser.parse_args()
    start = 1_760_000_000.0
    batch = records(args.records, start)
    per_record = time_record(min(args.records, 100_000), batch)
    ledgers: dict[str, Callable[[ExitStack], UsageLedger]] = {}
    folder = Path(tempfile.mkdtemp(prefix="bench-usage-"))
    ledgers["SQLite file (WAL)"] = lambda _: open_ledger(str(folder / "usage.sqlite3"))
    from tests.support.postgres import postgres_bin, postgres_server

    if postgres_bin() is not None:
        ledgers["PostgreSQL 127.0.0.1 (fsync off)"] = lambda stack: open_ledger(
            stack.enter_context(postgres_server())
        )
    print(f"CPU: {cpu_name()}; {args.records:,} records")
    print(f"record() on the request path: {per_record * 1e6:.2f} µs a call")
    print(
        "| database | store (records/s) | × SQLite | 30-day query by day × tenant × model (ms)"
        " | × SQLite |"
    )
    print("|---|---|---|---|---|")
    first: tuple[float, float] | None = None
    with ExitStack() as stack:
        for name, make in ledgers.items():
            ledger = make(stack)
            rate = time_store(ledger, batch)
            query_ms = time_query(ledger, start) * 1000
            first = first or (rate, query_ms)
            print(
                f"| {name} | {rate:,.0f} | {rate / first[0]:.2f} | {query_ms:,.0f} |"
                f" {query_ms / first[1]:.2f} |"
            )
            ledger.close()
    # The request path's share: a record() call against one stored record's write.
    print(f"record() / one record stored in SQLite: {per_record * first[0]:.3f}" if first else "")


if __name__ == "__main__":
    main()
