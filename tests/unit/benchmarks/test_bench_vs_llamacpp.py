"""benchmarks/bench_vs_llamacpp.py without servers: request counts, prompts, CPU flags,
finish reasons, token counting and the ratio table."""

import asyncio
import json

import httpx
import pytest

from tests.bench_modules import load_benchmark

bench = load_benchmark("bench_vs_llamacpp")
bs = bench.bs

CPUINFO = """processor\t: 0
model name\t: AMD EPYC 9454
flags\t\t: fpu sse avx2 fma avx512f avx512_vnni
processor\t: 1
model name\t: AMD EPYC 9454
flags\t\t: fpu sse avx2 fma avx512f avx512_vnni
"""


def _level(
    tps: float,
    ttft_ms: float,
    requests: int,
    planned: int,
    how: str = "usage",
    decode: float | None = None,
):
    summary = {
        "decode_per_stream": decode,
        "requests": requests,
        "completed": requests,
        "failed": 0,
        "output_throughput": tps,
        "ttft_ms": {"p50": ttft_ms},
    }
    return bench.Level(summary, planned, frozenset(how.split(",")))


@pytest.mark.parametrize(("c", "n"), [(1, 2), (4, 8), (16, 32), (32, 64), (64, 64), (100, 100)])
def test_requests_per_level_double_c_capped_but_never_below_c(c: int, n: int) -> None:
    assert bench.requests_for(c, 64) == n


@pytest.mark.parametrize(("c", "n"), [(1, 8), (4, 8), (16, 32), (64, 64)])
def test_requests_per_level_at_least_the_minimum(c: int, n: int) -> None:
    assert bench.requests_for(c, 64, 8) == n


def test_decode_rate_is_the_median_stream_rate_after_its_first_token() -> None:
    def result(first: float, end: float, tokens: int, error: str | None = None):
        r = bs.RequestResult(5, tokens, send=0.0, token_times=[first], end=end)
        r.output_tokens, r.error = tokens, error
        return r

    results = [
        result(0.5, 1.5, 101),  # 100 tokens in 1 s after a 0.5 s first token
        result(2.0, 4.0, 101),  # 50 tok/s: queued 2 s, which does not count
        result(0.1, 0.6, 51),  # 100 tok/s
        result(0.1, 0.2, 51, error="boom"),  # failed: left out
        result(0.1, 0.1, 1),  # one token: no rate
    ]
    assert bench.decode_rate(results) == pytest.approx(100.0)
    assert bench.decode_rate([]) is None


def test_prompts_are_deterministic_per_seed_and_differ_between_seeds() -> None:
    a = bench.prompt_text("0-c1-0", 100)
    assert a == bench.prompt_text("0-c1-0", 100)
    assert a != bench.prompt_text("0-c1-1", 100)
    assert len(a.split()) == 100


def test_cpu_model_and_isa_flags_from_cpuinfo() -> None:
    assert bench.cpu_model(CPUINFO) == "AMD EPYC 9454"
    assert bench.isa_flags(CPUINFO) == ["avx2", "fma", "avx512f", "avx512_vnni"]
    assert bench.cpu_model("") == "unknown CPU"
    assert bench.isa_flags("") == []


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ('data: {"choices": [{"text": "x", "finish_reason": null}]}', None),
        ('data: {"choices": [{"text": "", "finish_reason": "length"}]}', "length"),
        ('data: {"choices": [], "usage": {"completion_tokens": 3}}', None),
        ("data: [DONE]", None),
        ("data: not json", None),
        (": ping", None),
    ],
)
def test_finish_reason_of_a_stream_line(line: str, reason: str | None) -> None:
    assert bench.finish_reason(line) == reason


def test_tokens_counted_by_usage_then_finish_reason_then_chunks() -> None:
    usage = bs.RequestResult(5, 32, token_times=[1.0, 2.0], output_tokens=32)
    assert bench.count_tokens(usage, "length") == "usage"
    assert usage.num_output_tokens == 32
    length = bs.RequestResult(5, 32, token_times=[1.0, 2.0])
    assert bench.count_tokens(length, "length") == "finish_reason"
    assert length.num_output_tokens == 32
    chunks = bs.RequestResult(5, 32, token_times=[1.0, 2.0, 3.0])
    assert bench.count_tokens(chunks, "stop") == "chunks"
    assert chunks.num_output_tokens == 3


