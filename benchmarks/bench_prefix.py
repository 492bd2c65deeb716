"""Paged KV cache vs the contiguous-slot cache: prefix caching TTFT, concurrency within a
fixed KV budget, server memory. One run, side by side, a markdown table per part.

Part 1, prefix caching TTFT (``infer serve`` of this tree, launched twice: prefix caching on,
then ``--no-prefix-caching``). Every request is the same system prompt (``--system-len``
random token ids, default 1,500) followed by a question of its own (``--question-len``
random ids, default 50), streamed through ``POST /v1/completions`` (greedy, EOS ignored,
``--max-tokens`` 16). First one warm-up request (the system prompt and a question of its
own, alone): it computes the prefix in both modes and warms the process; its TTFT is
reported on its own row, not in the statistics. Then ``--requests`` (32) requests, at most
``--concurrency`` (8) in flight: TTFT p50 / p90 / p99, total time, and the prefix cache's
hit rate over those requests (``infer:prefix_cache_hits_total`` /
``infer:prefix_cache_queries_total`` from ``/metrics``, scraped after the warm-up and at the
end). Servers run with their defaults but ``--dtype`` (float32 by default) and
``--server-arg``; 127.0.0.1, free ports.

Part 2, concurrency within one KV memory budget (the engine in a subprocess per tree, no
HTTP). The budget is ``--p2-slots`` (8) contiguous slots of ``--p2-max-seq-len`` (2048)
positions: the contiguous tree (``--contiguous-tree``, a checkout of 812e5b4, the last
commit with the contiguous-slot cache) runs ``max_batch_size = slots`` (each running request
holds a whole slot); this tree runs ``num_kv_blocks = slots * max_seq_len / block size``
(the same bytes) and ``max_batch_size`` ``--p2-max-batch-size`` (256), so free blocks decide
admission. Both get the same ``--p2-requests`` (64) requests, queued at once: prompt lengths
in ``--p2-prompt-len`` (100,600), outputs in ``--p2-output-len`` (32,128: the contiguous
side runs ``sum(outputs) / slots`` decode steps at least, so longer outputs cost minutes on
a small CPU; ``64,256`` is the issue's shape), random ids from ``--seed`` (a hash of them is
printed for both sides), greedy, EOS ignored. Reported: the peak and the mean (over steps)
of requests running after each step (``StepStats.scheduler``), preemptions, output tok/s,
the KV bytes each runner allocated. One warm-up request runs first. ``--p2-runner fake``
swaps the model for the fake runner (no model: concurrency only, tok/s is then the
scheduler's overhead).

Part 3, resident memory of the server process (``VmRSS`` / ``VmHWM`` from
``/proc/PID/status``): idle after startup (before any request), the peak during part 1's
load (``VmHWM``, also sampled every 50 ms), and after the load; for this tree's server with
prefix caching on (part 1's run, or one more) and for the contiguous tree's server on the
same load (skip it with ``--no-contiguous-server``; its TTFT then joins part 1's table).

Usage (from the repository root):

    .venv/bin/python benchmarks/bench_prefix.py                     # parts 1, 2, 3
        [--part 1,2,3] [--model SPEC] [--dtype float32] [--requests 32]
        [--concurrency 8] [--system-len 1500] [--question-len 50] [--max-tokens 16]
        [--p2-requests 64] [--p2-slots 8] [--p2-runner torch|fake]
        [--contiguous-tree /tmp/base] [--no-contiguous-server] [--result-json PATH]
    .venv/bin/python benchmarks/bench_prefix.py --part 1 --requests 8   # smoke run
    .venv/bin/python benchmarks/bench_prefix.py --part 2 --p2-requests 16 --p2-slots 2 \\
        --p2-output-len 16,32                                       # smoke run
"""

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from benchmarks import bench_serving as bs  # noqa: E402

PERCENTILES = (50, 90, 99)
PARTS = {"1", "2", "3"}
ON, OFF, CONTIGUOUS = "paged, prefix caching", "paged, no prefix caching", "contiguous (main)"
METRIC = re.compile(r"^infer:prefix_cache_(queries|hits)_total(?:\{[^}]*\})?\s+(\S+)", re.M)
MIB = 1 << 20

