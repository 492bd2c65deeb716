"""``infer serve --replicas 2`` on this machine: what issue 30 asks to measure.

1. **Routing** — a shared-prefix workload (8 long system prompts, many users, each request
   one prompt plus a short question) against two replicas, once per ``--routing`` policy
   (prefix, pow2): TTFT p50/p99 and the cached-prefix fraction (prompt tokens the
   replicas found in their prefix caches, from ``/admin/replicas``). Each replica's KV pool
   is sized (``--num-kv-blocks``) to hold about 5 of the 8 system prompts: the fleet's
   working set fits the fleet only when each replica keeps its own part — the condition
   prefix routing exists for (with pools that hold every prompt, any policy caches them
   all after the first misses).
2. **Overhead** — one short request at a time (1 prompt token out), the single process
   (``infer serve``) against the fleet (``--replicas 1``), same flags: the p50 latency
   difference is the ingress + deployment-handle hop.
3. **Failover** — requests under load while one replica is killed (``kill -9``): how many
   completed, ended with an error (a stream cut mid-way: the client is told), were lost
   (neither an answer nor an error) or hung (no end within the deadline).
4. **Breaker** — one replica made to fail every call (``INFER_FAULT_INJECTION=1``, the
   fault hook) under 4 clients: calls answered and lost, how long until its circuit
   breaker opened, and, the fault ended, how long until the probe closed it (defaults).

On a 2-core machine each replica has one thread (``--threads 1``): this shows routing and
correctness, not scaling (``benchmarks/sim_router.py`` simulates fleets of 8-256).

    python benchmarks/bench_replicas.py [--requests 64] [--concurrency 4] [--only routing]
"""

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import httpx  # noqa: E402

from benchmarks.bench_serving import machine_line, serve_process  # noqa: E402

WORDS = [
    "bakery",
    "customer",
    "order",
    "delivery",
    "invoice",
    "refund",
    "policy",
    "warranty",
    "shipping",
    "return",
    "account",
    "password",
    "discount",
    "holiday",
    "schedule",
    "manager",
    "pastry",
    "bread",
    "cake",
    "flour",
    "oven",
    "allergy",
    "gluten",
    "vegan",
    "sugar",
    "payment",
    "card",
    "receipt",
    "address",
    "weekend",
    "morning",
    "evening",
]


