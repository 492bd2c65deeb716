"""Where a short chat's first token goes: ``infer serve`` (no flags) profiled from the
socket to the first SSE byte carrying a token, stage by stage, beside llama.cpp's
``llama-server`` answering the same chats (its TTFT only: it is not instrumented).

The server runs in a child process with timing probes wrapped around the functions each
stage runs (probes cost ~1 us each; nothing else changes): the socket read and HTTP parse
(uvicorn's h11 protocol), the ASGI app, auth, the chat template, tokenizing, the engine's
admission, the wait for a step, scheduling, the forward (prefill), sampling, detokenizing
and stop checks, and the hand-offs to the first SSE write. Both processes read
CLOCK_MONOTONIC, so the child's stamps sit on the client's time line: 0 is the client's
send. Each of ``--chats`` distinct chats (a short question each, sent one at a time over a
new connection, streamed, ``max_tokens`` 8) is profiled; the table gives each stage's
median start and duration and the share of the first token's time.

    python benchmarks/bench_first_token.py [--chats 30] [--no-llama-server]
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import bench_serving as bs  # noqa: E402

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "How many legs does a spider have?",
    "What does a thermometer measure?",
    "Give me a synonym for happy.",
    "Which planet is closest to the sun?",
    "What is two plus two?",
    "Who wrote Romeo and Juliet?",
    "What gas do plants breathe in?",
    "How many days are in a week?",
]
PROBE_ENV = "INFER_FIRST_TOKEN_PROBE"
TIMELINE: list[tuple[str, float, float]] = []  # the last chat's stamps: label, start, ms
Spans = dict[str, list[tuple[float, float]]]  # stage -> (start, duration) per chat, ms

# Stages in the order a request meets them: (label, module, qualified name).
PROBES = [
    ("HTTP read + parse (h11)", "adapters.http.uvicorn_server", "GuardedH11Protocol.data_received"),
    (
        "ASGI app (routing, middleware, handler)",
        "adapters.observability.http",
        "ObservedApp.__call__",
    ),
    ("auth (API key)", "adapters.http.auth", "ApiKeyGuard.resolve"),
    (
        "chat template + tokenize (thread pool)",
        "application.engine.input_processor",
        "InputProcessor.render_chat",
    ),
    ("chat template (jinja)", "jinja2.environment", "Template.render"),
    ("tokenize", "adapters.hf_tokenizer.tokenizer", "_PlainTextTwin.encode_marked"),
    ("admit (checks, queue)", "application.engine.async_engine", "AsyncEngine.submit"),
    ("engine step", "application.engine.engine", "Engine.step"),
    ("schedule", "domain.scheduler.continuous", "ContinuousScheduler.schedule"),
    ("forward (prefill)", "adapters.torch.runtime.runner", "TorchModelRunner._forward"),
    ("sample", "adapters.torch.runtime.runner", "TorchModelRunner._sample"),
    ("detokenize + stop checks", "application.engine.output", "OutputProcessor.process"),
    ("speculation (next drafts)", "application.engine.speculation", "Speculator.propose"),
]


# --- the child: probes installed, then `infer serve` ---------------------------------


def _install_probes(out: Path) -> None:
    import functools
    import importlib
    import inspect

    events: list[tuple[str, float, float]] = []

    def wrap(label: str, owner: Any, name: str) -> None:
        fn = getattr(owner, name)
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def timed_async(*args: Any, **kwargs: Any) -> Any:
                start = time.monotonic()
                try:
                    return await fn(*args, **kwargs)
                finally:
                    events.append((label, start, time.monotonic()))

            setattr(owner, name, timed_async)
            return

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.monotonic()
            try:
                return fn(*args, **kwargs)
            finally:
                events.append((label, start, time.monotonic()))

        setattr(owner, name, timed)

    for label, module, qualname in PROBES:
        owner_name, name = qualname.rsplit(".", 1)
        owner: Any = importlib.import_module(module)
        for part in owner_name.split("."):
            owner = getattr(owner, part)
        wrap(label, owner, name)

    from adapters.observability.http import ObservedApp

    call = ObservedApp.__call__

    async def observed(self: Any, scope: dict[str, Any], receive: Any, send: Any) -> None:
        sent = False

        async def send_probed(message: dict[str, Any]) -> None:
            nonlocal sent
            body = message.get("body", b"")
            if not sent and message["type"] == "http.response.body" and b'"content":"' in body:
                sent = True
                start = time.monotonic()
                await send(message)
                events.append(("first token's SSE write", start, time.monotonic()))
                with out.open("a") as f:
                    f.write(json.dumps(events) + "\n")
                events.clear()
                return
            await send(message)

        await call(self, scope, receive, send_probed)

    ObservedApp.__call__ = observed  # type: ignore[method-assign]


def _child(argv: list[str]) -> int:
    _install_probes(Path(os.environ[PROBE_ENV]))
    from entrypoints.cli import main

    return main(["serve", *argv])


# --- the client ----------------------------------------------------------------------


def _model_id(port: int) -> str:
    import httpx

    return str(httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"][0]["id"])


def _chat(port: int, model: str, question: str) -> tuple[float, float, float]:
    """One streamed chat over a new connection: (send, first byte, first token) on the
    monotonic clock."""
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": question}],
            "max_tokens": 8,
            "temperature": 0.0,
            "stream": True,
        }
    ).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sent = time.monotonic()
        s.sendall(head + body)
        first_byte = first_token = 0.0
        seen = b""
        while not first_token:
            chunk = s.recv(65536)
            if not chunk:
                break
            now = time.monotonic()
            first_byte = first_byte or now
            seen += chunk
            if b'"content":"' in seen.split(b"\r\n\r\n", 1)[-1]:
                first_token = now
        while s.recv(65536):  # the rest of the stream: nothing runs into the next chat
            pass
    return sent, first_byte, first_token


def _probed(probe: Path, count: int, timeout: float = 10.0) -> list[list[Any]]:
    """The server's ``count``-th line of stamps, once written whole."""
    deadline = time.monotonic() + timeout
    while True:
        lines = probe.read_text().splitlines() if probe.exists() else []
        if len(lines) >= count:
            try:
                return list(json.loads(lines[count - 1]))
            except ValueError:
                pass  # being written
        if time.monotonic() > deadline:
            return []
        time.sleep(0.01)


