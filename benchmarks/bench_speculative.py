"""Speculative decoding (issue 33): ``infer serve`` with and without ``--speculative-config``,
and llama-cpp-python's server on the same GGUF, plain and with its prompt-lookup decoding.

One run, one server at a time, nothing else on the machine. Servers, in this order:

- ``infer plain``: ``infer serve --speculative-config none`` (the embedded
  SmolLM2-135M-Instruct, its GGUF's Q4_1 blocks, ``--dtype auto``), no speculation: the
  baseline of every ratio;
- ``infer default``: ``infer serve`` with no flags (what ``make serve`` gives: on a CPU,
  prompt lookup with its defaults, k = 3, drafts only while one request runs);
- ``infer ngram``: the same plus ``--speculative-config '{"method": "ngram",
  "num_speculative_tokens": 4}'``;
- ``infer suffix``: ``--speculative-config '{"method": "suffix", "num_speculative_tokens": 4}'``;
- ``infer LABEL`` for every ``--extra-spec LABEL=JSON`` (e.g. another
  ``num_speculative_tokens``);
- ``infer ngram bs8``: ngram with ``"disable_by_batch_size": 8`` (throughput only; skipped
  with ``--no-bs8``);
- ``llama.cpp``: ``python -m llama_cpp.server --model <the same GGUF> --n_threads <cores>
  --n_ctx 2048 --interrupt_requests false`` run by ``--llama-python`` (a separate venv:
  llama-cpp-python is not a dependency of ours; skipped with a note where it is missing);
- ``llama.cpp lookup N``: the same plus ``--draft_model prompt-lookup-decoding
  --draft_model_num_pred_tokens N`` (its prompt-lookup decoding), once per N in
  ``--llama-lookup`` (default 10, its default, and 4). llama.cpp's requests carry
  ``repeat_penalty: 1.0`` (its server's default 1.1 applies at temperature 0 too).

Part 1, single stream: per workload three requests, one after another, streamed
``/v1/chat/completions``, greedy (temperature 0), ``max_tokens`` 256:

- ``edit``: 26 lines of Python (a class from this repository) in the prompt, "copy this code
  exactly, with one change: rename the method `feed` to `push`", the same request three
  times (so ``suffix`` drafts the second and third from the first's output);
- ``rag``: an answer quoting a given context (three questions on one context);
- ``json``: records to JSON (three sets of records);
- ``chat``: a short story (three subjects): open text, where drafts are rare.

Each request's output tok/s = (completion tokens - 1) / (last token chunk - first token
chunk); a workload's figure is the median of its three. Completion tokens: the stream's
final usage where the server sends one, else the tokens of the text (the server's
``/extras/tokenize``; llama.cpp's stream may merge tokens into one chunk). Acceptance:
accepted / drafted tokens, the deltas of ``infer:spec_decode_num_accepted_tokens_total``
and ``infer:spec_decode_num_draft_tokens_total`` on ``/metrics`` around each request. The
texts of every server are compared with ``infer plain``'s, llama.cpp lookup's with plain
llama.cpp's (greedy: speculation keeps the model's tokens, but the quantized kernels'
rounding depends on the rows in a step, so a near-tie may go the other way).

Part 2, throughput (infer only): ``--tp-requests`` (128) open chat prompts, at most
``--tp-concurrency`` (64) in flight, ``max_tokens`` 128, ``ignore_eos``, greedy, streamed;
total output tok/s = output tokens / (first send -> last end). A short burst of 64 requests
warms each server first.

Usage (from the repository root):

    .venv/bin/python benchmarks/bench_speculative.py --llama-python /work/llama-venv/bin/python
    .venv/bin/python benchmarks/bench_speculative.py --llama-python "" --no-throughput \
        --requests 1 --max-tokens 32                                              # smoke
        [--extra-spec 'ngram-k3={"method": "ngram", "num_speculative_tokens": 3}']
        [--llama-lookup 10,4] [--texts-json texts.json] [--tp-requests 128]
    .venv/bin/python benchmarks/bench_speculative.py --only-throughput --rounds 3 --no-suffix

``--rounds N`` runs every server N times (the infer servers' order reversed on odd rounds)
and ends with the median over rounds of each ratio to ``infer plain`` of the same round:
launches of one server drift by ±10 % on this machine.
"""

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from benchmarks import bench_serving as bs  # noqa: E402
from benchmarks.bench_vs_llamacpp import cpu_model, default_model, isa_flags  # noqa: E402

