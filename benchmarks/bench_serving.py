"""Serving throughput and latency: static vs continuous batching, next to sequential generate().

A concurrent load generator (httpx + asyncio) against ``POST /v1/completions`` (streamed,
token-id prompts, greedy, EOS ignored). Metrics as vLLM's ``bench serve`` defines them:
TTFT (send -> first token chunk), ITL (gaps between token chunks, pooled over requests),
TPOT ((E2EL - TTFT) / (output tokens - 1) per request), E2EL (send -> end of stream);
output tokens from the final usage chunk. Throughput = tokens / (first send -> last end).

Workloads (prompts: random token ids in [100, vocab_size - 1000), seeded per workload):
  w1     1 request, prompt 256 tokens, 256 output tokens
  w2     16 requests sent at once, prompt lengths in [32, 1024], outputs in [64, 256]
  sweep  per concurrency c: 2*c requests, at most c in flight, prompts in [96, 128], 128 out
         (the shape of the reference transformers measurement: 108-token prompt, 128 new)

By default each batching mode gets its own freshly launched server (``infer serve`` on a
free port, one warm-up request, all workloads, then stopped). The baseline runs the W1 and
W2 prompts one at a time through ``adapters.torch.runtime.generate.generate()`` in this process,
while no server is running; ``--hf-baseline`` also runs them one at a time through
transformers' ``generate`` on the same weights (greedy only). Usage:

    .venv/bin/python benchmarks/bench_serving.py                    # everything (long)
        [--model SPEC] [--dtype bfloat16] [--modes static,continuous]
        [--workloads w1,w2,sweep] [--concurrency 1,4,16,64] [--no-baseline] [--rounds 3]
        [--hf-baseline] [--result-json PATH]
    .venv/bin/python benchmarks/bench_serving.py --base-url http://127.0.0.1:8000 \\
        --label mine --no-baseline                                  # a running server
    .venv/bin/python benchmarks/bench_serving.py --workloads w1 --modes continuous \\
        --w1-input-len 32 --w1-output-len 16 --no-baseline           # smoke run
"""

import argparse
import asyncio
import contextlib
import gc
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
PERCENTILES = (50, 95, 99)
LATENCIES = ("ttft", "itl", "tpot", "e2el")
LOW_TOKEN_ID = 100  # below: special tokens in the usual vocabularies
HIGH_TOKEN_MARGIN = 1000  # the last ids: added tokens
WARMUP = "warm-up"

# ---------------------------------------------------------------------------- data


@dataclass(frozen=True)
class RequestSpec:
    prompt: list[int]
    output_len: int
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    specs: list[RequestSpec]
    concurrency: int
    baseline: bool  # also run sequentially through generate()


@dataclass
class RequestResult:
    """One request's timeline (``time.perf_counter`` seconds) and outcome."""

    prompt_len: int
    expected_tokens: int
    send: float = 0.0
    token_times: list[float] = field(default_factory=list)  # arrival of each token chunk
    end: float = 0.0
    output_tokens: int | None = None  # usage.completion_tokens
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def num_output_tokens(self) -> int:
        return self.output_tokens if self.output_tokens is not None else len(self.token_times)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.send

    @property
    def e2el(self) -> float:
        return self.end - self.send

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        n = self.num_output_tokens
        return (self.e2el - self.ttft) / (n - 1) if n > 1 else None


@dataclass(frozen=True)
class SSEEvent:
    kind: Literal["token", "usage", "done", "error"]
    completion_tokens: int | None = None
    message: str | None = None


# ---------------------------------------------------------------------------- pure parts


