"""Single-request TTFT and decode speed: our generate() next to transformers' generate.

Same weights (the converted HF folder), dtype, thread count and prompt, in one run,
interleaved, reporting medians and ratios. Usage:

    .venv/bin/python benchmarks/bench_generate.py [--model SPEC] [--dtype bfloat16]
        [--new-tokens 128] [--runs 3] [--threads 2]
"""

import argparse
import platform
import statistics
import subprocess
import time
from collections.abc import Callable

import torch
from transformers import AutoModelForCausalLM

from adapters.torch.runtime.generate import stream_generate
from domain.sampling import SamplingParams
from entrypoints.container import DTYPES, create_container

PROMPT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a wooden screw press. Within "
    "fifty years printers worked in more than two hundred European cities, books became "
    "cheaper, literacy spread, and scholars could compare identical copies of a text for the "
    "first time. Explain, step by step, how this invention changed science, religion and "
    "politics in Europe, and what a modern reader can learn from it."
)


def main() -> None:
    args = _args()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    container = create_container(args.model, dtype=args.dtype, progress=True)
    model, tokenizer = container.model(), container.tokenizer()
    load_s = time.perf_counter() - t0
    folder = container.resolved_model().path
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPES[args.dtype]).eval()
    prompt_ids = tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    for _ in range(args.warmup):
        _time_ours(model, tokenizer, prompt_ids, params)
        _time_hf(reference, prompt_ids, args.new_tokens)
    ours, theirs = [], []
    for _ in range(args.runs):
        ours.append(_time_ours(model, tokenizer, prompt_ids, params))
        theirs.append(_time_hf(reference, prompt_ids, args.new_tokens))
    _report(args, load_s, len(prompt_ids), ours, theirs)


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=None, help="model spec (default: embedded SmolLM2)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    return p.parse_args()


def _time_ours(model, tokenizer, prompt_ids, params) -> tuple[float, float]:
    """(TTFT s, decode tok/s) for one generate() run."""
    start = time.perf_counter()
    stamps = [time.perf_counter() for _ in stream_generate(model, tokenizer, prompt_ids, params)]
    return stamps[0] - start, (len(stamps) - 1) / (stamps[-1] - stamps[0])


def _time_hf(model, prompt_ids, new_tokens: int) -> tuple[float, float]:
    """(TTFT s, decode tok/s): TTFT is a 1-token generate; decode rate excludes it."""
    ids = torch.tensor([prompt_ids])

    def run(n: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
            )
        assert out.shape[1] == ids.shape[1] + n
        return time.perf_counter() - start

    ttft = run(1)
    total = run(new_tokens)
    return ttft, (new_tokens - 1) / (total - ttft)


def _median(rows: list[tuple[float, float]], i: int, f: Callable[[float], float]) -> float:
    return statistics.median(f(r[i]) for r in rows)


def _report(args, load_s: float, prompt_len: int, ours, theirs) -> None:
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    machine = f"{platform.machine()} {platform.processor()}".strip()
    print(f"machine: {machine}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"commit {commit}; model {args.model or 'default'} {args.dtype}; prompt {prompt_len}")
    print(f"tokens, {args.new_tokens} new tokens, median of {args.runs} interleaved runs")
    print(f"load (resolve + weights + tokenizer, in process): {load_s:.2f} s\n")
    print("| engine | TTFT (ms) | decode (tok/s) |")
    print("|---|---|---|")
    for name, rows in (("infer generate()", ours), ("transformers generate", theirs)):
        ttft, rate = _median(rows, 0, lambda x: x * 1e3), _median(rows, 1, float)
        print(f"| {name} | {ttft:.0f} | {rate:.1f} |")
    # Ratios per interleaved pair, then their median: each pair shares the machine's state.
    speed = statistics.median(o[1] / t[1] for o, t in zip(ours, theirs, strict=True))
    ttft = statistics.median(t[0] / o[0] for o, t in zip(ours, theirs, strict=True))
    print(f"| ratio (median of per-run ratios) | {ttft:.2f}x faster | {speed:.2f}x |")
    runs = ", ".join(f"{o[1] / t[1]:.2f}" for o, t in zip(ours, theirs, strict=True))
    print(f"\nper-run decode ratios: {runs}")


if __name__ == "__main__":
    main()