# ---------------------------------------------------------------------------- parts 1 and 3


@dataclass
class ServerRun:
    """One launched server: its load's results and its process's memory (bytes)."""

    label: str
    warmup: bs.RequestResult | None = None
    results: list[bs.RequestResult] = field(default_factory=list)
    duration_s: float = 0.0
    prefix: dict[str, float] | None = None  # queries / hits over the measured requests
    rss_idle: int | None = None
    rss_peak_sampled: int | None = None
    hwm: int | None = None  # VmHWM after the load: the peak since the process started
    rss_after: int | None = None
    error: str | None = None


def part1_prompts(args: argparse.Namespace, vocab_size: int) -> tuple[list[int], list[list[int]]]:
    """The shared system prompt, then one question per request (the warm-up's first)."""
    system = bs.random_prompt(random.Random(f"{args.seed}-system"), args.system_len, vocab_size)
    rng = random.Random(f"{args.seed}-questions")
    questions = [
        bs.random_prompt(rng, args.question_len, vocab_size) for _ in range(args.requests + 1)
    ]
    return system, questions


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of a process, in bytes (empty once it is gone)."""
    out = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


class RSSSampler:
    """The largest VmRSS of a process seen every ``interval`` seconds, on a thread."""

    def __init__(self, pid: int, interval: float = 0.05) -> None:
        self.pid, self.interval, self.peak = pid, interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "RSSSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, proc_status(self.pid).get("VmRSS", 0))
            self._stop.wait(self.interval)


async def prefix_counters(client: httpx.AsyncClient, base_url: str) -> dict[str, float] | None:
    """``infer:prefix_cache_{queries,hits}_total`` from /metrics (None: not exposed)."""
    with contextlib.suppress(httpx.HTTPError):
        response = await client.get(f"{base_url}/metrics")
        if response.status_code == 200:
            found = {name: float(value) for name, value in METRIC.findall(response.text)}
            if found:
                return {"queries": found.get("queries", 0.0), "hits": found.get("hits", 0.0)}
    return None


async def run_load(
    run: ServerRun,
    base_url: str,
    args: argparse.Namespace,
    system: list[int],
    questions: list[list[int]],
) -> None:
    """The warm-up request alone, then the measured ones ``--concurrency`` at a time."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        model = await bs._first_model_id(client, base_url)
        url = f"{base_url}/v1/completions"
        specs = [bs.RequestSpec(system + q, args.max_tokens) for q in questions]
        warm = bs.Workload(bs.WARMUP, "", specs[:1], 1, False)
        [run.warmup] = await bs.run_requests(client, url, model, warm, run.label)
        before = await prefix_counters(client, base_url)
        load = bs.Workload("shared prefix", "", specs[1:], args.concurrency, False)
        run.results = await bs.run_requests(client, url, model, load, run.label)
        run.duration_s = bs.span(run.results)
        after = await prefix_counters(client, base_url)
        if before is not None and after is not None:
            run.prefix = {k: after[k] - before[k] for k in after}


def serve_and_load(
    label: str,
    tree: Path,
    serve_args: list[str],
    args: argparse.Namespace,
    prompts: tuple[list[int], list[list[int]]],
) -> ServerRun:
    """Launch ``infer serve`` of ``tree``, note its idle memory, run the load, note the peak."""
    run = ServerRun(label)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    try:
        with bs.serve_process(serve_args, _slug(label), args.startup_timeout, tree, env) as (
            base_url,
            proc,
        ):
            time.sleep(args.settle)
            run.rss_idle = proc_status(proc.pid).get("VmRSS")
            with RSSSampler(proc.pid) as sampler:
                coro = run_load(run, base_url, args, *prompts)
                asyncio.run(asyncio.wait_for(coro, args.load_timeout))
            status = proc_status(proc.pid)
            run.rss_peak_sampled = sampler.peak or None
            run.hwm, run.rss_after = status.get("VmHWM"), status.get("VmRSS")
    except (RuntimeError, TimeoutError) as e:
        run.error = f"{type(e).__name__}: {e}"
        bs._progress(f"[{label}] failed: {run.error}")
    return run