async def sse_lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """Lines of an SSE body, split only at CR/LF as the SSE format says (httpx's
    ``aiter_lines`` also splits inside JSON at U+2028 and friends, which generated text holds)."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        *lines, buffer = re.split(rb"\r\n|\r|\n", buffer)
        for line in lines:
            yield line.decode()
    if buffer:
        yield buffer.decode()


def parse_sse_line(line: str) -> SSEEvent | None:
    """One line of an OpenAI completions stream; ``None`` for blank, comment and non-data
    lines. A chunk with a choice is a token; ``choices: []`` with usage is the usage chunk."""
    line = line.strip()
    if not line.startswith("data:"):
        return None
    data = line[len("data:") :].strip()
    if data == "[DONE]":
        return SSEEvent("done")
    try:
        chunk = json.loads(data)
    except json.JSONDecodeError:
        return SSEEvent("error", message=f"malformed chunk: {data[:200]}")
    if not isinstance(chunk, dict):
        return SSEEvent("error", message=f"unexpected chunk: {data[:200]}")
    if "error" in chunk:
        error = chunk["error"]
        message = error.get("message") if isinstance(error, dict) else error
        return SSEEvent("error", message=str(message))
    usage = chunk.get("usage") or {}
    completion_tokens = usage.get("completion_tokens")
    if chunk.get("choices"):
        return SSEEvent("token", completion_tokens)
    if completion_tokens is not None:
        return SSEEvent("usage", completion_tokens)
    return None


def record_line(result: RequestResult, line: str, now: float) -> bool:
    """Apply one stream line received at ``now`` to ``result``; True when the stream is over."""
    event = parse_sse_line(line)
    if event is None:
        return False
    if event.kind == "error":
        result.error = f"error chunk: {event.message}"
        return True
    if event.kind == "token":
        result.token_times.append(now)
    if event.completion_tokens is not None:
        result.output_tokens = event.completion_tokens
    return event.kind == "done"


def span(results: list[RequestResult]) -> float:
    """Seconds from the first send to the last end (of any request, failed ones included)."""
    return max(r.end for r in results) - min(r.send for r in results) if results else 0.0


def latency_stats(values_s: list[float]) -> dict[str, float | None]:
    """mean and percentiles in milliseconds (numpy's linear interpolation)."""
    if not values_s:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    ms = np.asarray(values_s, dtype=np.float64) * 1e3
    stats: dict[str, float | None] = {"mean": float(ms.mean())}
    stats.update({f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES})
    return stats


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    """Aggregates over one workload; only successful requests enter the token counts and
    latencies, failed ones are counted with their error messages."""
    ok = [r for r in results if r.ok]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.num_output_tokens for r in ok)
    tpots = [t for r in ok if (t := r.tpot) is not None]

    def rate(x: float) -> float:
        return x / duration if duration > 0 else 0.0

    return {
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": dict(Counter(r.error for r in results if r.error is not None)),
        "short_outputs": sum(r.num_output_tokens < r.expected_tokens for r in ok),
        "chunk_count_mismatch": sum(len(r.token_times) != r.num_output_tokens for r in ok),
        "duration_s": duration,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": rate(len(ok)),
        "output_throughput": rate(total_output),
        "total_token_throughput": rate(total_input + total_output),
        "ttft_ms": latency_stats([r.ttft for r in ok]),
        "itl_ms": latency_stats([x for r in ok for x in r.itls]),
        "tpot_ms": latency_stats(tpots),
        "e2el_ms": latency_stats([r.e2el for r in ok]),
    }


def timeline(r: RequestResult) -> dict[str, Any]:
    """One request's raw record for --result-json: times in ms from its send."""
    return {
        "prompt_len": r.prompt_len,
        "expected_tokens": r.expected_tokens,
        "output_tokens": r.output_tokens,
        "token_ms": [round((t - r.send) * 1e3, 3) for t in r.token_times],
        "end_ms": round(r.e2el * 1e3, 3),
        "error": r.error,
    }


