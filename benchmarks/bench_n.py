"""TTFT of ``n`` choices of one prompt (sharing its prefill) vs one choice, side by side.

Each round queues, on the engine of the default model (in-process, no HTTP), one request
for ``--n`` choices of a ``--prompt-tokens`` prompt, and one for a single choice, in
alternating order; TTFT is the time from queueing to the step where the last choice has
its first token. Also timed: ``--n`` independent requests of the same prompt (what ``n``
cost before the choices shared a prefill). Reported: medians over ``--rounds`` and the
ratios to ``n=1`` (issue 14's goal: ``n=8`` within 1.3x of ``n=1`` on a 1,000-token prompt).

Usage:
    .venv/bin/python benchmarks/bench_n.py [--model SPEC] [--n 8] [--prompt-tokens 1000]
        [--rounds 5] [--dtype float32]
"""

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from application.engine.engine import Engine  # noqa: E402
from benchmarks import bench_serving as bs  # noqa: E402
from domain.config import EngineConfig  # noqa: E402
from domain.request import AdmitCall  # noqa: E402
from domain.sampling import SamplingParams  # noqa: E402
from entrypoints.config import ServerConfig  # noqa: E402
from entrypoints.container import create_container  # noqa: E402

PARAMS = SamplingParams(temperature=0.8, max_tokens=1, ignore_eos=True, seed=0)


def ttft(engine: Engine, admit: Callable[[tuple[str, ...]], object], ids: tuple[str, ...]) -> float:
    """Seconds from queueing ``ids`` to the step where the last of them has a token."""
    start = time.perf_counter()
    admit(ids)
    waiting = set(ids)
    while waiting:
        waiting -= set(engine.step().first_tokens)
    elapsed = time.perf_counter() - start
    while engine.has_work():  # release what the requests held
        engine.step()
    return elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    p.add_argument("--dtype", default="float32", help="bfloat16 where the CPU runs it fast")
    p.add_argument("--device", default=None)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()

    config = EngineConfig(max_model_len=args.prompt_tokens + 64, max_num_seqs=max(8, args.n))
    container = create_container(
        ServerConfig.for_model(args.model, dtype=args.dtype, device=args.device, engine=config)
    )
    engine = container.async_engine().engine
    rng = random.Random(0)
    vocab = min(10_000, engine.vocab_size)
    prompt = [rng.randrange(3, vocab) for _ in range(args.prompt_tokens)]
    counter = iter(range(10**9))

    def ids(count: int) -> tuple[str, ...]:
        return tuple(f"r{next(counter)}" for _ in range(count))

    cases: dict[str, Callable[[], float]] = {
        "n=1": lambda: ttft(
            engine, lambda i: engine.admit(AdmitCall(i, (prompt,), PARAMS)), ids(1)
        ),
        f"n={args.n}": lambda: ttft(
            engine, lambda i: engine.admit(AdmitCall(i, (prompt,), PARAMS, args.n)), ids(args.n)
        ),
        f"{args.n} separate": lambda: ttft(
            engine, lambda i: engine.admit(AdmitCall(i, (prompt,) * args.n, PARAMS)), ids(args.n)
        ),
    }
    for case in cases.values():  # warm-up
        case()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for round_ in range(args.rounds):
        order = list(cases) if round_ % 2 == 0 else list(reversed(cases))
        for name in order:
            times[name].append(cases[name]())
    base = statistics.median(times["n=1"])
    print(bs.machine_line())
    print(f"model {container.backend.resolved_model().name}, {args.prompt_tokens}-token prompt, ")
    print(f"{args.rounds} rounds, medians (max_num_batched_tokens {config.max_num_batched_tokens})")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:>12}: TTFT {median * 1000:8.1f} ms  ({median / base:.2f}x n=1)")


if __name__ == "__main__":
    main()
