"""One RL training step in process: our LoRA backend against transformers + PEFT.

A synthetic StableReinforce batch shaped like an RL step — ``--prompts`` prompts of about
``--prompt-len`` tokens, ``--group`` samples of about ``--sample-len`` tokens each; a datum
is prompt + sampled[:-1], as tinker-cookbook's ``rl_loop`` builds it (targets 0 and no
advantage on the prompt's positions) — two shapes by default: ``arithmetic`` (8 x 60
tokens, 8 x 8: the cookbook's arithmetic task, as ``bench_tinker_rl.py`` runs it) and
``long`` (4 x 400, 8 x 64). Each repetition runs, one after another, never overlapping:
our ``forward_backward`` + ``optim_step`` (shared-prefix packing on), the same without
packing (``MIN_SHARED_PREFIX`` set past every prompt: the path before packing), and
transformers + PEFT on the same batch (``bench_tinker_rl.py``'s step: same rank, alpha
32, targets, AdamW, bf16 base weights, float32 LoRA weights, right-padded forwards of at
most ``--peft-tokens`` padded tokens). Reported: per shape, the median seconds of each and
the median of the per-repetition ratios.

Usage:
    .venv/bin/python benchmarks/bench_lora_rl_step.py [--reps 5] [--shapes arithmetic long]
        [--rank 16] [--threads N] [--profile] [--result-json PATH]
"""

import argparse
import json
import os
import random
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
from bench_tinker_rl import Sample, peft_model, peft_stable_reinforce_backward  # noqa: E402

os.environ.setdefault("TINKER_TELEMETRY", "0")
SHAPES = {  # prompts, prompt tokens, samples per prompt, sampled tokens
    "arithmetic": (8, 60, 8, 8),
    "long": (4, 400, 8, 64),
}


def cpu_name() -> str:
    """The CPU's model name and core count, from /proc/cpuinfo."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown CPU"
    names = [line.split(":", 1)[1].strip() for line in text.splitlines() if "model name" in line]
    flags = next((line for line in text.splitlines() if line.startswith("flags")), "")
    extra = ", AVX512_BF16" if "avx512_bf16" in flags else ""
    return f"{names[0] if names else 'unknown CPU'} ({len(names)} logical cores{extra})"


def rl_batch(shape: tuple[int, int, int, int], vocab: int, seed: int) -> list[Sample]:
    """Random ids: prompts of ``prompt_len`` ± 10 %, samples of 1 to ``sample_len`` tokens
    (most of them full, as samples cut at ``max_tokens``), advantages reward minus the
    group's mean."""
    prompts, prompt_len, group, sample_len = shape
    rng = random.Random(seed)
    batch = []
    for _ in range(prompts):
        n = rng.randint(int(prompt_len * 0.9), int(prompt_len * 1.1))
        prompt = [rng.randrange(vocab) for _ in range(n)]
        rewards = [float(rng.random() < 0.5) for _ in range(group)]
        rewards[0], rewards[1] = 0.0, 1.0  # the group has signal
        mean = statistics.fmean(rewards)
        for reward in rewards:
            length = sample_len if rng.random() < 0.7 else rng.randint(1, sample_len)
            sampled = [rng.randrange(vocab) for _ in range(length)]
            logprobs = [-rng.uniform(0.05, 3.0) for _ in range(length)]
            batch.append((prompt, sampled, logprobs, reward - mean))
    return batch


def our_data(batch: list[Sample]) -> list[Any]:
    """The batch as the Tinker face hands it to the backend (stable_reinforce inputs)."""
    from domain.tinker.values import Datum, TensorValue

    data = []
    for prompt, sampled, logprobs, advantage in batch:
        ob = len(prompt) - 1
        inputs = {
            "target_tokens": TensorValue.ints([0] * ob + sampled),
            "logprobs": TensorValue.floats([0.0] * ob + logprobs),
            "advantages": TensorValue.floats([0.0] * ob + [advantage] * len(sampled)),
            "sampled_mask": TensorValue.floats([0.0] * ob + [1.0] * len(sampled)),
        }
        data.append(Datum(prompt + sampled[:-1], inputs))
    return data


def make_ours(folder: Path, rank: int, lr: float) -> Any:
    """One forward_backward + optim_step of our LoRA backend; ``packed`` False runs it with
    shared-prefix packing off. Returns the step's wall and process CPU seconds."""
    import torch

    import adapters.torch.lora.training as lora
    from adapters.torch.lora.training import BaseModelEntry, LoraTrainingBackend
    from domain.tinker.batch import ForwardBackwardInput
    from domain.tinker.values import AdamParams, LoraSpec

    backend = LoraTrainingBackend([BaseModelEntry("base", folder, dtype=torch.bfloat16)])
    backend.create("bench", "base", LoraSpec(rank=rank, seed=0))
    params = AdamParams(learning_rate=lr)
    min_prefix = getattr(lora, "MIN_SHARED_PREFIX", None)

    def step(data: list[Any], packed: bool = True) -> tuple[float, float]:
        if min_prefix is not None:
            lora.MIN_SHARED_PREFIX = min_prefix if packed else 1 << 30
        start, cpu = time.perf_counter(), time.process_time()
        backend.forward_backward(
            "bench", ForwardBackwardInput(data, "stable_reinforce"), backward=True
        )
        backend.optim_step("bench", params)
        return time.perf_counter() - start, time.process_time() - cpu

    return step