def random_prompt(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    high = vocab_size - HIGH_TOKEN_MARGIN
    if high <= LOW_TOKEN_ID:
        raise ValueError(f"vocab size {vocab_size} too small; pass --vocab-size")
    return [rng.randrange(LOW_TOKEN_ID, high) for _ in range(length)]


def build_workloads(args: argparse.Namespace, vocab_size: int) -> list[Workload]:
    """The selected workloads; each draws from its own ``random.Random`` seeded with
    ``--seed`` and its name, so a workload's prompts do not depend on which others run."""

    def specs(
        name: str, n: int, prompt: tuple[int, int], out: tuple[int, int]
    ) -> list[RequestSpec]:
        rng = random.Random(f"{args.seed}-{name}")
        return [
            RequestSpec(
                random_prompt(rng, rng.randint(*prompt), vocab_size),
                rng.randint(*out),
                args.temperature,
                args.top_p,
            )
            for _ in range(n)
        ]

    w1_in, w1_out = (args.w1_input_len,) * 2, (args.w1_output_len,) * 2
    out: list[Workload] = []
    if "w1" in args.workloads:
        desc = f"1 request, prompt {args.w1_input_len}, output {args.w1_output_len}"
        out.append(Workload("W1", desc, specs("w1", 1, w1_in, w1_out), 1, True))
    if "w2" in args.workloads:
        n, (pl, ph), (ol, oh) = args.w2_requests, args.w2_input_len, args.w2_output_len
        desc = f"{n} requests at once, prompts in [{pl}, {ph}], outputs in [{ol}, {oh}]"
        w2 = specs("w2", n, args.w2_input_len, args.w2_output_len)
        out.append(Workload("W2", desc, w2, n, True))
    if "sweep" in args.workloads:
        (pl, ph), o = args.sweep_input_len, args.sweep_output_len
        for c in args.concurrency:
            n = args.sweep_requests_per_concurrency * c
            desc = f"{n} requests, at most {c} in flight, prompts in [{pl}, {ph}], output {o}"
            reqs = specs(f"sweep-c{c}", n, args.sweep_input_len, (o, o))
            out.append(Workload(f"sweep c={c}", desc, reqs, c, False))
    return out


# ---------------------------------------------------------------------------- client


async def send_request(
    client: httpx.AsyncClient, url: str, model: str, spec: RequestSpec
) -> RequestResult:
    body = {
        "model": model,
        "prompt": spec.prompt,
        "max_tokens": spec.output_len,
        "temperature": spec.temperature,
        "top_p": spec.top_p,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    return await stream_completion(
        client, url, body, RequestResult(len(spec.prompt), spec.output_len)
    )


async def stream_completion(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    result: RequestResult,
    on_line: Callable[[str], None] | None = None,
) -> RequestResult:
    """POST one streamed completion and record its timeline into ``result``; ``on_line``
    sees every SSE line (a caller reading more than the timeline)."""
    done = False
    result.send = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text[:200]}"
            else:
                async for line in sse_lines(response.aiter_bytes()):
                    if on_line is not None:
                        on_line(line)
                    if done := record_line(result, line, time.perf_counter()):
                        break
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}"
    result.end = time.perf_counter()
    if result.ok and not done:
        result.error = "stream ended without [DONE]"
    elif result.ok and not result.token_times:
        result.error = "no token chunks"
    return result