DRAFTED = "infer:spec_decode_num_draft_tokens_total"
ACCEPTED = "infer:spec_decode_num_accepted_tokens_total"
# As measured in benchmarks/README.md (before the defaults became k = 3 and a load switch
# at 8 running requests): explicit, so a rerun measures the same configs.
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": None}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 4, "disable_by_batch_size": None}
NGRAM_BS8 = {**NGRAM, "disable_by_batch_size": 8}
# ``infer serve``'s own speculation: no --speculative-config flag at all.
DEFAULT: dict[str, Any] = {}
DEFAULT_LLAMA_PYTHON = "/work/llama-venv/bin/python"
# llama-cpp-python's server applies repeat_penalty 1.1 by default, at temperature 0 too: off,
# so that both sides decode greedily the same model
LLAMA_GREEDY = {"repeat_penalty": 1.0}

# ---------------------------------------------------------------------------- workloads

# The start of domain/stop.py as it was at issue 33 (26 lines, ~300 tokens: the whole 256-token
# answer is copied): SmolLM2-135M copies it when asked to (it did not copy several made-up
# functions, nor this code with other renames; it copies this one without renaming).
CODE = '''class StopStringMatcher:
    """Finds the first stop string to complete in a stream of text deltas (OpenAI semantics).

    The stop string itself is not emitted (unless ``include``: then the text ends with it),
    nor anything after it. Text that could be the
    beginning of a stop string is held back until the next deltas decide; stop strings spanning
    several deltas are found. Stop strings must be non-empty (``SamplingParams`` checks).
    """

    def __init__(self, stop: Sequence[str], *, include: bool = False) -> None:
        self._stop = tuple(stop)
        self._include = include
        self._held = ""
        # The stop string that was hit (None: none yet).
        self.matched: str | None = None

    def feed(self, delta: str) -> tuple[str, bool]:
        """Returns the text safe to emit now, and whether a stop string was hit
        (:attr:`matched` then says which)."""
        text = self._held + delta
        hit = self._first_hit(text)
        if hit is not None:
            self._held = ""
            start, self.matched = hit
            end = start + len(self.matched) if self._include else start
            return text[:end], True
        safe = len(text) - self._partial_stop_leng'''

EDIT = (
    "Here is some Python code:\n\n```python\n{code}\n```\n\nCopy this code exactly, with one "
    "change: rename the method `feed` to `push`. Output the whole code in a code block."
)

CONTEXT = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
    "It is named after the engineer Gustave Eiffel, whose company designed and built the "
    "tower from 1887 to 1889. Locally nicknamed La dame de fer, it was constructed as the "
    "centrepiece of the 1889 World's Fair, and to crown the centennial anniversary of the "
    "French Revolution. Although initially criticised by some of France's leading artists "
    "and intellectuals for its design, it has since become a global cultural icon of France "
    "and one of the most recognisable structures in the world. The tower received 5,889,000 "
    "visitors in 2022. The tower is 330 metres tall, about the same height as an 81-storey "
    "building, and the tallest structure in Paris. Its base is square, measuring 125 metres "
    "on each side. During its construction, the Eiffel Tower surpassed the Washington "
    "Monument to become the tallest human-made structure in the world, a title it held for "
    "41 years until the Chrysler Building in New York City was finished in 1930."
)
RAG = "Context: {context}\n\nQuestion: {question} Answer by quoting the context word for word."
QUESTIONS = [
    "Who is the Eiffel Tower named after, and when was it built?",
    "How tall is the Eiffel Tower, and how large is its base?",
    "Why was the Eiffel Tower criticised, and what did it become?",
]

