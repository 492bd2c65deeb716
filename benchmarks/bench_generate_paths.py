"""One request two ways on one loaded model: the contiguous-cache ``stream_generate`` and the
engine (paged KV pool, the step loop with a batch of one), side by side.

Issue 29 part 5 asks whether the contiguous KV path (``KVCache``, the model-level
``generate``) can retire: it can when the engine path is as fast for one request. Both
paths share the model object ``LLM`` loads (same dtype, quantization, kernels, threads);
rounds alternate which path goes first. Reported per path: TTFT (first token, prompt
included) and decode tok/s (tokens after the first over the time after it), medians.

Usage:
    .venv/bin/python benchmarks/bench_generate_paths.py [--model default] [--dtype auto]
        [--quantization auto] [--prompt-tokens 92] [--new-tokens 128] [--rounds 5]
"""

import argparse
import asyncio
import platform
import random
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from adapters.torch.cpu.tuning import cpu_name  # noqa: E402
from adapters.torch.runtime.generate import stream_generate  # noqa: E402
from application.request_ids import new_request_id  # noqa: E402
from domain.config import EngineConfig  # noqa: E402
from domain.sampling import SamplingParams  # noqa: E402
from entrypoints.inprocess import LLM  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--prompt-tokens", type=int, default=92)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    llm = LLM(
        args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        engine=EngineConfig(max_seq_len=args.prompt_tokens + args.new_tokens + 16),
    )
    model = llm._container.model()
    tokenizer = llm.tokenizer
    rng = random.Random(0)
    ids = [
        rng.randrange(1000, min(40_000, tokenizer.vocab_size)) for _ in range(args.prompt_tokens)
    ]
    params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)

    def contiguous() -> tuple[float, float]:
        start = time.perf_counter()
        times = [time.perf_counter() for _ in stream_generate(model, tokenizer, ids, params)]
        return _ttft_and_rate(start, times)

    async def engine_stream() -> tuple[float, float]:
        engine = llm._container.async_engine()
        engine.start()
        try:
            start = time.perf_counter()
            outputs = await engine.stream(new_request_id("bench"), ids, params)
            times = [time.perf_counter() async for output in outputs if output.token_id is not None]
            await engine.idle()
        finally:
            await engine.stop()
        return _ttft_and_rate(start, times)

    def engine() -> tuple[float, float]:
        return asyncio.run(engine_stream())

    paths = {"contiguous stream_generate": contiguous, "engine (paged)": engine}
    for run in paths.values():  # warm-up
        run()
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in paths}
    for round_ in range(args.rounds):
        order = list(paths) if round_ % 2 == 0 else list(reversed(paths))
        for name in order:
            results[name].append(paths[name]())
    print(
        f"model {llm.model_name}, {cpu_name() or platform.machine()}, "
        f"{args.prompt_tokens}-token prompt, {args.new_tokens} new tokens, {args.rounds} rounds"
    )
    print("| path | TTFT ms (median) | decode tok/s (median) |")
    print("|---|---|---|")
    medians = {}
    for name, rows in results.items():
        ttft = statistics.median(r[0] for r in rows)
        rate = statistics.median(r[1] for r in rows)
        medians[name] = rate
        print(f"| {name} | {ttft * 1000:.1f} | {rate:.1f} |")
    engine_rate, contiguous_rate = medians["engine (paged)"], medians["contiguous stream_generate"]
    print(f"engine / contiguous decode: {engine_rate / contiguous_rate:.2f}x")


def _ttft_and_rate(start: float, times: list[float]) -> tuple[float, float]:
    """TTFT, and tokens after the first per second after it (one time per token)."""
    return times[0] - start, (len(times) - 1) / (times[-1] - times[0])


if __name__ == "__main__":
    main()
