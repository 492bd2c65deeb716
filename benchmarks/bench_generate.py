"""Single-request TTFT and decode speed: our generate() next to transformers' generate.

Same weights (the converted HF folder), dtype, thread count and prompt, in one run,
interleaved, reporting medians and ratios; ``--quantization none,int8,int4,gguf`` times
each of our variants side by side (ratios against transformers' dense model). Usage:

    .venv/bin/python benchmarks/bench_generate.py [--model SPEC] [--dtype bfloat16]
        [--new-tokens 128] [--runs 3] [--threads 2] [--quantization none,int8,int4]
"""

import argparse
import platform
import statistics
import subprocess
import time
from collections.abc import Callable

import torch
from transformers import AutoModelForCausalLM

from adapters.torch.cpu.tuning import cpu_name, isa_flags
from adapters.torch.factory import DTYPES
from adapters.torch.runtime.generate import stream_generate
from domain.sampling import SamplingParams
from entrypoints.config import ServerConfig
from entrypoints.container import create_container

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
    models, load_s = {}, {}
    for method in args.quantization.split(","):
        t0 = time.perf_counter()
        config = ServerConfig.for_model(
            args.model, dtype=args.dtype, progress=True, quantization=method
        )
        container = create_container(config)
        models[method], tokenizer = container.backend.model(), container.backend.tokenizer()
        load_s[method] = time.perf_counter() - t0
    folder = container.backend.resolved_model().path
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPES[args.dtype]).eval()
    prompt_ids = tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    for _ in range(args.warmup):
        for model in models.values():
            _time_ours(model, tokenizer, prompt_ids, params)
        _time_hf(reference, prompt_ids, args.new_tokens)
    ours: dict[str, list[tuple[float, float]]] = {method: [] for method in models}
    theirs = []
    for _ in range(args.runs):
        for method, model in models.items():
            ours[method].append(_time_ours(model, tokenizer, prompt_ids, params))
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
    p.add_argument(
        "--quantization",
        default="none",
        help="comma-separated --quantization values of ours to time side by side",
    )
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


def _report(args, load_s: dict[str, float], prompt_len: int, ours, theirs) -> None:
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    print(f"CPU: {cpu_name()}; ISA: {' '.join(isa_flags()) or 'baseline'}")
    print(f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"commit {commit}; model {args.model or 'default'} {args.dtype}; prompt {prompt_len}")
    print(f"tokens, {args.new_tokens} new tokens, median of {args.runs} interleaved runs")
    loads = ", ".join(f"{m} {s:.2f} s" for m, s in load_s.items())
    print(f"load (resolve + weights + tokenizer, in process): {loads}\n")
    print("| engine | TTFT (ms) | decode (tok/s) | decode vs transformers (median ratio) |")
    print("|---|---|---|---|")
    rows = [(f"infer generate(), quantization {m}", r) for m, r in ours.items()]
    for name, runs in [*rows, ("transformers generate", theirs)]:
        ttft, rate = _median(runs, 0, lambda x: x * 1e3), _median(runs, 1, float)
        # Ratios per interleaved pair, then their median: each pair shares the machine's state.
        ratio = statistics.median(o[1] / t[1] for o, t in zip(runs, theirs, strict=True))
        print(f"| {name} | {ttft:.0f} | {rate:.1f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