def make_peft(folder: Path, rank: int, lr: float, max_tokens: int) -> Any:
    """bench_tinker_rl.py's transformers + PEFT StableReinforce step, in right-padded
    forwards of at most ``max_tokens`` padded tokens (gradients accumulated); returns its
    wall and process CPU seconds."""
    model, optimizer = peft_model(folder, rank, lr)

    def forward_backward(batch: list[Sample]) -> None:
        peft_stable_reinforce_backward(model, batch)

    def step(batch: list[Sample]) -> tuple[float, float]:
        start, cpu = time.perf_counter(), time.process_time()
        ordered = sorted(batch, key=lambda s: len(s[0]) + len(s[1]))
        chunk: list[Sample] = []
        for sample in ordered:
            width = len(sample[0]) + len(sample[1])  # ascending: the chunk's widest
            if chunk and (len(chunk) + 1) * width > max_tokens:
                forward_backward(chunk)
                chunk = []
            chunk.append(sample)
        forward_backward(chunk)
        optimizer.step()
        optimizer.zero_grad()
        return time.perf_counter() - start, time.process_time() - cpu

    return step


def profile_ours(ours: Any, data: list[Any], packed: bool) -> None:
    """torch.profiler's top operators of one of our steps (CPU time)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        ours(data, packed)
    label = "packed" if packed else "unpacked"
    print(f"\n--- our step ({label}): top operators by self CPU time ---")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument(
        "--peft-tokens",
        type=int,
        default=4800,
        help="PEFT's padded tokens per forward (4800: the arithmetic batch in one, as "
        "bench_tinker_rl.py runs it)",
    )
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-peft", action="store_true", help="ours only (packed, unpacked)")
    parser.add_argument("--profile", action="store_true", help="torch.profiler tables")
    parser.add_argument("--result-json", type=Path, default=None)
    args = parser.parse_args()

    import torch

    from adapters.weights.factory import resolve

    if args.threads:
        torch.set_num_threads(args.threads)
    folder = resolve(None, None, progress=True).path
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    ours = make_ours(folder, args.rank, args.lr)
    peft = None if args.no_peft else make_peft(folder, args.rank, args.lr, args.peft_tokens)
    print(f"CPU: {cpu_name()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    results: dict[str, Any] = {"cpu": cpu_name(), "load_before": os.getloadavg()}
    for name in args.shapes:
        batch = rl_batch(SHAPES[name], vocab, seed=1)
        data = our_data(batch)
        tokens = sum(len(d.tokens) for d in data)
        ours(data), ours(data, False)  # warm-up (allocator, oneDNN primitives)
        if peft is not None:
            peft(batch)
        times: dict[str, list[float]] = {"packed": [], "unpacked": [], "peft": []}
        cpu: dict[str, list[float]] = {"packed": [], "unpacked": [], "peft": []}
        runs = {"packed": partial(ours, data, True), "unpacked": partial(ours, data, False)}
        if peft is not None:
            runs["peft"] = partial(peft, batch)
        for rep in range(args.reps):
            for key, run in runs.items():
                wall, used = run()
                times[key].append(wall)
                cpu[key].append(used)
            line = f"  {name} rep {rep + 1}: " + ", ".join(
                f"{k} {times[k][-1]:.2f} s ({cpu[k][-1]:.1f} CPU s)" for k in runs
            )
            print(line, file=sys.stderr, flush=True)
        print(
            f"\n{name}: {SHAPES[name][0]} prompts x {SHAPES[name][2]} samples, "
            f"{len(data)} data, {tokens} tokens; median wall s/step (CPU s): "
            + ", ".join(
                f"{k} {statistics.median(times[k]):.2f} ({statistics.median(cpu[k]):.1f})"
                for k in runs
            )
        )
        shape_result: dict[str, Any] = {"times": times, "cpu": cpu, "tokens": tokens}
        pairs = [("unpacked", "packed")]
        if peft is not None:
            pairs += [("peft", "packed"), ("peft", "unpacked")]
        for slow, fast in pairs:
            ratios = [a / b for a, b in zip(times[slow], times[fast], strict=True)]
            cpu_ratios = [a / b for a, b in zip(cpu[slow], cpu[fast], strict=True)]
            shape_result[f"{slow}_over_{fast}"] = statistics.median(ratios)
            shape_result[f"{slow}_over_{fast}_cpu"] = statistics.median(cpu_ratios)
            print(
                f"  {slow} / {fast}: wall median {statistics.median(ratios):.2f}x "
                f"(range {min(ratios):.2f}-{max(ratios):.2f}), CPU time median "
                f"{statistics.median(cpu_ratios):.2f}x"
            )
        results[name] = shape_result
        if args.profile:
            profile_ours(ours, data, True)
            profile_ours(ours, data, False)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    results["load_after"] = os.getloadavg()
    if args.result_json is not None:
        args.result_json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
