"""The cost of operations features: serving throughput and TTFT with everything on (an API
keys file with limits checked on every request, Prometheus metrics, OpenTelemetry traces
exported to an OTLP/HTTP receiver this script runs, the canonical log line) against
everything off, side by side on the same machine, alternating which goes first each round.

The target (issue 13): "on" keeps >= 0.95x the output throughput of "off" and a TTFT p50
within 5 %, at c=16 and c=64. Usage (fp32: the dtype this CPU serves fastest):

    .venv/bin/python benchmarks/bench_ops.py --dtype float32 --rounds 3 \\
        [--concurrency 16,64] [--sweep-output-len 64] [--result-json ops.json]
"""

import argparse
import json
import multiprocessing
import statistics
import sys
import tempfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from application.access.keys import hash_key
from benchmarks import bench_serving as bs

KEY = "sk-bench"


class _Receiver(BaseHTTPRequestHandler):
    """An OTLP/HTTP endpoint that accepts exports."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--model", default=None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", default="16,64")
    p.add_argument("--sweep-requests-per-concurrency", default="1")
    p.add_argument("--sweep-output-len", default="64")
    p.add_argument("--result-json", default=None)
    args = p.parse_args()

    # The receiver runs in a process of its own: in this one, its thread would take the
    # GIL from the load generator that timestamps every token.
    receiver = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    process = multiprocessing.get_context("fork").Process(
        target=receiver.serve_forever, daemon=True
    )
    process.start()
    folder = Path(tempfile.mkdtemp(prefix="bench_ops_"))
    keys = folder / "keys.json"
    tenant = {
        "id": "bench",
        "keys": [hash_key(KEY)],
        "requests_per_second": 100_000,
        "tokens_per_minute": 1_000_000_000,
        "max_concurrent_streams": 100_000,
    }
    keys.write_text(json.dumps({"tenants": [tenant]}))
    on = [
        "--api-keys-file",
        str(keys),
        "--otlp-traces-endpoint",
        f"http://127.0.0.1:{receiver.server_address[1]}",
    ]
    off = ["--disable-metrics", "--disable-log-requests", "--disable-uvicorn-access-log"]
    base = [
        "--dtype",
        args.dtype,
        "--workloads",
        "sweep",
        "--modes",
        "continuous",
        "--concurrency",
        args.concurrency,
        "--no-baseline",
        "--sweep-requests-per-concurrency",
        args.sweep_requests_per_concurrency,
        "--sweep-output-len",
        args.sweep_output_len,
        *(["--model", args.model] if args.model else []),
    ]
    configs = {"off": (off, None), "on": (on, KEY)}
    rounds: list[dict[str, dict[str, Any]]] = []
    for r in range(args.rounds):
        order = ["off", "on"] if r % 2 == 0 else ["on", "off"]
        results = {}
        for name in order:
            flags, key = configs[name]
            bench_args = bs._args(
                [
                    *base,
                    *(f"--server-arg={f}" for f in flags),
                    *(["--api-key", key] if key else []),
                ]
            )
            vocab = bench_args.vocab_size or _vocab(bench_args)
            workloads = bs.build_workloads(bench_args, vocab)
            with bs.launched_server(bench_args, "continuous") as url:
                results[name] = bs._bench(url, bench_args, workloads, name)
        rounds.append(results)
        _print_round(r + 1, results)
    summary = _summary(rounds)
    print(f"\nmachine: {bs.machine_line()}")
    print("| workload | on/off output tok/s (median of rounds) | on/off TTFT p50 |")
    print("|---|---|---|")
    for name, (throughput, ttft) in summary.items():
        print(f"| {name} | {throughput:.3f}x | {ttft:.3f}x |")
    if args.result_json:
        Path(args.result_json).write_text(
            json.dumps(
                {"machine": bs.machine_line(), "rounds": rounds, "summary": summary},
                indent=2,
                default=str,
            )
            + "\n"
        )
    process.terminate()


def _vocab(bench_args: argparse.Namespace) -> int:
    from entrypoints.config import ServerConfig
    from entrypoints.container import create_container

    config = ServerConfig.for_model(bench_args.model, dtype=bench_args.dtype)
    return bs._tokenizer_vocab(create_container(config))


def _print_round(r: int, results: dict[str, dict[str, Any]]) -> None:
    for name, result in results.items():
        cells = [
            f"{w}: {s['output_throughput']:.1f} tok/s, TTFT p50 {s['ttft_ms']['p50']:.0f} ms"
            for w, s in result.items()
        ]
        print(f"round {r} {name}: " + "; ".join(cells), flush=True)


def _summary(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, tuple[float, float]]:
    out = {}
    for workload in rounds[0]["off"]:
        throughput = [
            r["on"][workload]["output_throughput"] / r["off"][workload]["output_throughput"]
            for r in rounds
        ]
        ttft = [
            r["on"][workload]["ttft_ms"]["p50"] / r["off"][workload]["ttft_ms"]["p50"]
            for r in rounds
        ]
        out[workload] = (statistics.median(throughput), statistics.median(ttft))
    return out


if __name__ == "__main__":
    main()
