"""What ``--batch-invariant`` costs: the default model in this process, the same engine with
the setting off and on, side by side (rounds alternate off / on, so a busy machine slows
both alike), at 1, 16 and 64 concurrent requests of forced length, and one long prompt's
time to first token (its prefill).

Reported per workload: the median over rounds of the time with it off, on, and on / off
(the cost). The decision rule (docs/batch-invariance.md): on by default only where it costs
at most 5 % at 1, 16 and 64 streams.

Usage: .venv/bin/python benchmarks/bench_batch_invariance.py [--rounds 3] [--tokens 64]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from domain.config import EngineConfig  # noqa: E402
from domain.sampling import SamplingParams  # noqa: E402
from entrypoints.inprocess import LLM  # noqa: E402

LONG_PROMPT = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(40))


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def timed(llm: LLM, prompts: list[str], params: SamplingParams) -> float:
    start = time.perf_counter()
    llm.generate(prompts, params)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--streams", default="1,16,64")
    args = parser.parse_args()
    engines = {
        mode: LLM(
            engine=EngineConfig(max_seq_len=2048, max_batch_size=64, batch_invariant=mode),
            quantization="gguf",
        )
        for mode in (False, True)
    }
    decode = SamplingParams(max_tokens=args.tokens, temperature=0.8, seed=1, ignore_eos=True)
    first = SamplingParams(max_tokens=1, temperature=0.0)
    workloads = {
        f"{n} streams x {args.tokens} tokens": (
            [f"Request {i}: tell me about the number {i}." for i in range(n)],
            decode,
        )
        for n in map(int, args.streams.split(","))
    }
    long_ids = engines[False].tokenizer.encode(LONG_PROMPT)
    workloads[f"prefill {len(long_ids)} tokens (TTFT)"] = ([LONG_PROMPT], first)
    for llm in engines.values():  # warm-up: first calls pay one-off costs
        llm.generate(["Hello"], SamplingParams(max_tokens=4))
    times: dict[str, dict[bool, list[float]]] = {w: {False: [], True: []} for w in workloads}
    for r in range(args.rounds):
        for name, (prompts, params) in workloads.items():
            order = (False, True) if r % 2 == 0 else (True, False)
            for mode in order:
                # a prefill prompt not in the prefix cache: a different first word each time
                if params is first:
                    prompts = [f"Round {r} {'on' if mode else 'off'}. {LONG_PROMPT}"]
                times[name][mode].append(timed(engines[mode], prompts, params))
                print(
                    name, "on" if mode else "off", round(times[name][mode][-1], 3), file=sys.stderr
                )
    print(f"CPU: {cpu_name()}; {args.rounds} rounds, off / on alternating; median seconds")
    print("| workload | off | on | on / off |")
    print("|---|---|---|---|")
    for name, by_mode in times.items():
        off, on = statistics.median(by_mode[False]), statistics.median(by_mode[True])
        print(f"| {name} | {off:.3f} | {on:.3f} | {on / off:.2f}x |")


if __name__ == "__main__":
    main()