def system_prompts(count: int, words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [
        f"You are assistant number {i}. Follow these notes: "
        + " ".join(rng.choice(WORDS) for _ in range(words))
        for i in range(count)
    ]


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


async def timed_completion(
    client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int
) -> dict[str, Any]:
    """One streamed completion of exactly ``max_tokens`` (EOS ignored): its TTFT, total
    latency, replica, and how it ended."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
    }
    start = time.perf_counter()
    first: float | None = None
    ended = "lost"
    replica = None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        replica = response.headers.get("x-infer-replica")
        if response.status_code != 200:
            await response.aread()
            return {"ended": f"http {response.status_code}", "replica": replica}
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                ended = "ok" if ended == "lost" else ended
                break
            event = json.loads(data)
            if "error" in event:
                ended = "error"
                break
            if first is None and event["choices"][0].get("text"):
                first = time.perf_counter()
    end = time.perf_counter()
    return {
        "ended": ended,
        "ttft": None if first is None else first - start,
        "latency": end - start,
        "replica": replica,
    }


async def admin(client: httpx.AsyncClient, url: str) -> list[dict[str, Any]]:
    return list((await client.get(f"{url}/admin/replicas")).json()["data"])


async def model_of(client: httpx.AsyncClient, url: str) -> str:
    return str((await client.get(f"{url}/v1/models")).json()["data"][0]["id"])


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def routing_run(url: str, args: argparse.Namespace) -> dict[str, Any]:
    prompts = system_prompts(args.prompts, args.prompt_words)
    rng = random.Random(1)
    async with httpx.AsyncClient(timeout=300) as client:
        model = await model_of(client, url)
        before = {r["id"]: r for r in await admin(client, url)}
        queue = [
            f"{prompts[rng.randrange(len(prompts))]}\nUser {i}: question {rng.randrange(10**6)}?"
            for i in range(args.requests)
        ]
        results: list[dict[str, Any]] = []
        gate = asyncio.Semaphore(args.concurrency)

        async def one(prompt: str) -> None:
            async with gate:
                results.append(await timed_completion(client, url, model, prompt, 4))

        start = time.perf_counter()
        await asyncio.gather(*(one(p) for p in queue))
        duration = time.perf_counter() - start
        await asyncio.sleep(2.5)  # the replicas' next load reports
        after = await admin(client, url)
    queried = sum(
        r["prefix_queried_tokens"] - before.get(r["id"], {}).get("prefix_queried_tokens", 0)
        for r in after
    )
    hit = sum(
        r["prefix_hit_tokens"] - before.get(r["id"], {}).get("prefix_hit_tokens", 0) for r in after
    )
    ttfts = [r["ttft"] for r in results if r.get("ttft") is not None]
    per_replica: dict[str, int] = {}
    for r in results:
        per_replica[str(r["replica"])] = per_replica.get(str(r["replica"]), 0) + 1
    return {
        "requests": len(results),
        "ok": sum(r["ended"] == "ok" for r in results),
        "ttft_p50_ms": 1000 * (pct(ttfts, 0.5) or 0),
        "ttft_p99_ms": 1000 * (pct(ttfts, 0.99) or 0),
        "cached_fraction": hit / queried if queried else 0.0,
        "duration_s": duration,
        "per_replica": per_replica,
    }


async def overhead_run(url: str, count: int) -> list[float]:
    async with httpx.AsyncClient(timeout=120) as client:
        model = await model_of(client, url)
        latencies = []
        for i in range(count + 5):
            body = {"model": model, "prompt": f"Hello {i % 7}", "max_tokens": 1}
            start = time.perf_counter()
            response = await client.post(f"{url}/v1/completions", json=body)
            response.raise_for_status()
            if i >= 5:  # warm-up
                latencies.append(time.perf_counter() - start)
        return latencies


async def failover_run(url: str, requests: int, deadline_s: float) -> dict[str, int]:
    async with httpx.AsyncClient(timeout=deadline_s) as client:
        model = await model_of(client, url)
        prompts = [f"Tell a long story about the number {i}." for i in range(requests)]
        tasks = [asyncio.create_task(timed_completion(client, url, model, p, 64)) for p in prompts]
        await asyncio.sleep(3)
        victim = max(await admin(client, url), key=lambda r: r["running"] + r["waiting"])
        busy = victim["running"] + victim["waiting"]
        _progress(f"failover: kill -9 of replica {victim['id']} ({busy} requests on it)")
        os.kill(victim["pid"], signal.SIGKILL)
        done, hung = await asyncio.wait(tasks, timeout=deadline_s)
        for task in hung:
            task.cancel()
        ended = [t.result()["ended"] if not t.exception() else "error" for t in done]
    return {
        "requests": requests,
        "on_the_killed_replica": busy,
        "ok": ended.count("ok"),
        "ended_with_error": sum(e not in ("ok", "lost") for e in ended),
        "lost": ended.count("lost"),
        "hung": len(hung),
    }


async def breaker_run(url: str, concurrency: int = 4, calls: int = 40) -> dict[str, Any]:
    """One replica made to fail every call (the fault hook) under ``concurrency`` clients:
    the calls its engine failed (each run again on the other), how long until its breaker
    opened, the calls answered and lost; then, the fault ended, how long until the probe
    closed it (the default flags: 5 failures in a row open it, 30 s cool-down)."""
    async with httpx.AsyncClient(timeout=120) as client:
        model = await model_of(client, url)
        bad = (await admin(client, url))[0]["id"]
        await client.post(f"{url}/admin/replicas/{bad}/fault", json={"fail": True})
        faulted = time.perf_counter()
        opened: float | None = None
        answered = lost = 0
        gate = asyncio.Semaphore(concurrency)

        async def one(i: int) -> None:
            nonlocal answered, lost, opened
            async with gate:
                body = {"model": model, "prompt": f"call {i}: the weather is", "max_tokens": 4}
                reply = await client.post(f"{url}/v1/completions", json=body)
                if reply.status_code == 200:
                    answered += 1
                else:
                    lost += 1
                if opened is None:
                    rows = {r["id"]: r for r in await admin(client, url)}
                    if rows.get(bad, {}).get("breaker") != "closed":
                        opened = time.perf_counter()

        await asyncio.gather(*(one(i) for i in range(calls)))
        await client.post(f"{url}/admin/replicas/{bad}/fault", json={"fail": False})
        healed = time.perf_counter()
        closed: float | None = None
        while time.perf_counter() - healed < 120:
            rows = {r["id"]: r for r in await admin(client, url)}
            if rows.get(bad, {}).get("breaker") == "closed":
                closed = time.perf_counter()
                break
            await asyncio.sleep(0.5)
        metrics = (await client.get(f"{url}/metrics")).text
    opens = [
        line
        for line in metrics.splitlines()
        if line.startswith("infer:replica_breaker_opens_total") and f'replica_id="{bad}"' in line
    ]
    return {
        "calls": calls,
        "answered": answered,
        "lost": lost,
        "open_after_s": None if opened is None else round(opened - faulted, 3),
        "closed_after_fault_ended_s": None if closed is None else round(closed - healed, 3),
        "opens_metric": opens,
    }


def prompt_tokens(args: argparse.Namespace) -> int:
    """The longest system prompt's tokens, by the served (default) model's tokenizer."""
    from adapters.weights.factory import resolve
    from entrypoints.backends import model_tokenizer

    tokenizer = model_tokenizer(resolve(None, None, False))
    return max(len(tokenizer.encode(p)) for p in system_prompts(args.prompts, args.prompt_words))


def fleet_flags(args: argparse.Namespace, replicas: int, routing: str | None = None) -> list[str]:
    flags = ["--threads", "1", "--replicas", str(replicas)]
    return flags + (["--routing", routing] if routing else [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=8, help="system prompts")
    parser.add_argument("--prompt-words", type=int, default=400, help="words per prompt")
    parser.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="KV blocks per replica (default: 5 system prompts' worth, plus room to run)",
    )
    parser.add_argument("--overhead-requests", type=int, default=50)
    parser.add_argument("--only", choices=["routing", "overhead", "failover", "breaker"])
    parser.add_argument("--startup-timeout", type=float, default=600)
    parser.add_argument("--result-json", type=Path)
    args = parser.parse_args()
    result: dict[str, Any] = {"machine": machine_line()}
    _progress(result["machine"])

    if args.only in (None, "routing"):
        # 5 system prompts' worth of 16-token blocks (a replica caches its half of the 8,
        # with room for one more running) and each running request's own question.
        prompt_blocks = -(-prompt_tokens(args) // 16)
        blocks = args.num_kv_blocks or 5 * prompt_blocks + 2 * args.concurrency
        result["routing"] = {"num_kv_blocks_per_replica": blocks}
        for routing in ("prefix", "pow2"):
            flags = [*fleet_flags(args, 2, routing), "--num-kv-blocks", str(blocks)]
            with serve_process(flags, f"fleet_{routing}", args.startup_timeout) as (url, _):
                result["routing"][routing] = asyncio.run(routing_run(url, args))
            _progress(f"{routing}: {result['routing'][routing]}")
        prefix, pow2 = result["routing"]["prefix"], result["routing"]["pow2"]
        result["routing"]["ttft_p50_ratio_pow2_over_prefix"] = (
            pow2["ttft_p50_ms"] / prefix["ttft_p50_ms"] if prefix["ttft_p50_ms"] else None
        )
        result["routing"]["cached_fraction_ratio"] = (
            prefix["cached_fraction"] / pow2["cached_fraction"] if pow2["cached_fraction"] else None
        )

    if args.only in (None, "overhead"):
        runs = {}
        for label, flags in (("single", ["--threads", "1"]), ("fleet", fleet_flags(args, 1))):
            with serve_process(flags, f"overhead_{label}", args.startup_timeout) as (url, _):
                runs[label] = asyncio.run(overhead_run(url, args.overhead_requests))
        single, fleet = statistics.median(runs["single"]), statistics.median(runs["fleet"])
        result["overhead"] = {
            "single_p50_ms": 1000 * single,
            "fleet_p50_ms": 1000 * fleet,
            "added_p50_ms": 1000 * (fleet - single),
            "single_p90_ms": 1000 * (pct(runs["single"], 0.9) or 0),
            "fleet_p90_ms": 1000 * (pct(runs["fleet"], 0.9) or 0),
        }
        _progress(f"overhead: {result['overhead']}")

    if args.only in (None, "failover"):
        with serve_process(fleet_flags(args, 2), "failover", args.startup_timeout) as (url, _):
            result["failover"] = asyncio.run(failover_run(url, 24, 180))
        _progress(f"failover: {result['failover']}")

    if args.only in (None, "breaker"):
        env = {**os.environ, "INFER_FAULT_INJECTION": "1"}
        flags = fleet_flags(args, 2)
        with serve_process(flags, "breaker", args.startup_timeout, env=env) as (url, _):
            result["breaker"] = asyncio.run(breaker_run(url))
        _progress(f"breaker: {result['breaker']}")

    text = json.dumps(result, indent=2)
    print(text)
    if args.result_json:
        args.result_json.write_text(text)


if __name__ == "__main__":
    main()
