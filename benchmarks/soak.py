"""A soak: ``infer serve`` under steady streaming load for a while; does its memory stay flat?

Starts ``infer serve`` (no flags but ``--host 127.0.0.1 --port P``; ``--server-arg`` adds
some) and keeps ``--clients`` streaming clients busy for ``--duration-min`` minutes: each
sends a streamed ``/v1/chat/completions`` (a short prompt of random words, temperature 0.8,
``max_tokens`` ``--tokens`` forced with ``ignore_eos``) and sends the next as soon as it
ends. ``--leave-fraction`` of the requests (10 %) leave early: the client closes the
stream after a random number of tokens (the server aborts them).

Every ``--sample-s`` seconds (30) it samples the server's resident memory (psutil: the
RSS of the server's whole process tree) and its open file descriptors, and reads
``/metrics``' prompt and generated token counters: a row per sample.

The KV pool is allocated untouched (two tensors, keys and values, of half its bytes each;
the size from the server's ``KV cache`` start-up line) and its pages become resident as
blocks are first written. Empty blocks are handed out before cached ones are evicted, so
RSS rises until the tokens run reach the pool's positions once (``pool passes``: tokens
run / the pool's positions); on a slow machine that takes longer than 5 minutes. So each
row also gives the pool's resident part (``/proc/PID/smaps``: the anonymous mappings of the
pool's two tensors) and the RSS outside it, which is what must stay flat.

It reports requests sent, completed (every token, ``[DONE]``), left early (by design) and
lost (an error, a stream cut short, fewer tokens than asked), RSS at minute 5 and at the
end and their ratio, the same for the RSS outside the pool. The server is always stopped.
Usage:

    .venv/bin/python benchmarks/soak.py                        # 48 clients, 30 minutes
        [--clients 48] [--duration-min 30] [--tokens 128] [--leave-fraction 0.1]
        [--sample-s 30] [--server-arg=--kv-cache-memory=256MiB] [--json PATH]
        [--server-env LRU_CACHE_CAPACITY=1024]
    .venv/bin/python benchmarks/soak.py --clients 4 --duration-min 2   # smoke
"""

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from benchmarks import bench_serving as bs  # noqa: E402

WORDS = [
    *("river", "mountain", "quiet", "engine", "lantern", "copper", "garden", "signal"),
    *("window", "orbit", "harbor", "paper", "violet", "thunder", "meadow", "circuit"),
    *("pocket", "marble", "falcon", "silver", "canyon", "ribbon", "puzzle", "anchor"),
    *("velvet", "glacier", "compass", "ember", "willow", "crystal", "saddle", "beacon"),
]
TOPICS = ("a short story about", "a poem on", "an explanation of", "a list of facts about")
MINUTE_S = 60.0
REFERENCE_MIN = 5.0  # the sample RSS is compared with at the end


@dataclass
class Tally:
    sent: int = 0
    completed: int = 0
    left_early: int = 0
    lost: int = 0
    errors: dict[str, int] = field(default_factory=dict)

    def lose(self, why: str) -> None:
        self.lost += 1
        key = why[:120]
        self.errors[key] = self.errors.get(key, 0) + 1


@dataclass(frozen=True)
class Sample:
    t_s: float
    rss_bytes: int
    pool_rss_bytes: int | None  # the KV pool's resident part (None: not found)
    fds: int
    processes: int
    tokens_run: int | None  # prompt + generated tokens the engine ran (from /metrics)
    sent: int
    completed: int
    lost: int


def tree_memory(pid: int) -> tuple[int, int, int]:
    """(RSS bytes, open fds, processes) of ``pid`` and its descendants."""
    root = psutil.Process(pid)
    rss = fds = count = 0
    for proc in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            rss += proc.memory_info().rss
            fds += proc.num_fds()
            count += 1
    return rss, fds, count


def pool_resident(pid: int, pool_bytes: int | None) -> int | None:
    """Resident bytes of the KV pool's two tensors in process ``pid`` (see
    :func:`pool_resident_in`)."""
    if not pool_bytes:
        return None
    try:
        return pool_resident_in(Path(f"/proc/{pid}/smaps").read_text(), pool_bytes)
    except OSError:
        return None


