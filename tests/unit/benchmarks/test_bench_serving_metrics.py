"""benchmarks/bench_serving.py without a server: metrics, SSE parsing, the request loop
over a mocked transport, and the seeded workloads."""

import argparse
import json

import httpx
import pytest

from tests.bench_modules import load_benchmark

bench = load_benchmark("bench_serving")
approx = pytest.approx


def _result(
    send: float, tokens: list[float], end: float, n: int, prompt: int = 10, error: str | None = None
):
    return bench.RequestResult(
        prompt_len=prompt,
        expected_tokens=n,
        send=send,
        token_times=tokens,
        end=end,
        output_tokens=n,
        error=error,
    )


def _four_results() -> list:
    return [
        # TTFT 100, ITLs 50 and 100, E2EL 300, TPOT (300 - 100) / 2 = 100 ms
        _result(0.0, [0.1, 0.15, 0.25], 0.3, 3, prompt=10),
        # TTFT 200, ITL 50, E2EL 400, TPOT (400 - 200) / 1 = 200 ms
        _result(0.05, [0.25, 0.3], 0.45, 2, prompt=20),
        # one token: TTFT 500, E2EL 600, no ITL, no TPOT
        _result(0.0, [0.5], 0.6, 1, prompt=5),
        _result(0.1, [], 0.2, 0, prompt=99, error="HTTP 503: overloaded"),
    ]


def test_summarize_computes_vllm_style_latencies_in_ms() -> None:
    s = bench.summarize(_four_results(), duration=0.6)
    assert s["ttft_ms"] == approx({"mean": 800 / 3, "p50": 200, "p95": 470, "p99": 494})
    assert s["itl_ms"] == approx({"mean": 200 / 3, "p50": 50, "p95": 95, "p99": 99})
    assert s["tpot_ms"] == approx({"mean": 150, "p50": 150, "p95": 195, "p99": 199})
    assert s["e2el_ms"] == approx({"mean": 1300 / 3, "p50": 400, "p95": 580, "p99": 596})


def test_summarize_computes_throughput_over_successful_requests() -> None:
    results = _four_results()
    duration = bench.span(results)
    assert duration == approx(0.6)
    s = bench.summarize(results, duration)
    assert s["total_input_tokens"] == 35
    assert s["total_output_tokens"] == 6
    assert s["output_throughput"] == approx(10.0)
    assert s["request_throughput"] == approx(5.0)
    assert s["total_token_throughput"] == approx(41 / 0.6)


def test_summarize_counts_failures_with_their_messages() -> None:
    results = [*_four_results(), _result(0.2, [0.3], 0.4, 1, error="error chunk: boom")]
    results.append(_result(0.2, [], 0.3, 0, error="HTTP 503: overloaded"))
    s = bench.summarize(results, 1.0)
    assert (s["requests"], s["completed"], s["failed"]) == (6, 3, 3)
    assert s["errors"] == {"HTTP 503: overloaded": 2, "error chunk: boom": 1}
    assert s["short_outputs"] == 0


def test_summarize_flags_short_outputs_and_chunks_that_disagree_with_usage() -> None:
    short = _result(0.0, [0.1, 0.2], 0.2, 2)
    short.expected_tokens = 8
    merged = _result(0.0, [0.1, 0.2], 0.2, 3)  # two tokens arrived in one chunk
    s = bench.summarize([short, merged], 0.2)
    assert (s["short_outputs"], s["chunk_count_mismatch"]) == (1, 1)
    assert s["total_output_tokens"] == 5  # usage counts, not chunks


def test_summarize_with_only_failures_has_no_latencies() -> None:
    s = bench.summarize([_result(0.0, [], 0.1, 0, error="ConnectError: refused")], 0.1)
    assert s["failed"] == 1 and s["output_throughput"] == 0.0
    assert s["ttft_ms"] == {"mean": None, "p50": None, "p95": None, "p99": None}


def _chunk(text: str, finish: str | None = None) -> str:
    choice = {"index": 0, "text": text, "finish_reason": finish}
    return "data: " + json.dumps({"id": "cmpl-1", "object": "text_completion", "choices": [choice]})


USAGE = "data: " + json.dumps(
    {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}}
)


def test_parse_sse_line_tells_tokens_usage_done_and_errors_apart() -> None:
    assert bench.parse_sse_line(_chunk("Hi")).kind == "token"
    assert bench.parse_sse_line(_chunk("")).kind == "token"  # a token whose text is held back
    assert bench.parse_sse_line(USAGE) == bench.SSEEvent("usage", 3)
    assert bench.parse_sse_line("data: [DONE]\r") == bench.SSEEvent("done")
    error = 'data: {"error": {"message": "boom", "type": "server_error"}}'
    assert bench.parse_sse_line(error) == bench.SSEEvent("error", message="boom")
    assert bench.parse_sse_line("data: {oops").kind == "error"
    for line in ("", "\r", ": ping", "event: message", "id: 3"):
        assert bench.parse_sse_line(line) is None


def test_record_line_times_token_chunks_and_reads_usage() -> None:
    result = bench.RequestResult(prompt_len=4, expected_tokens=3, send=0.0)
    lines = [_chunk("a"), "", _chunk(""), "", _chunk("c", "length"), "", USAGE, "", "data: [DONE]"]
    done = [bench.record_line(result, line, t) for t, line in enumerate(lines, 1)]
    assert done == [False] * 8 + [True]
    assert result.token_times == [1, 3, 5]
    assert result.output_tokens == 3 and result.ok