def test_ratio_table_has_ours_over_theirs_and_ttft_per_level() -> None:
    runs = {
        "ours gguf": {1: _level(100.0, 20.0, 2, 2, decode=120.0), 64: _level(800.0, 90.0, 64, 64)},
        "llama.cpp": {1: _level(50.0, 10.0, 2, 2, "finish_reason", decode=80.0)},
    }
    table = bench.ratio_table(runs)
    lines = table.splitlines()
    assert lines[0] == (
        "| c | ours gguf tok/s | llama.cpp tok/s | ours gguf / llama.cpp "
        "| ours gguf TTFT p50 ms | llama.cpp TTFT p50 ms | ours gguf decode tok/s per stream "
        "| llama.cpp decode tok/s per stream | ours gguf / llama.cpp decode |"
    )
    assert lines[2] == "| 1 | 100.0 | 50.0 | 2.00× | 20 | 10 | 120.0 | 80.0 | 1.50× |"
    assert lines[3] == "| 64 | 800.0 | – | – | 90 | – | – | – | – |"  # llama.cpp skipped c=64
    assert "ours gguf: usage; llama.cpp: finish_reason" in table


def test_ratio_table_marks_partial_levels_and_their_ratios() -> None:
    runs = {
        "ours gguf": {16: _level(80.0, 900.0, 32, 32)},
        "llama.cpp": {16: _level(40.0, 5000.0, 10, 32)},
    }
    row = bench.ratio_table(runs).splitlines()[2]
    assert row.startswith("| 16 | 80.0 | 40.0 (partial 10/32) | 2.00× (partial) | 900 | 5,000 |")


async def test_run_level_counts_tokens_from_finish_reason_without_usage() -> None:
    """A llama.cpp-like stream: one chunk holding two tokens, a finish chunk, no usage."""
    chunks = [
        {"choices": [{"text": "ab", "finish_reason": None}]},
        {"choices": [{"text": "", "finish_reason": "length"}]},
    ]
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    transport = httpx.MockTransport(lambda request: httpx.Response(200, text=body))
    async with httpx.AsyncClient(transport=transport) as client:
        bodies = [{"prompt": "one two", "max_tokens": 3}] * 3
        level = await bench.run_level(client, "http://x/v1/completions", bodies, 3, 2, 60.0)
    assert level.counted_by == {"finish_reason"}
    assert level.summary["completed"] == 3
    assert level.summary["total_output_tokens"] == 9
    assert not level.partial


def test_ratio_table_flags_short_outputs_and_joins_counting_methods() -> None:
    short = _level(30.0, 5.0, 2, 2, "chunks")
    short.summary["short_outputs"] = 1
    runs = {"llama.cpp": {1: short, 4: _level(40.0, 9.0, 8, 8, "finish_reason")}}
    table = bench.ratio_table(runs)
    assert "| 30.0 (1 short) |" in table
    assert "llama.cpp: chunks, finish_reason" in table


async def test_run_level_past_its_time_limit_is_partial() -> None:
    """The request that never answers is cancelled at the limit; the level keeps the rest."""
    body = 'data: {"choices": [{"text": "a", "finish_reason": "length"}]}\n\ndata: [DONE]\n\n'

    async def handler(request: httpx.Request) -> httpx.Response:
        if json.loads(request.content)["prompt"] == "slow":
            await asyncio.Event().wait()  # until cancelled
        return httpx.Response(200, text=body)

    transport = httpx.MockTransport(handler)
    async with httpx.AsyncClient(transport=transport) as client:
        bodies = [{"prompt": p, "max_tokens": 1} for p in ("fast", "slow", "fast")]
        level = await bench.run_level(client, "http://x/v1/completions", bodies, 1, 3, 0.2)
    assert level.partial
    assert level.summary["completed"] == 2
    assert "(partial 2/3)" in bench.ratio_table({"llama.cpp": {3: level}})


def test_rounds_summary_gives_each_rounds_decode_ratio_and_their_median() -> None:
    def round_(ours: float, theirs: float) -> dict:
        return {
            "ours gguf": {1: _level(100.0, 20.0, 8, 8, decode=ours)},
            "llama.cpp": {1: _level(50.0, 10.0, 8, 8, decode=theirs)},
        }

    summary = bench.rounds_summary([round_(150.0, 100.0), round_(120.0, 60.0), round_(90, 90)])
    assert summary.splitlines()[2] == "| 1 | ours gguf | 1.50, 2.00, 1.00 | 1.50× |"