def pool_resident_in(smaps: str, pool_bytes: int) -> int | None:
    """Resident bytes of the anonymous mappings of at least about half ``pool_bytes`` in a
    ``/proc/PID/smaps`` text: the KV pool's keys and values (the kernel may merge the two
    mappings; nothing else in the server is that large). None where none is found."""
    half, slack = pool_bytes // 2, max(pool_bytes // 200, 1 << 22)
    resident, found, size, anonymous = 0, 0, 0, False
    for line in smaps.splitlines():
        fields = line.split()
        if not fields:
            continue
        if "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header
            anonymous = len(fields) < 6 or fields[5].startswith("[anon")
        elif fields[0] == "Size:":
            size = int(fields[1]) * 1024
        elif fields[0] == "Rss:" and anonymous and size >= half - slack:
            resident += int(fields[1]) * 1024
            found += 1
    return resident if found else None


def prompt_text(rng: random.Random) -> str:
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 24)))
    return f"Write {rng.choice(TOPICS)} {words}."


def metric_total(text: str, name: str) -> float | None:
    """The sum of a counter's samples in a Prometheus exposition (``name`` without
    ``_total``)."""
    total, seen = 0.0, False
    pattern = re.compile(rf"^{re.escape(name)}(?:_total)?(?:\{{[^}}]*\}})? ([0-9.eE+-]+)$")
    for line in text.splitlines():
        if match := pattern.match(line):
            total += float(match.group(1))
            seen = True
    return total if seen else None


def kv_field(log: Path, name: str) -> float | None:
    """A field of the server's ``KV cache`` start-up line (JSON or key=value)."""
    with contextlib.suppress(OSError):
        for line in log.read_text(errors="replace").splitlines():
            match = re.search(rf"\"?{name}\"?[=:]\s*([\d.]+)", line)
            if "KV cache" in line and match:
                return float(match.group(1))
    return None


def kv_line(log: Path) -> str:
    with contextlib.suppress(OSError):
        for line in log.read_text(errors="replace").splitlines():
            if "KV cache" in line:
                return line.strip()
    return "(no KV cache line in the server log)"


def rss_at(samples: list[Sample], minute: float) -> Sample | None:
    """The first sample at or after ``minute`` (None: the run was shorter)."""
    return next((s for s in samples if s.t_s >= minute * MINUTE_S), None)


async def client_loop(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    args: argparse.Namespace,
    rng: random.Random,
    tally: Tally,
    deadline: float,
) -> None:
    while time.monotonic() < deadline:
        leave_after = (
            rng.randint(1, max(1, args.tokens - 1)) if rng.random() < args.leave_fraction else None
        )
        body = {
            "model": model,
            "messages": [{"role": "user", "content": prompt_text(rng)}],
            "max_tokens": args.tokens,
            "temperature": 0.8,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }
        tally.sent += 1
        await one_request(client, url, body, args.tokens, leave_after, tally)


async def one_request(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    tokens: int,
    leave_after: int | None,
    tally: Tally,
) -> None:
    chunks, usage, done = 0, None, False
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                tally.lose(f"HTTP {response.status_code}: {text[:80]}")
                return
            async for line in bs.sse_lines(response.aiter_bytes()):
                event = bs.parse_sse_line(line)
                if event is None:
                    continue
                if event.kind == "error":
                    tally.lose(f"error chunk: {event.message}")
                    return
                if event.kind == "token":
                    chunks += 1
                    if leave_after is not None and chunks >= leave_after:
                        tally.left_early += 1
                        return  # closing the stream: the client is gone
                if event.completion_tokens is not None:
                    usage = event.completion_tokens
                if event.kind == "done":
                    done = True
                    break
    except httpx.HTTPError as e:
        tally.lose(f"{type(e).__name__}: {e}")
        return
    if not done:
        tally.lose("stream ended without [DONE]")
    elif usage != tokens:
        tally.lose(f"usage.completion_tokens {usage}, asked {tokens}")
    else:
        tally.completed += 1