async def run_requests(
    client: httpx.AsyncClient, url: str, model: str, workload: Workload, label: str
) -> list[RequestResult]:
    """All of a workload's requests, at most ``workload.concurrency`` in flight."""
    gate = asyncio.Semaphore(workload.concurrency)
    total, done = len(workload.specs), 0
    every = max(1, total // 8)

    async def one(spec: RequestSpec) -> RequestResult:
        nonlocal done
        async with gate:
            result = await send_request(client, url, model, spec)
        done += 1
        if done % every == 0 or done == total:
            _progress(f"[{label}] {workload.name}: {done}/{total} done")
        return result

    return list(await asyncio.gather(*(one(s) for s in workload.specs)))


async def bench_server(
    base_url: str,
    model_name: str | None,
    workloads: list[Workload],
    label: str,
    timeout: float,
    api_key: str | None = None,
) -> dict[str, dict[str, Any]]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout_cfg = httpx.Timeout(timeout, connect=30.0)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(limits=limits, timeout=timeout_cfg, headers=headers) as client:
        model = model_name or await _first_model_id(client, base_url)
        url = f"{base_url}/v1/completions"
        prompt = list(range(LOW_TOKEN_ID, LOW_TOKEN_ID + 64))
        warm = Workload(WARMUP, "", [RequestSpec(prompt, 16)], 1, False)
        [result] = await run_requests(client, url, model, warm, label)
        if not result.ok:
            _progress(f"[{label}] warning: warm-up request failed: {result.error}")
        summaries = {}
        for w in workloads:
            results = await run_requests(client, url, model, w, label)
            summaries[w.name] = summarize(results, span(results))
            summaries[w.name]["per_request"] = [timeline(r) for r in results]
        return summaries


async def _first_model_id(client: httpx.AsyncClient, base_url: str) -> str:
    response = await client.get(f"{base_url}/v1/models")
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


# ---------------------------------------------------------------------------- server


@contextlib.contextmanager
def launched_server(args: argparse.Namespace, mode: str) -> Iterator[str]:
    """``infer serve`` in ``mode`` on a free port; yields its base URL, always stops it."""
    serve_args = ["--model", args.model] if args.model else []
    serve_args += ["--device", args.device] if args.device else []
    serve_args += ["--dtype", args.dtype]
    serve_args += ["--batching-mode", mode, "--max-num-seqs", str(args.max_num_seqs)]
    serve_args += ["--max-waiting-requests", "256", "--max-seq-len", "1536", *args.server_arg]
    with serve_process(serve_args, mode, args.startup_timeout) as (base_url, _):
        yield base_url


@contextlib.contextmanager
def serve_process(
    serve_args: list[str],
    label: str,
    startup_timeout: float,
    cwd: Path = REPO_ROOT,
    env: dict[str, str] | None = None,
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``infer serve SERVE_ARGS`` of the tree at ``cwd`` on 127.0.0.1 and a free port (log in
    a temporary file named after ``label``); yields its base URL and process once /health
    answers, always stops it."""
    port = _free_port()
    command = [sys.executable, "-m", "entrypoints.cli", "serve"]
    command += ["--host", "127.0.0.1", "--port", str(port), *serve_args]
    log_name = f"bench_serving_{label}_"
    with tempfile.NamedTemporaryFile(prefix=log_name, suffix=".log", delete=False) as log:
        _progress(f"launching {label} server on port {port} (log: {log.name})")
        proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            base_url = f"http://127.0.0.1:{port}"
            _wait_healthy(proc, base_url, startup_timeout, Path(log.name))
            _progress(f"{label} server ready")
            yield base_url, proc
        finally:
            _stop(proc)
            _progress(f"{label} server stopped")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_healthy(proc: subprocess.Popen[bytes], base_url: str, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{_tail(log)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base_url}/health", timeout=5.0).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"server not healthy after {timeout:.0f} s:\n{_tail(log)}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def sampling_line(args: argparse.Namespace) -> str:
    if args.temperature == 0:
        return "greedy"
    return f"temperature {args.temperature}, top_p {args.top_p}"


# ---------------------------------------------------------------------------- baseline


def run_baseline(container: Any, workloads: list[Workload]) -> dict[str, dict[str, Any]]:
    """Each workload's requests one after another through ``generate()``; wall-clock."""
    from adapters.torch.runtime.generate import generate
    from domain.sampling import SamplingParams

    model, tokenizer = container.backend.model(), container.backend.tokenizer()

    def params(n: int, temperature: float = 0.0, top_p: float = 1.0) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=temperature, top_p=top_p, ignore_eos=True)

    def one(spec: RequestSpec) -> int:
        p = params(spec.output_len, spec.temperature, spec.top_p)
        return len(generate(model, tokenizer, spec.prompt, p).token_ids)

    generate(model, tokenizer, list(range(1000, 1064)), params(16))  # warm-up
    return _run_sequentially(workloads, "sequential", one)


def run_hf_baseline(container: Any, workloads: list[Workload]) -> dict[str, dict[str, Any]]:
    """The same requests one after another through transformers' ``generate`` on the same
    converted weights and dtype (greedy, exactly the requested number of new tokens)."""
    import torch
    from transformers import AutoModelForCausalLM

    from adapters.torch.factory import DTYPES

    if any(spec.temperature != 0 for w in workloads for spec in w.specs):
        raise ValueError("--hf-baseline runs greedy requests only")
    folder = container.backend.resolved_model().path
    dtype = DTYPES[container.backend.dtype()]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()

    def generate(prompt: list[int], n: int) -> int:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = model.generate(
                ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
            )
        return out.shape[1] - ids.shape[1]

    generate(list(range(1000, 1064)), 16)  # warm-up
    return _run_sequentially(
        workloads, "sequential transformers", lambda spec: generate(spec.prompt, spec.output_len)
    )


def _run_sequentially(
    workloads: list[Workload], label: str, one: Callable[[RequestSpec], int]
) -> dict[str, dict[str, Any]]:
    """Each workload's requests one after another through ``one`` (-> output tokens)."""
    out = {}
    for w in workloads:
        start, tokens = time.perf_counter(), 0
        for i, spec in enumerate(w.specs, 1):
            tokens += one(spec)
            _progress(f"[{label}] {w.name}: {i}/{len(w.specs)} done")
        duration = time.perf_counter() - start
        inputs = sum(len(s.prompt) for s in w.specs)
        out[w.name] = {
            "requests": len(w.specs),
            "completed": len(w.specs),
            "failed": 0,
            "duration_s": duration,
            "total_input_tokens": inputs,
            "total_output_tokens": tokens,
            "request_throughput": len(w.specs) / duration,
            "output_throughput": tokens / duration,
            "total_token_throughput": (inputs + tokens) / duration,
        }
    return out


# ---------------------------------------------------------------------------- report


def _fmt(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{x:,.{digits}f}"


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}×" if a is not None and b else "–"


def _rows(s: dict[str, Any], sequential: float | None) -> list[tuple[str, str]]:
    """(label, cell) for one column; ``sequential`` is the baseline's output tok/s."""
    rows = [
        ("requests ok / failed", f"{s['completed']} / {s['failed']}"),
        ("duration (s)", _fmt(s["duration_s"], 2)),
        ("output tok/s", _fmt(s["output_throughput"])),
        ("request/s", _fmt(s["request_throughput"], 2)),
        ("total tok/s (in + out)", _fmt(s["total_token_throughput"])),
    ]
    if sequential is not None:
        rows.append(("output tok/s vs sequential", _ratio(s["output_throughput"], sequential)))
    for name in LATENCIES:
        # the sequential baseline measures throughput only
        stats = s.get(f"{name}_ms") or dict.fromkeys(["mean", *(f"p{p}" for p in PERCENTILES)])
        pct = (
            " / ".join(_fmt(stats[f"p{p}"]) for p in PERCENTILES)
            if stats["p50"] is not None
            else "–"
        )
        rows += [
            (f"{name.upper()} mean (ms)", _fmt(stats["mean"])),
            (f"{name.upper()} p50 / p95 / p99 (ms)", pct),
        ]
    return rows


def _table(w: Workload, columns: dict[str, dict[str, Any]], sequential: float | None) -> str:
    names = list(columns)
    both = "static" in columns and "continuous" in columns
    header = ["metric", *names] + (["continuous / static"] if both else [])
    body = [_rows(columns[n], sequential) for n in names]
    lines = [f"## {w.name}: {w.description}", "", "| " + " | ".join(header) + " |"]
    lines.append("|" + "---|" * len(header))
    for i, (label, _) in enumerate(body[0]):
        cells = [label, *(rows[i][1] for rows in body)]
        if both:
            a, b = columns["continuous"], columns["static"]
            speedup = _ratio(a["output_throughput"], b["output_throughput"])
            cells.append(speedup if label == "output tok/s" else "")
        lines.append("| " + " | ".join(cells) + " |")
    for n in names:
        lines += [f"\n{n}: {count}× {e}" for e, count in columns[n].get("errors", {}).items()]
        if count := columns[n].get("short_outputs"):
            lines.append(f"\n{n}: {count} requests got fewer tokens than asked")
        if count := columns[n].get("chunk_count_mismatch"):
            lines.append(f"\n{n}: {count} requests' token chunks != usage.completion_tokens")
    return "\n".join(lines)


def machine_line() -> str:
    import torch

    cpu = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO_ROOT
    ).stdout.strip()
    omp = os.environ.get("OMP_NUM_THREADS", "unset")
    if torch.cuda.is_available():
        cpu += f", GPU {torch.cuda.get_device_name()}"
    return (
        f"machine: {cpu}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads (OMP_NUM_THREADS {omp}), commit {commit or '?'}"
    )