def _slug(label: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", label.lower()).strip("_")


def _percentiles(values_s: list[float]) -> dict[str, float | None]:
    ms = np.asarray(values_s, dtype=np.float64) * 1e3
    if not len(ms):
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    return {"mean": float(ms.mean()), **{f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES}}


def run_summary(run: ServerRun) -> dict[str, Any]:
    ok = [r for r in run.results if r.ok]
    prefix = run.prefix
    hit_rate = prefix["hits"] / prefix["queries"] if prefix and prefix["queries"] else None
    warm = run.warmup
    return {
        "label": run.label,
        "error": run.error,
        "requests": len(run.results),
        "completed": len(ok),
        "errors": sorted({r.error for r in run.results if r.error is not None}),
        "warmup_ttft_ms": warm.ttft * 1e3 if warm is not None and warm.ok else None,
        "ttft_ms": _percentiles([r.ttft for r in ok]),
        "e2el_ms": _percentiles([r.e2el for r in ok]),
        "duration_s": run.duration_s,
        "output_tokens": sum(r.num_output_tokens for r in ok),
        "prefix_cache": prefix,
        "prefix_hit_rate": hit_rate,
        "rss_idle": run.rss_idle,
        "rss_peak_sampled": run.rss_peak_sampled,
        "vm_hwm": run.hwm,
        "rss_after": run.rss_after,
    }


def _table_head(header: list[str]) -> list[str]:
    """A blank line after a table's title, then its markdown header row and rule."""
    return ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]


def part1_table(args: argparse.Namespace, runs: dict[str, dict[str, Any]]) -> tuple[str, str]:
    """The markdown table and the off/on TTFT p50 ratio."""
    names = [n for n in (ON, OFF, CONTIGUOUS) if n in runs]
    both = ON in runs and OFF in runs
    header = ["metric", *names] + (["no caching / caching"] if both else [])
    lines = [
        f"## 1. Prefix caching: {args.requests} requests sharing a {args.system_len}-token "
        f"system prompt, {args.question_len}-token questions, {args.max_tokens} tokens out, "
        f"{args.concurrency} in flight",
        *_table_head(header),
    ]

    def ttft(s: dict[str, Any], key: str) -> float | None:
        value: float | None = s["ttft_ms"][key]
        return value

    rows: list[tuple[str, Any]] = [
        ("requests ok / sent", lambda s: f"{s['completed']} / {s['requests']}"),
        ("warm-up TTFT, alone (ms; computes the prefix)", lambda s: _fmt(s["warmup_ttft_ms"], 0)),
        ("TTFT p50 (ms)", lambda s: _fmt(ttft(s, "p50"), 0)),
        ("TTFT p90 (ms)", lambda s: _fmt(ttft(s, "p90"), 0)),
        ("TTFT p99 (ms)", lambda s: _fmt(ttft(s, "p99"), 0)),
        ("TTFT mean (ms)", lambda s: _fmt(ttft(s, "mean"), 0)),
        ("E2E latency p50 (ms)", lambda s: _fmt(s["e2el_ms"]["p50"], 0)),
        ("total time (s)", lambda s: _fmt(s["duration_s"], 2)),
        ("prefix cache hit rate (prompt tokens)", _hit_rate),
    ]
    ratios = {
        "TTFT p50 (ms)": lambda a, b: _ratio(ttft(b, "p50"), ttft(a, "p50")),
        "TTFT p90 (ms)": lambda a, b: _ratio(ttft(b, "p90"), ttft(a, "p90")),
        "TTFT mean (ms)": lambda a, b: _ratio(ttft(b, "mean"), ttft(a, "mean")),
        "total time (s)": lambda a, b: _ratio(b["duration_s"], a["duration_s"]),
    }
    for label, cell in rows:
        cells = [label, *(cell(runs[n]) for n in names)]
        if both:
            ratio = ratios.get(label)
            cells.append(ratio(runs[ON], runs[OFF]) if ratio else "")
        lines.append("| " + " | ".join(cells) + " |")
    for n in names:
        if runs[n]["error"]:
            lines.append(f"\n{n}: {runs[n]['error']}")
        lines += [f"\n{n}: {e}" for e in runs[n]["errors"]]
    p50 = _ratio(ttft(runs[OFF], "p50"), ttft(runs[ON], "p50")) if both else "–"
    return "\n".join(lines), p50