async def sampler(
    pid: int,
    base_url: str,
    client: httpx.AsyncClient,
    tally: Tally,
    samples: list[Sample],
    start: float,
    deadline: float,
    every_s: float,
    pool: int | None,
    pool_bytes: int | None,
) -> None:
    while True:
        rss, fds, count = tree_memory(pid)
        pool_rss = pool_resident(pid, pool_bytes)
        tokens = None
        with contextlib.suppress(httpx.HTTPError):
            text = (await client.get(f"{base_url}/metrics", timeout=30.0)).text
            prompt = metric_total(text, "infer:prompt_tokens")
            generated = metric_total(text, "infer:generation_tokens")
            if prompt is not None and generated is not None:
                tokens = int(prompt + generated)
        sample = Sample(
            time.monotonic() - start,
            rss,
            pool_rss,
            fds,
            count,
            tokens,
            tally.sent,
            tally.completed,
            tally.lost,
        )
        samples.append(sample)
        print(row(sample, pool), flush=True)
        if time.monotonic() >= deadline:
            return
        await asyncio.sleep(min(every_s, max(0.0, deadline - time.monotonic())))


def row(s: Sample, pool: int | None) -> str:
    passes = f"{s.tokens_run / pool:.2f}" if s.tokens_run is not None and pool else "?"
    in_pool = "?" if s.pool_rss_bytes is None else f"{s.pool_rss_bytes / 2**20:.0f}"
    outside = "?" if s.pool_rss_bytes is None else f"{outside_pool(s) / 2**20:.0f}"
    return (
        f"| {s.t_s / MINUTE_S:5.1f} | {s.rss_bytes / 2**20:6.0f} | {in_pool:>6} | {outside:>6} | "
        f"{s.fds:4d} | {passes:>5} | {s.sent:6d} | {s.completed:6d} | {s.lost:4d} |"
    )


def outside_pool(s: Sample) -> int:
    return s.rss_bytes - (s.pool_rss_bytes or 0)


HEADER = (
    "| minute | RSS (MiB) | KV pool resident | RSS outside the pool | fds | pool passes | "
    "sent | completed | lost |\n"
    "|---|---|---|---|---|---|---|---|---|"
)


async def soak(args: argparse.Namespace, base_url: str, pid: int, log: Path) -> dict[str, Any]:
    tokens, mib = kv_field(log, "tokens"), kv_field(log, "memory_mib")
    pool = int(tokens) if tokens else None
    pool_bytes = int(mib * 2**20) if mib else None
    print(kv_line(log), flush=True)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(300.0, connect=30.0)
    tally, samples = Tally(), list[Sample]()
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        model = await bs._first_model_id(client, base_url)
        url = f"{base_url}/v1/chat/completions"
        start = time.monotonic()
        deadline = start + args.duration_min * MINUTE_S
        print(HEADER, flush=True)
        rngs = [random.Random(args.seed * 1000 + i) for i in range(args.clients)]
        clients = [
            asyncio.create_task(client_loop(client, url, model, args, rng, tally, deadline))
            for rng in rngs
        ]
        await sampler(
            pid, base_url, client, tally, samples, start, deadline, args.sample_s, pool, pool_bytes
        )
        await asyncio.gather(*clients)  # each ends its request under way
        rss, fds, count = tree_memory(pid)
        samples.append(
            Sample(
                time.monotonic() - start,
                rss,
                pool_resident(pid, pool_bytes),
                fds,
                count,
                None,
                tally.sent,
                tally.completed,
                tally.lost,
            )
        )
        print(row(samples[-1], pool) + " (after the last requests)", flush=True)
    return summary(args, tally, samples, pool)


