"""Time one ``TokenSampler.sample()`` call per batch size and parameter mix, on the CPU.

Side by side in one run: a sort-based top-p (what transformers' TopPLogitsWarper and
``torch.multinomial`` do) on the same logits, as the reference for the radix-select top-p.
Best of several repeats (shared machines are noisy). Usage:

    .venv/bin/python benchmarks/bench_sampler.py [--vocab 49152] [--threads 2]
"""

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch

from adapters.torch.runtime.sampler import TokenSampler, make_generator
from domain.sampling import SamplingParams

CASES = {
    "greedy": SamplingParams(temperature=0.0),
    "greedy + logprobs 5": SamplingParams(temperature=0.0, logprobs=5),
    "greedy + penalties": SamplingParams(temperature=0.0, repetition_penalty=1.1),
    "temperature": SamplingParams(temperature=0.8),
    "temperature + top_p": SamplingParams(temperature=0.8, top_p=0.9),
    "temperature + top_p, seeded": SamplingParams(temperature=0.8, top_p=0.9, seed=1),
    "temperature + top_k + top_p": SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
    "temperature + top_p + min_p": SamplingParams(temperature=0.8, top_p=0.9, min_p=0.05),
}


def best_ms(call: Callable[[], object], seconds: float = 1.0, min_calls: int = 20) -> float:
    call()
    best, calls, deadline = float("inf"), 0, time.perf_counter() + seconds
    while calls < min_calls or time.perf_counter() < deadline:
        start = time.perf_counter()
        call()
        best, calls = min(best, time.perf_counter() - start), calls + 1
    return best * 1e3


def sort_top_p(logits: torch.Tensor, temperature: float, top_p: float) -> list[int]:
    """The sort-based reference: transformers' top-p warper, then multinomial."""
    scaled = logits / temperature
    sorted_logits, order = scaled.sort(dim=-1)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop_sorted = cumulative <= 1 - top_p
    drop_sorted[:, -1] = False
    drop = drop_sorted.scatter(1, order, drop_sorted)
    probs = scaled.masked_fill(drop, float("-inf")).softmax(dim=-1)
    return torch.multinomial(probs, 1).squeeze(1).tolist()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sampler = TokenSampler()
    print(f"torch {torch.__version__}, {args.threads} threads, V={args.vocab}; ms per call")
    for batch in (1, 64):
        logits = torch.randn(batch, args.vocab) * 3
        history = {
            "prompt_ids": [list(range(0, 2000, 7))] * batch,
            "output_ids": [list(range(100, 300, 3))] * batch,
        }
        for name, params in CASES.items():
            generators = [make_generator(i, "cpu") if params.seed else None for i in range(batch)]
            call = partial(sampler.sample, logits, [params] * batch, generators=generators)
            print(f"B={batch:<3} {name:30} {best_ms(partial(call, **history)):8.3f}")
        ms = best_ms(partial(sort_top_p, logits, 0.8, 0.9))
        print(f"B={batch:<3} {'reference: sort-based top_p':30} {ms:8.3f}")


if __name__ == "__main__":
    main()