def part3_table(runs: dict[str, dict[str, Any]]) -> str:
    lines = [
        "## 3. Server resident memory (MiB; part 1's load)",
        *_table_head(
            [
                "server",
                "idle after startup (VmRSS)",
                "peak under load (VmHWM)",
                "peak sampled (VmRSS, 50 ms)",
                "after the load (VmRSS)",
            ]
        ),
    ]
    for name, s in runs.items():
        cells = [_mib(s[k]) for k in ("rss_idle", "vm_hwm", "rss_peak_sampled", "rss_after")]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- part 2


def worker(spec_path: str) -> None:
    """Part 2 in this process, on the tree ``spec["tree"]`` (first on ``sys.path``): queue
    every request, step the engine until done, write the result next to the spec."""
    spec = json.loads(Path(spec_path).read_text())
    sys.path.insert(0, spec["tree"])
    import domain
    from application.engine.engine import Engine
    from domain.config import EngineConfig
    from domain.sampling import SamplingParams
    from entrypoints.container import create_container

    tree = Path(domain.__file__).resolve().parent.parent
    assert tree == Path(spec["tree"]).resolve(), f"imported {tree}, not {spec['tree']}"
    fields = EngineConfig.__dataclass_fields__
    paged = "num_kv_blocks" in fields
    # The engine's fields under this tree's names (older trees: max_seq_len, max_batch_size).
    running = "max_num_seqs" if "max_num_seqs" in fields else "max_batch_size"
    context = "max_model_len" if "max_model_len" in fields else "max_seq_len"
    budget = spec["slots"] * spec["max_seq_len"]  # KV positions
    common = {
        context: spec["max_seq_len"],
        "max_waiting_requests": spec["requests"] + 1,
        "max_num_batched_tokens": spec["max_num_batched_tokens"],
    }
    if paged:
        block = fields["kv_block_size"].default
        common[running] = spec["max_batch_size"]
        config = EngineConfig(num_kv_blocks=budget // block, **common)
    else:
        config = EngineConfig(**{running: spec["slots"]}, **common)
    options = {"dtype": spec["dtype"], "device": spec["device"], "engine": config}
    options.update(runner=spec["runner"], progress=False)
    try:
        from entrypoints.config import ServerConfig
    except ImportError:  # a tree from before the config tree: create_container's keywords
        container = create_container(spec["model"], **options)
    else:
        container = create_container(ServerConfig.for_model(spec["model"], **options))
    parts = container.backend if hasattr(container, "backend") else container  # older trees
    runner = parts.runner()
    tokenizer = parts.tokenizer()

    class Sink:
        def publish(self, output: object) -> None:
            pass

    engine = Engine(config, runner, tokenizer, Sink(), vocab_size=parts.vocab_size())
    vocab = engine.vocab_size
    low, high = (bs.LOW_TOKEN_ID, vocab - bs.HIGH_TOKEN_MARGIN) if vocab > 4000 else (64, vocab)
    rng = random.Random(f"{spec['seed']}-concurrency")
    requests = []
    for _ in range(spec["requests"]):
        prompt_len, output_len = rng.randint(*spec["prompt_len"]), rng.randint(*spec["output_len"])
        requests.append(([rng.randrange(low, high) for _ in range(prompt_len)], output_len))
    digest = hashlib.sha256(json.dumps(requests).encode()).hexdigest()[:12]

    def params(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

    def admit(request_id: str, prompt: list[int], params: SamplingParams) -> None:
        try:
            from domain.request import AdmitCall
        except ImportError:  # older trees: admit(request_ids, prompts, params)
            engine.admit([request_id], [prompt], params)
        else:
            engine.admit(AdmitCall.one(request_id, prompt, params))

    admit("warm-up", [rng.randrange(low, high) for _ in range(32)], params(4))
    while engine.has_work():
        engine.step()
    for i, (prompt, n) in enumerate(requests):
        admit(f"r{i}", prompt, params(n))
    peak = steps = running_sum = preemptions = tokens = finished = 0
    start = time.perf_counter()
    deadline = start + spec["timeout_s"]
    timed_out = False
    while engine.has_work():
        if time.perf_counter() > deadline:
            timed_out = True
            break
        stats = engine.step()
        running = stats.scheduler.running
        peak = max(peak, running)
        if stats.ran:
            steps += 1
            running_sum += running
        preemptions += len(stats.preempted)
        tokens += stats.sampled_tokens
        finished += len(stats.finished)
        if stats.finished and finished % max(1, spec["requests"] // 8) == 0:
            bs._progress(f"[{spec['label']}] {finished}/{spec['requests']} done")
    duration = time.perf_counter() - start
    cache = getattr(runner, "cache", None)
    kv_bytes = sum(t.numel() * t.element_size() for t in (cache.k, cache.v)) if cache else None
    result = {
        "label": spec["label"],
        "tree": str(tree),
        "paged": paged,
        "runner": spec["runner"],
        "max_batch_size": getattr(config, running),
        "kv_positions": config.kv_blocks * config.kv_block_size if paged else budget,
        "kv_blocks": config.kv_blocks if paged else None,
        "kv_bytes": kv_bytes,
        "requests": spec["requests"],
        "requests_hash": digest,
        "finished": finished,
        "timed_out": timed_out,
        "peak_running": peak,
        "mean_running": running_sum / steps if steps else 0.0,
        "steps": steps,
        "preemptions": preemptions,
        "output_tokens": tokens,
        "duration_s": duration,
        "output_tok_s": tokens / duration if duration > 0 else 0.0,
    }
    Path(spec["result"]).write_text(json.dumps(result, indent=2) + "\n")


def run_worker(label: str, tree: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Part 2 on ``tree`` in a subprocess (``--p2-timeout`` for the load, more to start)."""
    with tempfile.TemporaryDirectory(prefix="bench_prefix_") as folder:
        spec = {
            "label": label,
            "tree": str(tree),
            "result": str(Path(folder) / "result.json"),
            "model": args.model,
            "dtype": args.dtype,
            "device": args.device,
            "runner": args.p2_runner,
            "slots": args.p2_slots,
            "max_seq_len": args.p2_max_seq_len,
            "max_batch_size": args.p2_max_batch_size,
            "max_num_batched_tokens": args.p2_max_num_batched_tokens,
            "requests": args.p2_requests,
            "prompt_len": args.p2_prompt_len,
            "output_len": args.p2_output_len,
            "seed": args.seed,
            "timeout_s": args.p2_timeout,
        }
        spec_path = Path(folder) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        bs._progress(f"[{label}] engine on {tree} ({args.p2_runner} runner)")
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", str(spec_path)]
        env = {**os.environ, "PYTHONPATH": str(tree)}
        try:
            subprocess.run(command, cwd=tree, env=env, check=True, timeout=args.p2_timeout + 300)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
            return {"label": label, "error": str(e)}
        result: dict[str, Any] = json.loads(Path(spec["result"]).read_text())
        return result


def part2_table(args: argparse.Namespace, runs: dict[str, dict[str, Any]]) -> tuple[str, str]:
    names = list(runs)
    both = len(names) == 2 and all("error" not in r for r in runs.values())
    lo, hi = args.p2_prompt_len
    olo, ohi = args.p2_output_len
    header = ["metric", *names] + (["paged / contiguous"] if both else [])
    lines = [
        f"## 2. Concurrency in one KV budget: {args.p2_slots} contiguous slots of "
        f"{args.p2_max_seq_len} positions; {args.p2_requests} requests queued at once, "
        f"prompts {lo}-{hi}, outputs {olo}-{ohi} tokens ({args.p2_runner} runner)",
        *_table_head(header),
    ]
    rows: list[tuple[str, str, int | None]] = [  # label, key, digits (None: no ratio)
        ("max running requests (config)", "max_batch_size", None),
        ("KV positions (blocks)", "kv", None),
        ("KV bytes allocated (MiB)", "kv_mib", None),
        ("requests done / queued", "done", None),
        ("peak running requests", "peak_running", 0),
        ("mean running requests per step", "mean_running", 1),
        ("preemptions", "preemptions", None),
        ("engine steps", "steps", None),
        ("output tokens", "output_tokens", None),
        ("duration (s)", "duration_s", 2),
        ("output tok/s", "output_tok_s", 1),
    ]
    for label, key, digits in rows:
        cells = [label]
        for n in names:
            cells.append(_engine_cell(runs[n], key, digits))
        if both:
            paged, contiguous = runs[names[1]], runs[names[0]]
            cells.append(_ratio(paged[key], contiguous[key]) if digits is not None else "")
        lines.append("| " + " | ".join(cells) + " |")
    for n in names:
        if "error" in runs[n]:
            lines.append(f"\n{n}: {runs[n]['error']}")
    if both:
        hashes = {r["requests_hash"] for r in runs.values()}
        same = "same requests" if len(hashes) == 1 else "DIFFERENT requests"
        lines.append(f"\nrequests hash: {', '.join(sorted(hashes))} ({same} on both sides)")
    ratio = _ratio(runs[names[1]]["peak_running"], runs[names[0]]["peak_running"]) if both else "–"
    return "\n".join(lines), ratio


# ---------------------------------------------------------------------------- report


def _engine_cell(r: dict[str, Any], key: str, digits: int | None) -> str:
    if "error" in r:
        return "–"
    if key == "kv":
        blocks = f" ({r['kv_blocks']:,} blocks)" if r["kv_blocks"] else ""
        return f"{r['kv_positions']:,}{blocks}"
    if key == "kv_mib":
        return _mib(r["kv_bytes"])
    if key == "done":
        late = " (timed out)" if r["timed_out"] else ""
        return f"{r['finished']} / {r['requests']}{late}"
    return _fmt(r[key], digits or 0)


def _fmt(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{x:,.{digits}f}"


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}×" if a is not None and b else "–"


def _hit_rate(s: dict[str, Any]) -> str:
    prefix = s["prefix_cache"]
    if prefix is None:
        return "– (not on /metrics)"
    if not prefix["queries"]:
        return "– (no lookups)"
    hits, queries = prefix["hits"], prefix["queries"]
    return f"{hits / queries:.1%} ({hits:,.0f} / {queries:,.0f} tokens)"


def _mib(x: int | None) -> str:
    return "–" if x is None else f"{x / MIB:,.0f}"


LAST_CONTIGUOUS = "812e5b4"  # the last commit whose engine kept KV in contiguous slots


def contiguous_tree(flag: str | None) -> Path:
    """``--contiguous-tree``: a checkout whose engine still has the contiguous-slot cache
    (refused otherwise: this tree against itself would compare paged with paged)."""
    hint = f"a checkout of {LAST_CONTIGUOUS} (git worktree add /tmp/base {LAST_CONTIGUOUS})"
    if not flag:
        raise SystemExit(f"pass --contiguous-tree PATH: {hint}")
    tree = Path(flag).resolve()
    kv_cache = tree / "adapters/torch/models/kv_cache.py"
    if not kv_cache.is_file() or "class SlotKVCache" not in kv_cache.read_text():
        raise SystemExit(f"{tree} has no contiguous-slot KV cache: use {hint}")
    return tree


def _commit(tree: Path) -> str:
    out = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=tree
    )
    return out.stdout.strip() or "?"


def main() -> None:
    args = _args()
    if args.worker:
        worker(args.worker)
        return
    parts = args.part
    needs_main = "2" in parts or ("3" in parts and not args.no_contiguous_server)
    main_tree = contiguous_tree(args.contiguous_tree) if needs_main else None
    serve_args = ["--dtype", args.dtype, *(["--model", args.model] if args.model else [])]
    serve_args += ["--device", args.device] if args.device else []
    serve_args += args.server_arg
    servers: dict[str, dict[str, Any]] = {}
    if "1" in parts or "3" in parts:
        vocab = args.vocab_size or _vocab(args)
        prompts = part1_prompts(args, vocab)
        plan = [(ON, REPO_ROOT, serve_args)]
        if "1" in parts:
            plan.append((OFF, REPO_ROOT, [*serve_args, "--no-prefix-caching"]))
        if "3" in parts and main_tree is not None:
            plan.append((CONTIGUOUS, main_tree, serve_args))
        for label, tree, flags in plan:
            servers[label] = run_summary(serve_and_load(label, tree, flags, args, prompts))
    engines: dict[str, dict[str, Any]] = {}
    if "2" in parts:
        assert main_tree is not None
        engines[CONTIGUOUS] = run_worker(CONTIGUOUS, main_tree, args)
        engines["paged (this tree)"] = run_worker("paged (this tree)", REPO_ROOT, args)

    print("# bench_prefix\n")
    print(bs.machine_line())
    model = args.model or "default model"
    main_commit = f", contiguous tree {main_tree} at {_commit(main_tree)}" if main_tree else ""
    print(f"{model}, {args.dtype}, greedy, EOS ignored, seed {args.seed}{main_commit}\n")
    summary: dict[str, str] = {}
    if "1" in parts:
        table, p50 = part1_table(args, servers)
        print(table + "\n")
        summary["TTFT p50 no caching / caching"] = p50
    if "2" in parts:
        table, ratio = part2_table(args, engines)
        print(table + "\n")
        summary["peak running paged / contiguous"] = ratio
    if "3" in parts:
        print(part3_table(servers) + "\n")
    if summary:
        print("summary: " + "; ".join(f"{k} {v}" for k, v in summary.items()))
    if args.result_json:
        raw = {"machine": bs.machine_line(), "args": vars(args), "summary": summary}
        raw |= {"servers": servers, "engines": engines}
        Path(args.result_json).write_text(json.dumps(raw, indent=2, default=str) + "\n")


def _vocab(args: argparse.Namespace) -> int:
    from entrypoints.config import ServerConfig
    from entrypoints.container import create_container

    config = ServerConfig.for_model(args.model, progress=False)
    return int(create_container(config).backend.tokenizer().vocab_size)


def _parts(text: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items or set(items) - PARTS:
        raise argparse.ArgumentTypeError("choose from 1, 2, 3 (comma-separated)")
    return items


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--part", type=_parts, default="1,2,3", help="any of 1,2,3 (default: all)")
    p.add_argument("--model", default=None, help="model spec (default: embedded SmolLM2)")
    p.add_argument("--dtype", default="float32", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=None, help="default: the tokenizer's")
    p.add_argument(
        "--contiguous-tree",
        default=None,
        help=f"a checkout with the contiguous-slot KV cache ({LAST_CONTIGUOUS}); parts 2 and 3",
    )
    p.add_argument("--result-json", default=None, help="write every number here")
    g = p.add_argument_group("parts 1 and 3: servers")
    g.add_argument("--requests", type=int, default=32, help="measured requests")
    g.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    g.add_argument("--system-len", type=int, default=1500, help="shared prompt tokens")
    g.add_argument("--question-len", type=int, default=50, help="tokens after it, per request")
    g.add_argument("--max-tokens", type=int, default=16, help="output tokens per request")
    g.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra `infer serve` argument for every server (repeatable)",
    )
    g.add_argument(
        "--no-contiguous-server",
        action="store_true",
        help="part 3: skip the contiguous tree's server",
    )
    g.add_argument("--startup-timeout", type=float, default=180.0, help="seconds for /health")
    g.add_argument("--settle", type=float, default=2.0, help="seconds idle before the RSS")
    g.add_argument("--request-timeout", type=float, default=300.0, help="seconds per read")
    g.add_argument("--load-timeout", type=float, default=900.0, help="seconds per server load")
    g = p.add_argument_group("part 2: engines in one KV budget")
    g.add_argument("--p2-requests", type=int, default=64)
    g.add_argument("--p2-slots", type=int, default=8, help="the budget, in contiguous slots")
    g.add_argument("--p2-max-seq-len", type=int, default=2048, help="positions per slot")
    g.add_argument("--p2-max-batch-size", type=int, default=256, help="the paged side's cap")
    g.add_argument("--p2-max-num-batched-tokens", type=int, default=512)
    g.add_argument("--p2-prompt-len", type=bs._range, default="100,600", help="LOW,HIGH")
    g.add_argument(
        "--p2-output-len",
        type=bs._range,
        default="32,128",
        help="LOW,HIGH (default 32,128: the contiguous side's time is outputs / slots steps)",
    )
    g.add_argument("--p2-runner", default="torch", choices=["torch", "fake"])
    g.add_argument("--p2-timeout", type=float, default=600.0, help="seconds per engine's load")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


if __name__ == "__main__":
    main()