def report(
    args: argparse.Namespace,
    workloads: list[Workload],
    servers: dict[str, dict[str, dict[str, Any]]],
    baseline: dict[str, dict[str, Any]],
    vocab_size: int,
    hf_baseline: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Print the markdown report; return the summary ratios."""
    hf_baseline = hf_baseline or {}
    print("# bench_serving\n")
    print(machine_line())
    print(
        f"model {args.model or 'default'} {args.dtype}; max batch {args.max_num_seqs}; "
        f"seed {args.seed}; prompts: random ids in [{LOW_TOKEN_ID}, "
        f"{vocab_size - HIGH_TOKEN_MARGIN}); {sampling_line(args)}, EOS ignored\n"
    )
    for w in workloads:
        columns = {label: s[w.name] for label, s in servers.items()}
        seq = baseline.get(w.name)
        if seq is not None:
            columns["sequential"] = seq
        if w.name in hf_baseline:
            columns["sequential transformers"] = hf_baseline[w.name]
        print(_table(w, columns, seq["output_throughput"] if seq else None) + "\n")
    sweep = [w for w in workloads if w.name.startswith("sweep")]
    if sweep:
        print(_sweep_table(sweep, servers) + "\n")
    ratios = _ratios(servers, baseline, sweep)
    for w, hf in hf_baseline.items():
        for label, s in [*servers.items(), ("sequential", baseline)]:
            if w in s:
                ratios[f"{w} {label}/sequential transformers"] = _ratio(
                    s[w]["output_throughput"], hf["output_throughput"]
                )
    print("summary: " + "; ".join(f"{k} {v}" for k, v in ratios.items()))
    return ratios


def _sweep_table(sweep: list[Workload], servers: dict[str, dict[str, dict[str, Any]]]) -> str:
    labels = list(servers)
    lines = ["## sweep: output tok/s (TTFT p50 ms)", ""]
    lines += ["| concurrency | " + " | ".join(labels) + " |", "|" + "---|" * (len(labels) + 1)]
    for w in sweep:
        cells = [
            f"{_fmt(s[w.name]['output_throughput'])} ({_fmt(s[w.name]['ttft_ms']['p50'], 0)})"
            for s in servers.values()
        ]
        lines.append(f"| {w.name.removeprefix('sweep c=')} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ratios(
    servers: dict[str, dict[str, dict[str, Any]]],
    baseline: dict[str, dict[str, Any]],
    sweep: list[Workload],
) -> dict[str, str]:
    def tps(label: str, workload: str) -> float | None:
        s = baseline if label == "sequential" else servers.get(label, {})
        return s[workload]["output_throughput"] if workload in s else None

    out: dict[str, str] = {}
    for w in ("W1", "W2"):
        for label in servers:
            if tps(label, w) is not None and tps("sequential", w) is not None:
                out[f"{w} {label}/sequential"] = _ratio(tps(label, w), tps("sequential", w))
        if tps("continuous", w) is not None and tps("static", w) is not None:
            out[f"{w} continuous/static"] = _ratio(tps("continuous", w), tps("static", w))
    if sweep:
        last = sweep[-1].name
        for label in servers:
            out[f"{last} {label} output tok/s"] = _fmt(tps(label, last))
    return out


# ---------------------------------------------------------------------------- main


def main() -> None:
    args = _args()
    container = None
    if args.vocab_size is None or not args.no_baseline:
        container = _container(args)
    vocab_size = args.vocab_size or _tokenizer_vocab(container)
    workloads = build_workloads(args, vocab_size)
    baseline: dict[str, dict[str, Any]] = {}
    if not args.no_baseline:
        if args.base_url:
            _progress("warning: the sequential baseline runs next to the server at --base-url")
        baseline = run_baseline(container, [w for w in workloads if w.baseline])
    hf_baseline: dict[str, dict[str, Any]] = {}
    if args.hf_baseline:
        if container is None:
            container = _container(args)
        hf_baseline = run_hf_baseline(container, [w for w in workloads if w.baseline])
    del container  # free the baseline model before any server starts
    gc.collect()
    servers = {}
    rounds: list[dict[str, dict[str, dict[str, Any]]]] = []
    if args.base_url:
        servers[args.label] = _bench(args.base_url.rstrip("/"), args, workloads, args.label)
    for r in [] if args.base_url else range(args.rounds):
        # Alternate the order: the machine drifts between server launches.
        results = {}
        for mode in args.modes if r % 2 == 0 else args.modes[::-1]:
            with launched_server(args, mode) as base_url:
                results[mode] = _bench(base_url, args, workloads, mode)
        rounds.append(results)
        for mode, result in results.items():
            servers[mode if args.rounds == 1 else f"{mode} #{r + 1}"] = result
    ratios = report(args, workloads, servers, baseline, vocab_size, hf_baseline)
    if len(rounds) > 1:
        ratios |= round_ratios(rounds, [w.name for w in workloads])
        print("per round: " + "; ".join(f"{k} {v}" for k, v in ratios.items() if "round" in k))
    if args.result_json:
        raw = {"machine": machine_line(), "args": vars(args), "vocab_size": vocab_size}
        raw |= {"servers": servers, "sequential": baseline, "summary": ratios}
        raw |= {"sequential_transformers": hf_baseline}
        Path(args.result_json).write_text(json.dumps(raw, indent=2, default=str) + "\n")


def round_ratios(
    rounds: list[dict[str, dict[str, dict[str, Any]]]], workloads: list[str]
) -> dict[str, str]:
    """continuous / static output tok/s per round and their median, per workload."""
    out = {}
    for w in workloads:
        values = [
            r["continuous"][w]["output_throughput"] / r["static"][w]["output_throughput"]
            for r in rounds
            if "continuous" in r and "static" in r and r["static"][w]["output_throughput"]
        ]
        if values:
            listed = ", ".join(f"{v:.2f}" for v in values)
            out[f"{w} continuous/static by round"] = (
                f"{listed} (median {float(np.median(values)):.2f}×)"
            )
    return out


def _container(args: argparse.Namespace) -> Any:
    """The composition root of the sequential baseline (the model, no server)."""
    from entrypoints.config import ServerConfig
    from entrypoints.container import create_container

    config = ServerConfig.for_model(args.model, dtype=args.dtype, device=args.device)
    return create_container(config)


def _tokenizer_vocab(container: Any) -> int:
    return int(container.backend.tokenizer().vocab_size)


def _bench(
    base_url: str, args: argparse.Namespace, workloads: list[Workload], label: str
) -> dict[str, dict[str, Any]]:
    return asyncio.run(
        bench_server(
            base_url, args.model_name, workloads, label, args.request_timeout, args.api_key
        )
    )


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _range(text: str) -> tuple[int, int]:
    values = _ints(text)
    if len(values) == 1:
        values *= 2
    if len(values) != 2 or not 1 <= values[0] <= values[1]:
        raise argparse.ArgumentTypeError(f"expected LOW,HIGH with 1 <= LOW <= HIGH, got {text}")
    return values[0], values[1]


def _choices(allowed: set[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        if not items or set(items) - allowed:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(sorted(allowed))}")
        return items

    return parse


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=None, help="model spec (default: embedded SmolLM2)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", default=None, help="passed to the server and the baseline")
    p.add_argument(
        "--modes",
        type=_choices({"static", "continuous"}),
        default="static,continuous",
        help="batching modes to launch servers for, in order (default: static,continuous)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="launch every mode this many times, alternating the order; report each round's "
        "continuous/static ratio and their median (default: 1)",
    )
    p.add_argument("--max-num-seqs", "--max-batch-size", dest="max_num_seqs", type=int, default=64)
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra `infer serve` argument, e.g. "
        "--server-arg=--max-num-batched-tokens=1024 (repeatable)",
    )
    p.add_argument("--startup-timeout", type=float, default=180.0, help="seconds for /health")
    p.add_argument("--base-url", default=None, help="bench this running server instead")
    p.add_argument("--label", default="server", help="column name with --base-url")
    p.add_argument("--model-name", default=None, help="model id to send (default: /v1/models)")
    p.add_argument("--api-key", default=None, help="sent as Authorization: Bearer")
    p.add_argument("--request-timeout", type=float, default=1800.0, help="seconds per read")
    p.add_argument(
        "--workloads",
        type=_choices({"w1", "w2", "sweep"}),
        default="w1,w2,sweep",
        help="any of w1,w2,sweep (default: all)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--vocab-size", type=int, default=None, help="default: the tokenizer's")
    p.add_argument("--w1-input-len", type=int, default=256)
    p.add_argument("--w1-output-len", type=int, default=256)
    p.add_argument("--w2-requests", type=int, default=16)
    p.add_argument("--w2-input-len", type=_range, default="32,1024", help="LOW,HIGH")
    p.add_argument("--w2-output-len", type=_range, default="64,256", help="LOW,HIGH")
    p.add_argument("--concurrency", type=_ints, default="1,4,16,64", help="sweep levels")
    p.add_argument("--sweep-requests-per-concurrency", type=int, default=2)
    p.add_argument("--sweep-input-len", type=_range, default="96,128", help="LOW,HIGH")
    p.add_argument("--sweep-output-len", type=int, default=128)
    p.add_argument("--no-baseline", action="store_true", help="skip sequential generate()")
    p.add_argument(
        "--hf-baseline",
        action="store_true",
        help="also run W1/W2 one at a time through transformers' generate (greedy only)",
    )
    p.add_argument("--result-json", default=None, help="write all aggregates here")
    return p.parse_args(argv)


if __name__ == "__main__":
    main()