def test_record_line_stops_at_an_error_chunk() -> None:
    result = bench.RequestResult(prompt_len=4, expected_tokens=3)
    assert not bench.record_line(result, _chunk("a"), 1.0)
    assert bench.record_line(result, 'data: {"error": {"message": "engine died"}}', 2.0)
    assert result.error == "error chunk: engine died" and not result.ok


def _client(status: int, body: str) -> httpx.AsyncClient:
    def handler(request: httpx.Request) -> httpx.Response:
        sent = json.loads(request.content)
        assert sent["stream"] and sent["ignore_eos"] and sent["prompt"] == [5, 6, 7]
        assert sent["stream_options"] == {"include_usage": True} and sent["max_tokens"] == 3
        return httpx.Response(status, text=body)

    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


SPEC = bench.RequestSpec([5, 6, 7], 3)


async def test_send_request_records_a_whole_stream() -> None:
    body = "\r\n\r\n".join([_chunk("a"), _chunk("b"), _chunk("c", "length"), USAGE, "data: [DONE]"])
    async with _client(200, body + "\r\n\r\n") as client:
        result = await bench.send_request(client, "http://test/v1/completions", "m", SPEC)
    assert result.ok and result.output_tokens == 3 and len(result.token_times) == 3
    assert result.send <= result.token_times[0] <= result.end
    assert result.prompt_len == 3


async def test_send_request_reports_http_errors_and_truncated_streams() -> None:
    async with _client(503, '{"error": {"message": "queue full"}}') as client:
        result = await bench.send_request(client, "http://test/v1/completions", "m", SPEC)
    assert result.error is not None and result.error.startswith("HTTP 503: ")
    async with _client(200, _chunk("a") + "\n\n") as client:
        result = await bench.send_request(client, "http://test/v1/completions", "m", SPEC)
    assert result.error == "stream ended without [DONE]"


def _args(**overrides: object) -> argparse.Namespace:
    args = {
        "seed": 0,
        "workloads": ["w1", "w2", "sweep"],
        "w1_input_len": 256,
        "w1_output_len": 256,
        "w2_requests": 16,
        "w2_input_len": (32, 1024),
        "w2_output_len": (64, 256),
        "concurrency": [1, 4],
        "sweep_requests_per_concurrency": 2,
        "sweep_input_len": (64, 256),
        "sweep_output_len": 128,
        "temperature": 0.0,
        "top_p": 1.0,
    }
    return argparse.Namespace(**(args | overrides))


def test_workloads_are_seeded_and_in_range() -> None:
    workloads = bench.build_workloads(_args(), vocab_size=49152)
    assert [w.name for w in workloads] == ["W1", "W2", "sweep c=1", "sweep c=4"]
    assert [(w.concurrency, len(w.specs)) for w in workloads] == [(1, 1), (16, 16), (1, 2), (4, 8)]
    w1, w2 = workloads[0].specs[0], workloads[1].specs
    assert (len(w1.prompt), w1.output_len) == (256, 256)
    assert all(32 <= len(s.prompt) <= 1024 and 64 <= s.output_len <= 256 for s in w2)
    assert all(100 <= t < 48152 for s in w2 for t in s.prompt)
    assert all(s.output_len == 128 for s in workloads[3].specs)
    # the same seed gives the same prompts, whichever other workloads are selected
    again = bench.build_workloads(_args(workloads=["w2"]), vocab_size=49152)
    assert again[0].specs == w2
    assert bench.build_workloads(_args(seed=1), vocab_size=49152)[1].specs != w2
    # sampling parameters reach every request
    sampled = bench.build_workloads(_args(temperature=0.8, top_p=0.95), vocab_size=49152)
    assert {(s.temperature, s.top_p) for w in sampled for s in w.specs} == {(0.8, 0.95)}
    assert [s.prompt for s in sampled[1].specs] == [s.prompt for s in w2]


async def test_sse_lines_split_only_at_cr_lf() -> None:
    async def chunks():
        yield b'data: {"text": "a\xe2\x80\xa8b"}\r\n\r\nda'  # U+2028 inside the JSON
        yield b"ta: [DONE]\n\n"

    lines = [line async for line in bench.sse_lines(chunks())]
    assert lines == ['data: {"text": "a\u2028b"}', "", "data: [DONE]", ""]


def test_round_ratios_lists_each_round_and_the_median() -> None:
    def result(tps: float) -> dict:
        return {"W2": {"output_throughput": tps}}

    rounds = [
        {"static": result(100.0), "continuous": result(120.0)},
        {"continuous": result(150.0), "static": result(100.0)},
        {"static": result(200.0), "continuous": result(260.0)},
    ]
    ratios = bench.round_ratios(rounds, ["W2"])
    assert ratios == {"W2 continuous/static by round": "1.20, 1.50, 1.30 (median 1.30×)"}


def test_the_batch_flag_is_vllms_with_the_old_spelling_kept() -> None:
    """``--max-num-seqs`` (``--max-batch-size`` still read) sets what the report and the
    launched servers use."""
    assert bench._args([]).max_num_seqs == 64
    assert bench._args(["--max-num-seqs", "8"]).max_num_seqs == 8
    assert bench._args(["--max-batch-size", "16"]).max_num_seqs == 16