JSON_TASK = (
    "Convert these records to JSON, a list of objects with the keys name, email, city, "
    "country, phone:\n{records}"
)
PEOPLE = [
    ("Maria Garcia", "Barcelona", "Spain", "+34 612 345 678"),
    ("John Smith", "Boston", "USA", "+1 617 555 0101"),
    ("Aiko Tanaka", "Osaka", "Japan", "+81 6 1234 5678"),
    ("Lars Nilsson", "Uppsala", "Sweden", "+46 18 471 00 00"),
    ("Priya Patel", "Pune", "India", "+91 20 2567 1234"),
    ("Tom Becker", "Hamburg", "Germany", "+49 40 123 4567"),
    ("Sofia Rossi", "Turin", "Italy", "+39 011 123 4567"),
    ("Omar Haddad", "Amman", "Jordan", "+962 6 555 1234"),
    ("Emma Dubois", "Lyon", "France", "+33 4 72 00 00 00"),
]


def _record(person: tuple[str, str, str, str]) -> str:
    name, city, country, phone = person
    email = name.lower().replace(" ", ".") + "@example.com"
    return f"Name: {name}; Email: {email}; City: {city}; Country: {country}; Phone: {phone}."


STORIES = [
    "Write a short story about a robot who learns to paint.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Write a short story about a girl who can talk to the wind.",
]

WORKLOADS: dict[str, list[str]] = {
    "edit": [EDIT.format(code=CODE)] * 3,  # the same request three times
    "rag": [RAG.format(context=CONTEXT, question=q) for q in QUESTIONS],
    "json": [
        JSON_TASK.format(records="\n".join(_record(p) for p in PEOPLE[i : i + 3]))
        for i in (0, 3, 6)
    ],
    "chat": STORIES,
}

SUBJECTS = [
    *("robot", "dragon", "sailor", "baker", "astronaut", "detective", "gardener", "fox"),
    *("violinist", "teacher", "miner", "pilot", "librarian", "painter", "clockmaker", "cat"),
]
PLACES = ["forest", "city", "desert", "island", "mountain", "village", "river", "library"]


def throughput_prompts(n: int) -> list[str]:
    """``n`` open chat prompts (a story each; different up to 128)."""
    return [
        f"Write a story about a {SUBJECTS[i % len(SUBJECTS)]} who lives near a "
        f"{PLACES[(i // len(SUBJECTS)) % len(PLACES)]}."
        for i in range(n)
    ]


# ---------------------------------------------------------------------------- results


@dataclass
class Stream:
    """One streamed chat completion."""

    send: float = 0.0
    first: float | None = None  # first chunk with text
    last: float | None = None  # last chunk with text
    end: float = 0.0
    chunks: int = 0
    text: str = ""
    usage_tokens: int | None = None
    finish: str | None = None
    error: str | None = None
    tokens: int = 0  # usage, or counted by /extras/tokenize
    drafted: float | None = None  # /metrics deltas around this request (infer)
    accepted: float | None = None

    def rate(self) -> float | None:
        if self.first is None or self.last is None or self.last <= self.first:
            return None
        return (self.tokens - 1) / (self.last - self.first)


@dataclass
class WorkloadResult:
    streams: list[Stream]
    drafted: float | None = None
    accepted: float | None = None

    def rate(self) -> float | None:
        rates = [r for s in self.streams if (r := s.rate()) is not None]
        return statistics.median(rates) if rates else None

    def acceptance(self) -> float | None:
        if not self.drafted or self.accepted is None:
            return None
        return self.accepted / self.drafted


@dataclass
class Throughput:
    tok_s: float
    tokens: int
    failed: int
    seconds: float
    drafted: float | None = None
    accepted: float | None = None


@dataclass
class ServerRun:
    label: str
    command: str
    workloads: dict[str, WorkloadResult] = field(default_factory=dict)
    throughput: Throughput | None = None
    seconds: float = 0.0


# ---------------------------------------------------------------------------- client


