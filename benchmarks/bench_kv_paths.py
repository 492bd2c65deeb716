"""Decode speed of this tree's KV path against another tree's, side by side in one run.

Issue 15's decode target: the paged KV cache decodes at >= 0.95x the contiguous slot cache
it replaced, at 64 concurrent streams and at one. ``--base`` is a checkout of the code to
compare with (e.g. ``git worktree add /tmp/base <commit before the paged KV>``); each side
runs in its own subprocess with the same model, dtype, threads and workload, alternating
rounds so a drift of the machine's speed hits both alike. Measured per side: decode
tokens per second over the engine steps that run only decode rows (prefill excluded),
with ``c`` requests of ``--prompt-tokens`` random ids each generating ``--output-tokens``
(``ignore_eos``). Reported: the median over rounds and the ratio this / base.

Usage:
    .venv/bin/python benchmarks/bench_kv_paths.py --base /tmp/base \\
        [--concurrency 1,64] [--rounds 3] [--prompt-tokens 256] [--output-tokens 128] \\
        [--dtype float32] [--model HuggingFaceTB/SmolLM2-135M-Instruct]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))


def worker(args: argparse.Namespace) -> None:
    """In the tree on ``sys.path``: one measurement, printed as JSON."""
    import random

    import torch

    from adapters.torch.runtime.runner import TorchModelRunner
    from application.engine.engine import Engine
    from domain.config import EngineConfig
    from domain.request import AdmitCall
    from domain.sampling import SamplingParams
    from entrypoints.inprocess import LLM
    from tests.fakes import ListSink

    torch.set_num_threads(args.threads)
    llm = LLM(args.model, dtype=args.dtype, device="cpu")
    model, tokenizer = llm._container.backend.model(), llm.tokenizer
    c = args.c
    config = EngineConfig(
        max_model_len=args.prompt_tokens + args.output_tokens + 16,
        max_num_seqs=c,
        max_waiting_requests=c,
        max_num_batched_tokens=max(512, c),
    )
    engine = Engine(config, TorchModelRunner(model, config), tokenizer, ListSink())
    rng = random.Random(0)
    vocab = min(10_000, tokenizer.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    engine.admit(AdmitCall.one("warm-up", [1, 2, 3], SamplingParams(max_tokens=8, ignore_eos=True)))
    while engine.has_work():
        engine.step()
    for i in range(c):
        prompt = [rng.randrange(vocab) for _ in range(args.prompt_tokens)]
        engine.admit(AdmitCall.one(f"r{i}", prompt, params))
    decode_s, decode_tokens = 0.0, 0
    while engine.has_work():
        start = time.perf_counter()
        stats = engine.step()
        elapsed = time.perf_counter() - start
        if stats.scheduler.prefill_tokens == 0 and stats.sampled_tokens:
            decode_s += elapsed
            decode_tokens += stats.sampled_tokens
    print(json.dumps({"decode_tok_s": decode_tokens / decode_s, "tokens": decode_tokens}))


def run_side(tree: Path, c: int, args: argparse.Namespace) -> float:
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        "--c",
        str(c),
        "--model",
        args.model,
        "--dtype",
        args.dtype,
        "--threads",
        str(args.threads),
        "--prompt-tokens",
        str(args.prompt_tokens),
        "--output-tokens",
        str(args.output_tokens),
    ]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(
        command, cwd=tree, env=env, capture_output=True, text=True, timeout=args.timeout
    )
    if out.returncode != 0:
        raise SystemExit(f"{tree} c={c} failed:\n{out.stderr[-2000:]}")
    return float(json.loads(out.stdout.strip().splitlines()[-1])["decode_tok_s"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--base", type=Path, help="the checkout to compare with")
    p.add_argument("--concurrency", default="1,64")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--result-json", type=Path)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--c", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    if args.base is None:
        p.error("--base is required")
    from benchmarks.bench_serving import machine_line

    print(machine_line())
    print(
        f"model {args.model}, {args.dtype}, {args.threads} threads, prompt "
        f"{args.prompt_tokens} + {args.output_tokens} output tokens per request"
    )
    sides = {"this": REPO_ROOT, "base": args.base.resolve()}
    rows = []
    for c in [int(x) for x in args.concurrency.split(",")]:
        runs: dict[str, list[float]] = {"this": [], "base": []}
        for round_ in range(args.rounds):
            order = ["base", "this"] if round_ % 2 == 0 else ["this", "base"]
            for side in order:
                runs[side].append(run_side(sides[side], c, args))
                print(f"  c={c} round {round_ + 1} {side}: {runs[side][-1]:.1f} tok/s", flush=True)
        this, base = statistics.median(runs["this"]), statistics.median(runs["base"])
        rows.append({"c": c, "this": this, "base": base, "ratio": this / base, "runs": runs})
    print("\n| streams | base decode tok/s | this decode tok/s | this / base |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['c']} | {r['base']:.1f} | {r['this']:.1f} | {r['ratio']:.2f}x |")
    if args.result_json:
        args.result_json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
