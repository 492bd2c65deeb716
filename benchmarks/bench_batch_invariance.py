"""What ``--batch-invariant`` costs, step by step: the default model's engine steps (decode
rows of 1, 16 and 64 requests at a 128-token context, a 512-token prompt's prefill) with the
setting off and on, the same model and pool, timed in interleaved rounds (off, on, on, off,
...) and each reported as its fastest run: other processes only add time, so the minimum
ranks the two paths on a busy machine too (the engine's own overheads — scheduling, HTTP,
sampling — are the same either way and left out).

Off: the kernel paths this CPU's tuning chose (integer dot products up to its switch row
count, dequantized tiles beyond; the LM head's dense copy; prompt chunks through the prompt
attention kernel). On: every row on the integer path, the prompt's tokens as rows over the
pool (``adapters/torch/runtime/invariant.py``). The decision rule (docs/batch-invariance.md):
on by default only where it costs at most 5 % at 1, 16 and 64 streams.

Usage: .venv/bin/python benchmarks/bench_batch_invariance.py [--rounds 12]
"""

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from adapters.torch.factory import build_model, choose_dtype  # noqa: E402
from adapters.torch.models.layers import PagedBatch  # noqa: E402
from adapters.torch.models.paged_kv import PagedKVCache  # noqa: E402
from adapters.torch.quant import QuantLinear  # noqa: E402
from adapters.weights.factory import resolve  # noqa: E402

BLOCK = 16
CONTEXT = 128
PROMPT = 512


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def settings(model: torch.nn.Module) -> dict[bool, list[tuple[int, torch.Tensor | None]]]:
    """Each quantized linear's (switch, dense copy) off (as tuned) and on (invariant)."""
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    off = [(m.dense_from_rows, m.dense) for m in linears]
    return {False: off, True: [(1 << 30, None)] * len(linears)}


def apply(model: torch.nn.Module, values: list[tuple[int, torch.Tensor | None]]) -> None:
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    for m, (switch, dense) in zip(linears, values, strict=True):
        m.dense_from_rows, m.dense = switch, dense


def decode_step(model, cache: PagedKVCache, rows: int) -> Callable[[], None]:
    tables = [list(range(i * CONTEXT // BLOCK, (i + 1) * CONTEXT // BLOCK)) for i in range(rows)]
    ids = torch.randint(0, model.config.vocab_size, (rows,))

    def run() -> None:
        batch = PagedBatch(cache, [(t, CONTEXT - 1) for t in tables], [], model.windows(), "cpu")
        model.forward_mixed(ids, batch, torch.arange(rows))

    return run


def prefill_step(model, cache: PagedKVCache, invariant: bool) -> Callable[[], None]:
    table = list(range(PROMPT // BLOCK))
    ids = torch.randint(0, model.config.vocab_size, (PROMPT,))
    last = torch.tensor([PROMPT - 1])

    def run() -> None:
        if invariant:  # the runner's layout: every token a row
            batch = PagedBatch(
                cache, [(table, p) for p in range(PROMPT)], [], model.windows(), "cpu"
            )
        else:
            batch = PagedBatch(cache, [], [(table, 0, PROMPT)], model.windows(), "cpu")
        model.forward_mixed(ids, batch, last)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    resolved = resolve(None, None, False)
    dtype = choose_dtype("auto", resolved, "cpu")
    model = build_model(resolved, dtype, "cpu", "auto")
    weight = model.embed_tokens.weight
    cache = PagedKVCache(
        model.config, 64 * CONTEXT // BLOCK, BLOCK, dtype=weight.dtype, device="cpu"
    )
    modes = settings(model)
    work = {
        f"decode, {n} rows": (lambda inv, n=n: decode_step(model, cache, n)) for n in (1, 16, 64)
    }
    work[f"prefill, {PROMPT} tokens"] = lambda inv: prefill_step(model, cache, inv)
    best: dict[str, dict[bool, float]] = {
        w: {False: float("inf"), True: float("inf")} for w in work
    }
    from adapters.torch.cpu.kernels import cpu_kernels

    kernels = cpu_kernels()
    with torch.inference_mode():
        for r in range(args.rounds):
            for name, make in work.items():
                for invariant in (False, True) if r % 2 == 0 else (True, False):
                    apply(model, modes[invariant])
                    if kernels is not None:
                        kernels.set_split_keys(not invariant)
                    run = make(invariant)
                    start = time.perf_counter()
                    run()
                    best[name][invariant] = min(best[name][invariant], time.perf_counter() - start)
            print(f"round {r + 1}/{args.rounds}", file=sys.stderr)
    print(f"CPU: {cpu_name()}; dtype {dtype}; fastest of {args.rounds} interleaved runs, ms")
    print("| step | off | on | on / off |")
    print("|---|---|---|---|")
    for name, by in best.items():
        off, on = by[False] * 1e3, by[True] * 1e3
        print(f"| {name} | {off:.1f} | {on:.1f} | {on / off:.2f}x |")


if __name__ == "__main__":
    main()