def parse_chunk(stream: Stream, line: str, now: float) -> bool:
    """Record one SSE line of a chat completion stream; True at ``[DONE]``."""
    line = line.strip()
    if not line.startswith("data:"):
        return False
    data = line[5:].strip()
    if data == "[DONE]":
        return True
    chunk = json.loads(data)
    if usage := chunk.get("usage"):
        stream.usage_tokens = int(usage["completion_tokens"])
    for choice in chunk.get("choices") or []:
        text = (choice.get("delta") or {}).get("content") or ""
        if text:
            stream.first = now if stream.first is None else stream.first
            stream.last = now
            stream.chunks += 1
            stream.text += text
        if choice.get("finish_reason"):
            stream.finish = choice["finish_reason"]
    return False


async def stream_chat(
    client: httpx.AsyncClient, base_url: str, content: str, max_tokens: int, **extra: Any
) -> Stream:
    body = {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    stream = Stream(send=time.perf_counter())
    try:
        async with client.stream("POST", f"{base_url}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                stream.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            else:
                async for line in r.aiter_lines():
                    if parse_chunk(stream, line, time.perf_counter()):
                        break
    except httpx.HTTPError as e:
        stream.error = f"{type(e).__name__}: {e}"
    stream.end = time.perf_counter()
    stream.tokens = stream.usage_tokens or 0
    return stream


async def count_tokens(
    client: httpx.AsyncClient, base_url: str, stream: Stream, max_tokens: int
) -> None:
    """A stream without usage (llama.cpp): ``max_tokens`` where it stopped for length, else
    its text's tokens by the server's tokenizer (``/extras/tokenize``, less what it returns
    for an empty text: a BOS where the vocabulary adds one)."""
    if stream.usage_tokens is not None or not stream.text:
        return
    if stream.finish == "length":
        stream.tokens = max_tokens
        return
    counts = []
    for text in (stream.text, ""):
        r = await client.post(f"{base_url}/extras/tokenize", json={"input": text})
        r.raise_for_status()
        counts.append(len(r.json()["tokens"]))
    stream.tokens = counts[0] - counts[1]


async def spec_counters(client: httpx.AsyncClient, base_url: str) -> tuple[float, float] | None:
    """(drafted, accepted) token counters from /metrics; None where the server has none."""
    with contextlib.suppress(httpx.HTTPError):
        r = await client.get(f"{base_url}/metrics")
        if r.status_code == 200:
            return metric_sum(r.text, DRAFTED), metric_sum(r.text, ACCEPTED)
    return None


def metric_sum(text: str, name: str) -> float:
    """The sum of a Prometheus counter over its label sets."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(maxsplit=1)[-1])
    return total


def _client() -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600.0, connect=30.0))


async def bench_workloads(
    base_url: str,
    label: str,
    names: list[str],
    requests: int,
    max_tokens: int,
    extra: dict[str, Any] | None = None,
) -> dict[str, WorkloadResult]:
    """Every workload's requests, one at a time; ``extra`` joins every request body."""
    extra = extra or {}
    async with _client() as client:
        warm = await stream_chat(client, base_url, "Say hello.", 16, **extra)
        if warm.error:
            bs._progress(f"[{label}] warm-up failed: {warm.error}")
        out = {}
        for name in names:
            before = await spec_counters(client, base_url)
            streams = []
            for prompt in WORKLOADS[name][:requests]:
                mark = await spec_counters(client, base_url)
                stream = await stream_chat(client, base_url, prompt, max_tokens, **extra)
                await count_tokens(client, base_url, stream, max_tokens)
                if mark is not None and (now := await spec_counters(client, base_url)):
                    stream.drafted, stream.accepted = now[0] - mark[0], now[1] - mark[1]
                if stream.error:
                    bs._progress(f"[{label}] {name}: {stream.error}")
                streams.append(stream)
            after = await spec_counters(client, base_url)
            result = WorkloadResult(streams)
            if before is not None and after is not None:
                result.drafted, result.accepted = after[0] - before[0], after[1] - before[1]
            out[name] = result
            bs._progress(f"[{label}] {name}: {_fmt(result.rate())} tok/s, {_accept(result)}")
        return out


async def bench_throughput(
    base_url: str, label: str, requests: int, concurrency: int, max_tokens: int
) -> Throughput:
    prompts = throughput_prompts(requests)
    async with _client() as client:
        # warm-up: a burst of short requests (the batched shapes' first steps)
        await asyncio.gather(
            *(stream_chat(client, base_url, p, 8, ignore_eos=True) for p in prompts[:concurrency])
        )
        before = await spec_counters(client, base_url)
        gate = asyncio.Semaphore(concurrency)

        async def one(prompt: str) -> Stream:
            async with gate:
                return await stream_chat(client, base_url, prompt, max_tokens, ignore_eos=True)

        streams = await asyncio.gather(*(one(p) for p in prompts))
        after = await spec_counters(client, base_url)
    ok = [s for s in streams if s.error is None]
    tokens = sum(s.tokens for s in ok)
    span = max(s.end for s in streams) - min(s.send for s in streams)
    result = Throughput(tokens / span, tokens, len(streams) - len(ok), span)
    if before is not None and after is not None:
        result.drafted, result.accepted = after[0] - before[0], after[1] - before[1]
    bs._progress(f"[{label}] throughput: {result.tok_s:.1f} tok/s ({result.failed} failed)")
    return result


# ---------------------------------------------------------------------------- servers


@contextlib.contextmanager
def llama_server(python: str, flags: list[str], label: str, timeout: float) -> Iterator[str]:
    """llama-cpp-python's server on a free port; yields its base URL once /v1/models
    answers, always stops it."""
    port = bs._free_port()
    command = [python, "-m", "llama_cpp.server", *flags, "--host", "127.0.0.1"]
    command += ["--port", str(port)]
    prefix = "bench_spec_llama_"
    with tempfile.NamedTemporaryFile(prefix=prefix, suffix=".log", delete=False) as log:
        bs._progress(f"launching {label} on port {port} (log: {log.name})")
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + timeout
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{label} exited:\n{bs._tail(Path(log.name))}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{label} not ready:\n{bs._tail(Path(log.name))}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/v1/models", timeout=5.0).status_code == 200:
                        break
                time.sleep(0.5)
            yield url
        finally:
            bs._stop(proc)
            bs._progress(f"{label} stopped")


def run_infer(
    args: argparse.Namespace, label: str, spec: dict[str, Any] | None, workloads: bool
) -> ServerRun:
    flags = [*args.server_arg]
    if spec is None:
        flags += ["--speculative-config", "none"]
    elif spec is not DEFAULT:
        flags += ["--speculative-config", json.dumps(spec)]
    quoted = spec is not None and spec is not DEFAULT
    shown = " ".join([*flags[:-1], f"'{flags[-1]}'"]) if quoted else " ".join(flags)
    run = ServerRun(label, f"infer serve {shown}".strip())
    start = time.monotonic()
    with bs.serve_process(flags, label.replace(" ", "-"), args.startup_timeout) as (url, _):
        if workloads:
            run.workloads = asyncio.run(
                bench_workloads(url, label, args.workloads, args.requests, args.max_tokens)
            )
        if args.throughput:
            run.throughput = asyncio.run(
                bench_throughput(
                    url, label, args.tp_requests, args.tp_concurrency, args.tp_max_tokens
                )
            )
    run.seconds = time.monotonic() - start
    return run


def has_llama_cpp(python: str) -> bool:
    check = [python, "-c", "import llama_cpp.server"]
    with contextlib.suppress(OSError):
        return subprocess.run(check, capture_output=True).returncode == 0
    return False


def run_llama(args: argparse.Namespace, label: str, lookup: int | None) -> ServerRun:
    flags = ["--model", args.model, "--n_threads", str(args.llama_threads)]
    flags += ["--n_ctx", "2048", "--interrupt_requests", "false"]
    if lookup is not None:
        flags += ["--draft_model", "prompt-lookup-decoding"]
        flags += ["--draft_model_num_pred_tokens", str(lookup)]
    run = ServerRun(label, "python -m llama_cpp.server " + " ".join(flags))
    start = time.monotonic()
    with llama_server(args.llama_python, flags, label, args.startup_timeout) as url:
        run.workloads = asyncio.run(
            bench_workloads(
                url, label, args.workloads, args.llama_requests, args.max_tokens, LLAMA_GREEDY
            )
        )
    run.seconds = time.monotonic() - start
    return run


# ---------------------------------------------------------------------------- report


def _fmt(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{x:,.{digits}f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "–" if a is None or not b else f"{a / b:.2f}×"


def _request_cell(s: Stream) -> str:
    """A request's tok/s, and its acceptance where it drafted."""
    if s.drafted:
        return f"{_fmt(s.rate(), 0)} ({(s.accepted or 0) / s.drafted:.0%})"
    return _fmt(s.rate(), 0)


def _accept(w: WorkloadResult | Throughput) -> str:
    if w.drafted is None or w.accepted is None:
        return "–"
    if not w.drafted:
        return "0 drafted"
    return f"{w.accepted / w.drafted:.0%} ({w.accepted:.0f}/{w.drafted:.0f})"


def same_texts(a: WorkloadResult, b: WorkloadResult) -> str:
    """How many of the requests gave the same text; the first difference of the others."""
    pairs = list(zip(a.streams, b.streams, strict=False))
    same = sum(x.text == y.text for x, y in pairs)
    out = f"{same}/{len(pairs)}"
    for x, y in pairs:
        if x.text != y.text:
            i = first_difference(x.text, y.text)
            out += f" (differs at char {i})"
            break
    return out


def first_difference(a: str, b: str) -> int:
    for i, (p, q) in enumerate(zip(a, b, strict=False)):
        if p != q:
            return i
    return min(len(a), len(b))


def report(args: argparse.Namespace, runs: list[ServerRun]) -> str:
    by = {r.label: r for r in runs}
    base = by.get("infer plain")
    llama = [r for r in runs if r.label.startswith("llama.cpp")]
    lines = []
    if any(r.workloads for r in runs):
        lines = ["## single stream: output tok/s (median of requests), tokens, acceptance\n"]
        head = "| workload | server | output tok/s | per request (acceptance)"
        head += " | completion tokens | acceptance | vs infer plain | vs llama.cpp best"
        lines += [head + " | same text as |", "|---" * 9 + "|"]
    for name in args.workloads if lines else []:
        best = max(
            (r.workloads[name].rate() or 0.0 for r in llama if name in r.workloads), default=0.0
        )
        for run in runs:
            w = run.workloads.get(name)
            if w is None:
                continue
            tokens = ", ".join(str(s.tokens) for s in w.streams)
            ref = base.workloads.get(name) if base else None
            # the texts against those of the same server without speculation (llama.cpp's
            # plain ones against infer's)
            twin = by.get("llama.cpp") if run.label.startswith("llama.cpp lookup") else base
            twin_w = twin.workloads.get(name) if twin and twin is not run else None
            each = ", ".join(_request_cell(s) for s in w.streams)
            cells = [name, run.label, _fmt(w.rate()), each, tokens, _accept(w)]
            cells += [_ratio(w.rate(), ref.rate() if ref else None), _ratio(w.rate(), best)]
            same = f"{twin.label}: {same_texts(w, twin_w)}" if twin and twin_w else "–"
            cells.append(same)
            lines.append("| " + " | ".join(cells) + " |")
    if any(r.throughput for r in runs):
        lines += ["\n## throughput: output tok/s at the concurrency above\n"]
        lines += ["| server | output tok/s | vs infer plain | tokens | failed | acceptance |"]
        lines += ["|---|---|---|---|---|---|"]
        ref_tp = base.throughput.tok_s if base and base.throughput else None
        for run in runs:
            if (t := run.throughput) is None:
                continue
            cells = [run.label, _fmt(t.tok_s), _ratio(t.tok_s, ref_tp), str(t.tokens)]
            cells += [str(t.failed), _accept(t)]
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["\n## servers\n"]
    lines += [f"- {r.label}: `{r.command}` ({r.seconds:.0f} s)" for r in runs]
    return "\n".join(lines)


def texts(runs: list[ServerRun]) -> dict[str, Any]:
    """Every request's text, tokens, rate and drafts, per server and workload."""
    return {
        run.label: {
            name: [
                {
                    "text": s.text,
                    "tokens": s.tokens,
                    "tok_s": s.rate(),
                    "drafted": s.drafted,
                    "accepted": s.accepted,
                    "finish": s.finish,
                }
                for s in w.streams
            ]
            for name, w in run.workloads.items()
        }
        for run in runs
    }


def _spec(text: str) -> tuple[str, dict[str, Any]]:
    label, _, config = text.partition("=")
    if not label or not config:
        raise argparse.ArgumentTypeError(f"expected LABEL=JSON, got {text}")
    return label, json.loads(config)


def header(args: argparse.Namespace) -> str:
    cpuinfo = ""
    with contextlib.suppress(OSError):
        cpuinfo = Path("/proc/cpuinfo").read_text()
    flags = ", ".join(isa_flags(cpuinfo)) or "none"
    llama = "skipped"
    if args.llama_python:
        version = subprocess.run(
            [args.llama_python, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        llama = f"llama-cpp-python {version or '?'} ({args.llama_python})"
    return "\n".join(
        [
            "# bench_speculative\n",
            bs.machine_line(),
            f"CPU: {cpu_model(cpuinfo)}; ISA: {flags}",
            f"model: {args.model}; peer: {llama}",
            f"single stream: /v1/chat/completions, greedy, streamed, max_tokens "
            f"{args.max_tokens}, {args.requests} requests per workload (llama.cpp "
            f"{args.llama_requests}), one after another",
            f"throughput: {args.tp_requests} open chat prompts, at most {args.tp_concurrency} "
            f"in flight, max_tokens {args.tp_max_tokens}, ignore_eos",
            "",
        ]
    )


# ---------------------------------------------------------------------------- main


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--llama-python",
        default=None,
        help=f"a python with llama-cpp-python[server] (default: {DEFAULT_LLAMA_PYTHON} if it "
        "has it, else the peer is skipped with a note)",
    )
    p.add_argument("--model", default=None, help="the GGUF llama.cpp loads (default: ours)")
    p.add_argument("--workloads", type=bs._choices(set(WORKLOADS)), default=list(WORKLOADS))
    p.add_argument("--requests", type=int, default=3, help="per workload, at most 3")
    p.add_argument("--llama-requests", type=int, default=3, help="per workload, llama.cpp")
    p.add_argument("--llama-threads", type=int, default=os.cpu_count() or 1)
    p.add_argument(
        "--llama-lookup",
        type=bs._ints,
        default="10,4",
        help="prompt lookup's num_pred_tokens, one llama.cpp server each (default: 10, its "
        "default, and 4, our k; empty: none)",
    )
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument(
        "--extra-spec",
        type=_spec,
        action="append",
        default=[],
        help="LABEL=JSON: one more infer server with --speculative-config JSON, after suffix "
        """(repeatable), e.g. 'ngram-k3={"method": "ngram", "num_speculative_tokens": 3}'""",
    )
    p.add_argument("--texts-json", default=None, help="write every request's text here")
    p.add_argument("--no-throughput", dest="throughput", action="store_false")
    p.add_argument("--no-bs8", dest="bs8", action="store_false")
    p.add_argument("--no-suffix", dest="suffix", action="store_false")
    p.add_argument(
        "--no-ngram", dest="ngram", action="store_false", help="skip infer ngram (k = 4)"
    )
    p.add_argument(
        "--only-throughput",
        action="store_true",
        help="the infer servers' throughput alone (no single-stream workloads, no llama.cpp)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every infer server this many times, alternating their order (llama.cpp's "
        "run every round after them); prints each round and the median ratios",
    )
    p.add_argument("--tp-requests", type=int, default=128)
    p.add_argument("--tp-concurrency", type=int, default=64)
    p.add_argument("--tp-max-tokens", type=int, default=128)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra `infer serve` argument for every infer server (repeatable)",
    )
    args = p.parse_args(argv)
    if args.llama_python is None and Path(DEFAULT_LLAMA_PYTHON).exists():
        args.llama_python = DEFAULT_LLAMA_PYTHON
    if args.llama_python and not has_llama_cpp(args.llama_python):
        print(f"llama.cpp skipped: no llama_cpp.server in {args.llama_python}", file=sys.stderr)
        args.llama_python = None
    args.model = args.model or default_model()
    return args


def infer_configs(args: argparse.Namespace) -> list[tuple[str, dict[str, Any] | None, bool]]:
    """(label, --speculative-config, runs the workloads) of every infer server, in order."""
    workloads = not args.only_throughput
    configs: list[tuple[str, dict[str, Any] | None, bool]] = [
        ("infer plain", None, workloads),
        ("infer default", DEFAULT, workloads),
    ]
    if args.ngram:
        configs.append(("infer ngram", NGRAM, workloads))
    if args.suffix:
        configs.append(("infer suffix", SUFFIX, workloads))
    configs += [(f"infer {label}", spec, workloads) for label, spec in args.extra_spec]
    if args.throughput and args.bs8:
        configs.append(("infer ngram bs8", NGRAM_BS8, False))
    return configs


def one_round(args: argparse.Namespace, reverse: bool) -> list[ServerRun]:
    """Every infer server once (in reverse order on odd rounds, so that a drift of the
    machine's speed does not always favour the same side), then llama.cpp's."""
    configs = infer_configs(args)
    done = {
        label: run_infer(args, label, spec, workloads)
        for label, spec, workloads in (configs[::-1] if reverse else configs)
    }
    runs = [done[label] for label, _, _ in configs]
    if args.llama_python and not args.only_throughput:
        runs.append(run_llama(args, "llama.cpp", None))
        for n in args.llama_lookup:
            runs.append(run_llama(args, f"llama.cpp lookup {n}", n))
    return runs


def rounds_summary(rounds: list[list[ServerRun]]) -> str:
    """Markdown: each speculating server's rate / infer default's of the same round, per
    round and their median (single-stream workloads and throughput)."""
    lines = ["| server | measure | / infer plain per round | median |", "|---|---|---|---|"]
    bases = [next(r for r in runs if r.label == "infer plain") for runs in rounds]
    for run in rounds[0]:
        if not run.label.startswith("infer") or run.label == "infer plain":
            continue
        measures = [*run.workloads, *(["throughput"] if run.throughput else [])]
        for measure in measures:
            ratios = []
            for runs, base in zip(rounds, bases, strict=True):
                this = next(r for r in runs if r.label == run.label)
                if measure == "throughput":
                    a = this.throughput.tok_s if this.throughput else None
                    b = base.throughput.tok_s if base.throughput else None
                else:
                    a, b = this.workloads[measure].rate(), base.workloads[measure].rate()
                if a is not None and b:
                    ratios.append(a / b)
            if ratios:
                each = ", ".join(f"{r:.2f}" for r in ratios)
                lines.append(
                    f"| {run.label} | {measure} | {each} | {statistics.median(ratios):.2f}× |"
                )
    return "\n".join(lines)


def main() -> None:
    args = _args()
    print(header(args), flush=True)
    if not args.llama_python:
        print("llama.cpp: skipped (no llama-cpp-python: pass --llama-python)\n")
    start = time.monotonic()
    rounds = []
    for i in range(args.rounds):
        runs = one_round(args, reverse=i % 2 == 1)
        if args.rounds > 1:
            print(f"\n# round {i + 1} of {args.rounds}\n")
        print(report(args, runs), flush=True)
        rounds.append(runs)
    if args.rounds > 1:
        print("\n# every round\n\n" + rounds_summary(rounds))
    if args.texts_json:
        out = [texts(runs) for runs in rounds]
        Path(args.texts_json).write_text(json.dumps(out[0] if len(out) == 1 else out, indent=1))
    print(f"\ntotal: {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()
