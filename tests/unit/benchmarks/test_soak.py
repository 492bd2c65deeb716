"""benchmarks/soak.py without a server: the KV pool's resident part from smaps, the start-up
line and metrics it reads, one client request's outcome, and the summary."""

import argparse
import asyncio
import json
from pathlib import Path

import httpx
import pytest

from tests.bench_modules import load_benchmark

soak = load_benchmark("soak")
MIB = 2**20


def _mapping(start: str, size_kib: int, rss_kib: int, path: str = "") -> str:
    header = f"{start}-ffffffff rw-p 00000000 00:00 0"
    header += f"                          {path}" if path else ""
    return f"{header}\nSize:           {size_kib} kB\nRss:            {rss_kib} kB\nPss: 0 kB\n"


def test_the_pools_resident_part_is_its_large_anonymous_mappings() -> None:
    pool = 4096 * MIB  # keys and values: 2 GiB each
    smaps = "".join(
        [
            _mapping("7f0000000000", 2 * 1024 * 1024 + 8, 700 * 1024),  # keys
            _mapping("7f1000000000", 2 * 1024 * 1024 + 8, 600 * 1024),  # values
            _mapping("7f2000000000", 3 * 1024 * 1024, 900 * 1024, "/models/weights.bin"),
            _mapping("7f3000000000", 64 * 1024, 64 * 1024),  # the heap's arenas
        ]
    )
    assert soak.pool_resident_in(smaps, pool) == 1300 * MIB
    merged = _mapping("7f0000000000", 4 * 1024 * 1024 + 16, 1300 * 1024)  # one VMA
    assert soak.pool_resident_in(merged, pool) == 1300 * MIB
    assert soak.pool_resident_in(_mapping("7f3000000000", 64 * 1024, 64 * 1024), pool) is None


def test_the_kv_line_and_the_token_counters_are_read(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    line = {"blocks": 11650, "tokens": 186400, "memory_mib": 4095.7, "event": "KV cache"}
    log.write_text("serving\n" + json.dumps(line) + "\n")
    assert soak.kv_field(log, "tokens") == 186400
    assert soak.kv_field(log, "memory_mib") == 4095.7
    log.write_text("[info] KV cache  block_size=16 blocks=364 memory_mib=128.0 tokens=5824\n")
    assert soak.kv_field(log, "tokens") == 5824
    metrics = (
        "# TYPE infer:prompt_tokens counter\n"
        'infer:prompt_tokens_total{model_name="m"} 120.0\n'
        'infer:prompt_tokens_created{model_name="m"} 1.7e9\n'
        'infer:generation_tokens_total{model_name="m"} 3.0e2\n'
    )
    assert soak.metric_total(metrics, "infer:prompt_tokens") == 120
    assert soak.metric_total(metrics, "infer:generation_tokens") == 300
    assert soak.metric_total(metrics, "infer:absent") is None


def _stream(chunks: int, usage: int, done: bool = True) -> bytes:
    events = [json.dumps({"choices": [{"delta": {"content": "x"}}]}) for _ in range(chunks)]
    events.append(json.dumps({"choices": [], "usage": {"completion_tokens": usage}}))
    body = "".join(f"data: {e}\n\n" for e in events)
    return (body + ("data: [DONE]\n\n" if done else "")).encode()


@pytest.mark.parametrize(
    ("status", "body", "leave_after", "outcome"),
    [
        (200, _stream(8, 8), None, "completed"),
        (200, _stream(8, 8), 3, "left_early"),
        (200, _stream(5, 5), None, "lost"),  # fewer tokens than asked
        (200, _stream(8, 8, done=False), None, "lost"),
        (503, b'{"error": "full"}', None, "lost"),
    ],
)
def test_a_requests_outcome_is_tallied(
    status: int, body: bytes, leave_after: int | None, outcome: str
) -> None:
    transport = httpx.MockTransport(lambda _: httpx.Response(status, content=body))
    tally = soak.Tally()

    async def run() -> None:
        async with httpx.AsyncClient(transport=transport) as client:
            url = "http://x/v1/chat/completions"
            await soak.one_request(client, url, {}, 8, leave_after, tally)

    asyncio.run(run())
    counts = {"completed": tally.completed, "left_early": tally.left_early, "lost": tally.lost}
    assert counts == {k: int(k == outcome) for k in counts}
    assert bool(tally.errors) == (outcome == "lost")


def test_the_summary_compares_the_end_with_minute_five() -> None:
    def sample(minute: float, rss_mib: int, pool_mib: int) -> object:
        return soak.Sample(minute * 60, rss_mib * MIB, pool_mib * MIB, 20, 1, None, 0, 0, 0)

    samples = [sample(0, 600, 0), sample(5.1, 1400, 600), sample(18, 2600, 1790)]
    args = argparse.Namespace(
        clients=48, duration_min=18, tokens=128, leave_fraction=0.1, server_arg=[], server_env=[]
    )
    result = soak.summary(args, soak.Tally(sent=3, completed=3), samples, 186400)
    assert result["rss_min5_mib"] == 1400 and result["rss_end_mib"] == 2600
    assert result["outside_pool_min5_mib"] == 800 and result["outside_pool_end_mib"] == 810
    text = soak.report(result)
    assert "1.857x, NOT within 5 %" in text
    assert "RSS outside the KV pool: 800 MiB at minute 5, 810 MiB at the end: 1.012x" in text
