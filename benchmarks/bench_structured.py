"""Structured outputs: constrained JSON decoding (``response_format`` json_schema) against
unconstrained decoding of the same prompts and lengths, side by side on one server.

For each concurrency c, ``--requests-per-concurrency`` * c streamed ``/v1/completions``
requests (greedy), at most c in flight, prompts asking for the documents of
tests/structured_schemas.py. A warm-up pass runs each prompt constrained and notes its
output length; then each round runs the unconstrained requests (EOS ignored, ``max_tokens``
= that length, so both sides decode the same number of tokens) and the constrained ones,
alternating which goes first. Decode tok/s per request is 1 / TPOT; the table gives the
mean over requests and the output throughput (tokens / wall span). The target (issue 14):
constrained >= 0.9x unconstrained decode tok/s at c=1 and c=16. Usage:

    .venv/bin/python benchmarks/bench_structured.py [--dtype float32] [--rounds 3] \\
        [--concurrency 1,16] [--requests-per-concurrency 2]
    .venv/bin/python benchmarks/bench_structured.py --concurrency 1,2 --rounds 1 \\
        --requests-per-concurrency 1 --schemas 3                          # smoke run
"""

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import bench_serving as bs
from tests.structured_schemas import SCHEMAS, SchemaCase

MODES = ("unconstrained", "constrained")


def prompt(case: SchemaCase) -> str:
    return (
        "<|im_start|>system\nYou answer with JSON only.<|im_end|>\n"
        f"<|im_start|>user\n{case.prompt}<|im_end|>\n<|im_start|>assistant\n"
    )


def body(case: SchemaCase, mode: str, max_tokens: int) -> dict[str, Any]:
    request: dict[str, Any] = {
        "prompt": prompt(case),
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if mode == "constrained":
        schema = {"name": case.name, "schema": case.schema, "strict": True}
        request["response_format"] = {"type": "json_schema", "json_schema": schema}
    else:
        request["ignore_eos"] = True
    return request


async def send(
    client: httpx.AsyncClient, url: str, request: dict[str, Any], expected: int
) -> bs.RequestResult:
    result = bs.RequestResult(0, expected)
    result.send = time.perf_counter()
    done = False
    async with client.stream("POST", url, json=request) as response:
        if response.status_code != 200:
            result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
        else:
            async for line in bs.sse_lines(response.aiter_bytes()):
                if done := bs.record_line(result, line, time.perf_counter()):
                    break
    result.end = time.perf_counter()
    if result.ok and not done:
        result.error = "stream ended without [DONE]"
    return result


async def run(
    client: httpx.AsyncClient,
    url: str,
    jobs: list[tuple[SchemaCase, int]],
    mode: str,
    concurrency: int,
) -> list[bs.RequestResult]:
    gate = asyncio.Semaphore(concurrency)

    async def one(case: SchemaCase, length: int) -> bs.RequestResult:
        async with gate:
            return await send(client, url, body(case, mode, length), length)

    return list(await asyncio.gather(*(one(c, n) for c, n in jobs)))


def decode_rate(results: list[bs.RequestResult]) -> float:
    """Mean over requests of 1 / TPOT (tokens per second after the first)."""
    tpots = [t for r in results if r.ok and (t := r.tpot)]
    return statistics.fmean(1.0 / t for t in tpots) if tpots else 0.0


async def bench(base_url: str, args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    url = f"{base_url}/v1/completions"
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    rates: dict[str, dict[str, list[float]]] = {}
    schemas = SCHEMAS[: args.schemas]
    async with httpx.AsyncClient(
        timeout=timeout, limits=httpx.Limits(max_connections=None)
    ) as client:
        lengths = {}
        for case in schemas:  # warm-up, and each document's length
            [r] = await run(client, url, [(case, args.max_tokens)], "constrained", 1)
            if not r.ok:
                raise RuntimeError(f"{case.name}: {r.error}")
            lengths[case.name] = max(r.num_output_tokens, 2)
        for c in args.concurrency:
            cases = [schemas[i % len(schemas)] for i in range(c * args.requests_per_concurrency)]
            jobs = [(case, lengths[case.name]) for case in cases]
            rates[f"c={c}"] = {f"{m} {k}": [] for m in MODES for k in ("decode", "throughput")}
            for round_ in range(args.rounds):
                order = MODES if round_ % 2 == 0 else MODES[::-1]
                for mode in order:
                    results = await run(client, url, jobs, mode, c)
                    failed = [r.error for r in results if not r.ok]
                    if failed:
                        raise RuntimeError(f"{mode} c={c}: {failed[0]}")
                    summary = bs.summarize(results, bs.span(results))
                    rates[f"c={c}"][f"{mode} decode"].append(decode_rate(results))
                    rates[f"c={c}"][f"{mode} throughput"].append(summary["output_throughput"])
                    bs._progress(f"c={c} round {round_ + 1} {mode}: done")
    return rates


def report(rates: dict[str, dict[str, list[float]]], args: argparse.Namespace) -> None:
    print("# bench_structured\n")
    print(bs.machine_line())
    print(
        f"model {args.model or 'default'} {args.dtype}; greedy; {args.rounds} round(s), "
        f"medians; constrained: response_format json_schema over "
        f"{len(SCHEMAS[: args.schemas])} schemas\n"
    )
    print(
        "| c | unconstrained decode tok/s | constrained decode tok/s | ratio | "
        "unconstrained output tok/s | constrained output tok/s | ratio |"
    )
    print("|---|---|---|---|---|---|---|")
    for c, r in rates.items():
        m = {k: statistics.median(v) for k, v in r.items()}
        cells = [c]
        for kind in ("decode", "throughput"):
            free, held = m[f"unconstrained {kind}"], m[f"constrained {kind}"]
            cells += [f"{free:.1f}", f"{held:.1f}", f"{held / free:.2f}x" if free else "-"]
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default=None)
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--server-arg", action="append", default=[])
    p.add_argument("--startup-timeout", type=float, default=180.0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--concurrency", type=bs._ints, default="1,16")
    p.add_argument("--requests-per-concurrency", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=256, help="for the constrained warm-up")
    p.add_argument("--schemas", type=int, default=len(SCHEMAS), help="the first N test schemas")
    args = p.parse_args()
    with bs.launched_server(args, "continuous") as base_url:
        rates = asyncio.run(bench(base_url, args))
    report(rates, args)


if __name__ == "__main__":
    main()