def summary(
    args: argparse.Namespace, tally: Tally, samples: list[Sample], pool: int | None
) -> dict[str, Any]:
    reference = rss_at(samples, REFERENCE_MIN)
    end = samples[-1] if samples else None
    ratio = (
        end.rss_bytes / reference.rss_bytes if reference is not None and end is not None else None
    )
    known = (
        reference is not None
        and end is not None
        and reference.pool_rss_bytes is not None
        and end.pool_rss_bytes is not None
    )
    return {
        "clients": args.clients,
        "duration_min": args.duration_min,
        "tokens": args.tokens,
        "leave_fraction": args.leave_fraction,
        "server_args": args.server_arg,
        "pool_tokens": pool,
        "tally": asdict(tally),
        "rss_min5_mib": reference.rss_bytes / 2**20 if reference else None,
        "rss_end_mib": end.rss_bytes / 2**20 if end else None,
        "end_over_min5": ratio,
        "outside_pool_min5_mib": outside_pool(reference) / 2**20 if known and reference else None,
        "outside_pool_end_mib": outside_pool(end) / 2**20 if known and end else None,
        "server_env": args.server_env,
        "samples": [asdict(s) for s in samples],
    }


def report(result: dict[str, Any]) -> str:
    tally = result["tally"]
    lines = [
        f"requests: {tally['sent']} sent, {tally['completed']} completed, "
        f"{tally['left_early']} left early (by design), {tally['lost']} lost",
    ]
    for why, count in sorted(tally["errors"].items(), key=lambda kv: -kv[1]):
        lines.append(f"  lost: {count} x {why}")
    five, end, ratio = result["rss_min5_mib"], result["rss_end_mib"], result["end_over_min5"]
    if five is not None and end is not None and ratio is not None:
        verdict = "within" if abs(ratio - 1.0) <= 0.05 else "NOT within"
        lines.append(
            f"RSS: {five:.0f} MiB at minute {REFERENCE_MIN:g}, {end:.0f} MiB at the end "
            f"({result['duration_min']:g} min): {ratio:.3f}x, {verdict} 5 %"
        )
    else:
        at_end = "?" if end is None else f"{end:.0f}"
        lines.append(
            f"RSS at the end: {at_end} MiB (the run was shorter than {REFERENCE_MIN:g} min)"
        )
    five, end = result["outside_pool_min5_mib"], result["outside_pool_end_mib"]
    if five is not None and end is not None:
        lines.append(
            f"RSS outside the KV pool: {five:.0f} MiB at minute {REFERENCE_MIN:g}, {end:.0f} MiB "
            f"at the end: {end / five:.3f}x"
        )
    return "\n".join(lines)


def main() -> None:
    args = _args()
    print(bs.machine_line(), flush=True)
    print(
        f"soak: {args.clients} clients, {args.duration_min:g} min, {args.tokens} tokens forced, "
        f"{args.leave_fraction:.0%} leaving early, server flags: {args.server_arg or 'none'}"
        + (f", server environment: {' '.join(args.server_env)}" if args.server_env else ""),
        flush=True,
    )
    env = {**os.environ, **dict(item.split("=", 1) for item in args.server_env)}
    with bs.serve_process(args.server_arg, "soak", args.startup_timeout, env=env) as (
        base_url,
        proc,
    ):
        log = _server_log(proc)
        result = asyncio.run(soak(args, base_url, proc.pid, log))
    print(report(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


def _server_log(proc: subprocess.Popen[bytes]) -> Path:
    """The log file ``serve_process`` opened for ``proc``'s output."""
    for path in Path(f"/proc/{proc.pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = Path(path.readlink())
            if target.name.startswith("bench_serving_soak_"):
                return target
    return Path("/dev/null")


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--clients", type=int, default=48)
    p.add_argument("--duration-min", type=float, default=30.0)
    p.add_argument("--tokens", type=int, default=128, help="forced output tokens per request")
    p.add_argument("--leave-fraction", type=float, default=0.1)
    p.add_argument("--sample-s", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="a flag for infer serve (repeat; --server-arg=--kv-cache-memory=256MiB)",
    )
    p.add_argument(
        "--server-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an environment variable for the server (repeat)",
    )
    p.add_argument("--json", help="write the samples and summary here")
    args = p.parse_args(argv)
    if args.clients < 1 or args.duration_min <= 0 or args.sample_s <= 0:
        p.error("--clients >= 1, --duration-min > 0, --sample-s > 0")
    if not 0.0 <= args.leave_fraction <= 1.0:
        p.error("--leave-fraction in [0, 1]")
    if any("=" not in item for item in args.server_env):
        p.error("--server-env NAME=VALUE")
    return args


if __name__ == "__main__":
    main()