def _serve(cmd: list[str], env: dict[str, str], port: int, log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
    bs._wait_healthy(proc, f"http://127.0.0.1:{port}", 600, log)
    return proc


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _profile_infer(chats: int, workdir: Path) -> tuple[list[float], Spans]:
    port = bs._free_port()
    probe = workdir / "probe.jsonl"
    env = {**os.environ, PROBE_ENV: str(probe)}
    cmd = [sys.executable, __file__, "--child", "--host", "127.0.0.1", "--port", str(port)]
    proc = _serve(cmd, env, port, workdir / "infer.log")
    ttfts: list[float] = []
    stages: Spans = defaultdict(list)
    try:
        model = _model_id(port)
        _chat(port, model, "Warm up.")  # the first request's one-off costs are not the profile
        _probed(probe, 1)  # its stamps written whole, then dropped
        probe.write_text("")
        for i in range(chats):
            question = f"{QUESTIONS[i % len(QUESTIONS)]} ({i})"
            sent, _, first = _chat(port, model, question)
            ttfts.append((first - sent) * 1e3)
            events = _probed(probe, i + 1)
            if i == chats - 1:  # the last chat's every stamp, in order
                TIMELINE[:] = [(label, (a - sent) * 1e3, (b - a) * 1e3) for label, a, b in events]
            firsts: dict[str, tuple[float, float]] = {}
            for label, start, end in events:
                if start >= sent and label not in firsts:  # a stage's first call for it
                    firsts[label] = ((start - sent) * 1e3, (end - start) * 1e3)
            for label, span in firsts.items():
                stages[label].append(span)
    finally:
        bs._stop(proc)
    return ttfts, stages


def _llama_server_ttft(chats: int, workdir: Path) -> list[float]:
    from benchmarks.bench_vs_llamacpp import default_model
    from benchmarks.llama_server import build

    binary = build() / "bin" / "llama-server"
    port = bs._free_port()
    threads = str(os.cpu_count() or 1)
    cmd = [str(binary), "-m", str(default_model()), "--port", str(port), "--host", "127.0.0.1"]
    cmd += ["-np", "64", "-c", "65536", "-t", threads, "--no-webui"]
    proc = _serve(cmd, dict(os.environ), port, workdir / "llama-server.log")
    out = []
    try:
        model = _model_id(port)
        _chat(port, model, "Warm up.")
        for i in range(chats):
            sent, _, first = _chat(port, model, f"{QUESTIONS[i % len(QUESTIONS)]} ({i})")
            out.append((first - sent) * 1e3)
    finally:
        bs._stop(proc)
    return out


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        return _child(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chats", type=int, default=30)
    p.add_argument("--no-llama-server", action="store_true")
    p.add_argument("--timeline", action="store_true", help="also the last chat's every stamp")
    args = p.parse_args()
    from benchmarks.bench_vs_llamacpp import cpu_line
    from benchmarks.llama_server import read_cpuinfo

    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        ttfts, stages = _profile_infer(args.chats, workdir)
        theirs = [] if args.no_llama_server else _llama_server_ttft(args.chats, workdir)
    total = _median(ttfts)
    print("# first token: one short chat at a time, streamed (max_tokens 8, temperature 0)\n")
    print(
        f"CPU: {cpu_line(read_cpuinfo())}; {args.chats} chats; medians; 0 ms = the client's send\n"
    )
    print("| stage | starts at ms | takes ms | share of TTFT |")
    print("|---|---:|---:|---:|")

    def order(label: str) -> float:
        return _median([s for s, _ in stages[label]])

    for label in sorted(stages, key=order):
        start = _median([s for s, _ in stages[label]])
        took = _median([d for _, d in stages[label]])
        print(f"| {label} | {start:.2f} | {took:.2f} | {took / total:.0%} |")
    print(f"| **infer serve: first token at the client** | | **{total:.1f}** | |")
    if args.timeline:
        print("\nthe last chat, every stamp: start ms, took ms, stage")
        for label, start, took in sorted(TIMELINE, key=lambda e: e[1]):
            print(f"  {start:8.2f} {took:7.2f}  {label}")
    if theirs:
        print(f"| **llama-server: first token at the client** | | **{_median(theirs):.1f}** | |")
        print(f"\nratio TTFT infer / llama-server: {total / _median(theirs):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
