"""Runtime LoRA on `infer serve --enable-lora` (issue 47, item 8): how long
``POST /v1/load_lora_adapter`` takes, the first request's latency on the freshly loaded
adapter against the same request on the base model (and on the adapter once warm), and
``/v1/unload_lora_adapter``; the server's RSS before the load, after it and after the unload.

The adapter is a PEFT folder written here for the default model (random A, B = 0.01 * random:
the output changes, the cost is a trained adapter's), on every attention and MLP projection
at ``--rank``. Each step is timed ``--rounds`` times (a new adapter name each round).

    python benchmarks/bench_runtime_lora.py [--rank 16] [--rounds 5]
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import httpx  # noqa: E402

from adapters.torch.lora.peft import ADAPTER_WEIGHTS  # noqa: E402
from adapters.weights.resolve import resolve_model  # noqa: E402
from benchmarks.bench_serving import machine_line, serve_process  # noqa: E402
from tests.support.peft_adapters import random_adapter  # noqa: E402


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def timed(client: httpx.Client, method: str, url: str, **kwargs: object) -> float:
    start = time.perf_counter()
    reply = client.request(method, url, **kwargs)  # type: ignore[arg-type]
    elapsed = (time.perf_counter() - start) * 1000
    reply.raise_for_status()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--startup-timeout", type=float, default=600)
    args = parser.parse_args()
    model = resolve_model(None, progress=False).path
    rows: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        folders = []
        for i in range(args.rounds):
            folder = Path(scratch) / f"adapter-{i}"
            random_adapter(folder, model, args.rank, seed=i)
            folders.append(folder)
        size_mib = (folders[0] / ADAPTER_WEIGHTS).stat().st_size / 2**20
        with serve_process(["--enable-lora"], "runtime_lora", args.startup_timeout) as (url, proc):
            client = httpx.Client(base_url=url, timeout=120)
            body = {"prompt": "The bakery opens at", "max_tokens": 8, "temperature": 0}
            model_name = client.get("/v1/models").json()["data"][0]["id"]
            timed(client, "POST", "/v1/completions", json={**body, "model": model_name})
            for i, folder in enumerate(folders):
                name = f"lora-{i}"
                before = rss_mib(proc.pid)
                rows.setdefault("load (ms)", []).append(
                    timed(
                        client,
                        "POST",
                        "/v1/load_lora_adapter",
                        json={"lora_name": name, "lora_path": str(folder)},
                    )
                )
                loaded = rss_mib(proc.pid)
                rows.setdefault("base request (ms)", []).append(
                    timed(client, "POST", "/v1/completions", json={**body, "model": model_name})
                )
                rows.setdefault("first request on it (ms)", []).append(
                    timed(client, "POST", "/v1/completions", json={**body, "model": name})
                )
                rows.setdefault("next request on it (ms)", []).append(
                    timed(client, "POST", "/v1/completions", json={**body, "model": name})
                )
                rows.setdefault("unload (ms)", []).append(
                    timed(client, "POST", "/v1/unload_lora_adapter", json={"lora_name": name})
                )
                rows.setdefault("RSS added by the load (MiB)", []).append(loaded - before)
                rows.setdefault("RSS after the unload - before (MiB)", []).append(
                    rss_mib(proc.pid) - before
                )
    print(f"## Runtime LoRA: {machine_line()}")
    print()
    print(
        f"`infer serve --enable-lora` (defaults otherwise), rank-{args.rank} adapter on all 7 "
        f"projections ({size_mib:.1f} MiB of float32), 8 greedy tokens, {args.rounds} rounds "
        "(median, min-max):"
    )
    print()
    print("| step | median | min | max |")
    print("|---|---|---|---|")
    for label, values in rows.items():
        print(
            f"| {label} | {statistics.median(values):.1f} | {min(values):.1f} | {max(values):.1f} |"
        )


if __name__ == "__main__":
    main()
