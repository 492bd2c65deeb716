"""RL (StableReinforce) on the cookbook's arithmetic task, through the stock tinker SDK.

Launches ``infer serve`` with its defaults (the default model, a temporary checkpoint
folder), then runs the loop of tinker-cookbook's ``rl_loop`` / ``math_rl`` arithmetic
environment as a user's script would: each step saves the adapter for sampling with
``record_stability_info=True``, samples ``--group-size`` answers to each of
``--batch-size`` questions "What is x + y?" (x, y in 0..``--max-operand``, the
environment's 100 by default; its one-shot
prefix "What is 4 + 5?" / "9", its chat template), rewards an answer 1 when its last
integer is x + y, takes advantages as reward minus the group's mean, and trains on the
groups whose rewards differ with ``stable_reinforce`` (datums with provenance spans, as
the cookbook's ``rl_loop`` builds them) and AdamW.

Reported: the mean reward per step (the learning curve) and the wall time; per step, the
seconds of sampling and of training (forward_backward + optim_step submitted together).

Side by side (``--peft-baseline``, default on): the same training batches through
transformers + PEFT in this process (same rank, alpha 32, targets, AdamW settings, bf16
base weights, float32 LoRA weights, one right-padded batch, the same StableReinforce
formula on the sampler logprobs the server recorded), interleaved with ours — our training
step i, then PEFT's, never overlapping — and the median of the per-step ratios.

Usage:
    .venv/bin/python benchmarks/bench_tinker_rl.py [--steps 20] [--batch-size 8]
        [--group-size 8] [--rank 16] [--lr 2e-4] [--no-peft-baseline] [--result-json PATH]
"""

import argparse
import random
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
import tinker_bench  # noqa: E402
from tinker_bench import MODEL, peft_model  # noqa: E402

FEWSHOT = [
    {"role": "user", "content": "What is 4 + 5?"},
    {"role": "assistant", "content": "9"},
]
_INTEGER = re.compile(r"-?\d+")


def final_int(text: str) -> int | None:
    """The cookbook arithmetic environment's answer: the last integer in the text."""
    found = _INTEGER.findall(text.replace(",", ""))
    return int(found[-1]) if found else None


def questions(step: int, batch_size: int, most: int) -> list[tuple[int, int]]:
    rng = random.Random(step)
    return [(rng.randint(0, most), rng.randint(0, most)) for _ in range(batch_size)]


def prompt_tokens(tokenizer: Any, x: int, y: int) -> list[int]:
    messages = [*FEWSHOT, {"role": "user", "content": f"What is {x} + {y}?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def rl_datum(types: Any, prompt: list[int], seq: Any, advantage: float) -> Any:
    """The cookbook rl_loop's datum (``with_sampled_provenance``)."""
    tokens, ob_len = list(seq.tokens), len(prompt) - 1
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(prompt + tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": [0] * ob_len + tokens,
            "logprobs": [0.0] * ob_len + list(seq.logprobs),
            "advantages": [0.0] * ob_len + [advantage] * len(tokens),
        },
    )
    sid = seq.sequence_id
    return datum.with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id=sid, length=len(prompt)),
            types.SampledProvenanceSpan(sequence_id=sid, length=len(tokens) - 1),
        ],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=len(prompt) - 1),
            types.SampledProvenanceSpan(sequence_id=sid, length=len(tokens)),
        ],
    )


def run_sdk(args: argparse.Namespace, url: str, peft_step: Any = None) -> dict[str, Any]:
    import tinker
    from tinker import types

    sc = tinker.ServiceClient(base_url=url, api_key="tml-benchmark")
    tc = sc.create_lora_training_client(base_model=MODEL, rank=args.rank, seed=0).result()
    tokenizer = tc.get_tokenizer()
    adam = types.AdamParams(learning_rate=args.lr)
    params = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0)
    rewards, sample_s, train_s, peft_s, trained_tokens = [], [], [], [], []
    start_all = time.perf_counter()
    for step in range(args.steps):
        start = time.perf_counter()
        sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
        asked = questions(step, args.batch_size, args.max_operand)
        prompts = [prompt_tokens(tokenizer, x, y) for x, y in asked]
        futures = [
            sampler.sample(types.ModelInput.from_ints(p), args.group_size, params) for p in prompts
        ]
        data, step_rewards, batch = [], [], []
        for (x, y), prompt, future in zip(asked, prompts, futures, strict=True):
            sequences = future.result().sequences
            group = [
                float(final_int(tokenizer.decode(s.tokens, skip_special_tokens=True)) == x + y)
                for s in sequences
            ]
            step_rewards += group
            mean = statistics.fmean(group)
            if all(r == mean for r in group):
                continue  # no signal in this group
            for seq, reward in zip(sequences, group, strict=True):
                data.append(rl_datum(types, prompt, seq, reward - mean))
                batch.append((prompt, list(seq.tokens), list(seq.logprobs), reward - mean))
        sample_s.append(time.perf_counter() - start)
        rewards.append(statistics.fmean(step_rewards))
        line = f"step {step + 1:3d}/{args.steps}  reward {rewards[-1]:.3f}"
        line += f"  sampling {sample_s[-1]:.1f} s"
        if data:
            start = time.perf_counter()
            fb = tc.forward_backward(data, "stable_reinforce")
            opt = tc.optim_step(adam)
            fb.result(), opt.result()
            train_s.append(time.perf_counter() - start)
            trained_tokens.append(sum(len(p) + len(t) - 1 for p, t, _, _ in batch))
            line += f"  training {train_s[-1]:.2f} s ({len(data)} seqs, {trained_tokens[-1]} tok)"
            if peft_step is not None:
                peft_s.append(peft_step(batch))
                line += f"  (PEFT {peft_s[-1]:.2f} s)"
        print(line, file=sys.stderr, flush=True)
    wall = time.perf_counter() - start_all
    sc.close("success").result()
    return {
        "steps": args.steps,
        "rewards": rewards,
        "wall_s": wall,
        "sample_s": sample_s,
        "train_s": train_s,
        "train_tokens": trained_tokens,
        "peft_train_s": peft_s,
    }


Sample = tuple[list[int], list[int], list[float], float]  # prompt, sampled, logprobs, adv


def peft_stable_reinforce_backward(model: Any, batch: list[Sample]) -> None:
    """StableReinforce (README's formula) over ``batch`` in one right-padded forward, on the
    sampler logprobs the server recorded; gradients added to the model's."""
    import torch

    seqs = [p + t for p, t, _, _ in batch]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    q = torch.zeros(len(batch), width - 1)
    adv = torch.zeros(len(batch), width - 1)
    sampled = torch.zeros(len(batch), width - 1)
    for row, ((prompt, _, logprobs, a), s) in enumerate(zip(batch, seqs, strict=True)):
        ids[row, : len(s)] = torch.tensor(s)
        mask[row, : len(s)] = 1
        span = slice(len(prompt) - 1, len(s) - 1)  # the positions predicting sampled tokens
        q[row, span], adv[row, span], sampled[row, span] = torch.tensor(logprobs), a, 1.0
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(2, ids[:, 1:, None])[..., 0]
    ratio = torch.exp((logp - q) * sampled)
    trusted = ((ratio >= 0.5) & (ratio <= 2.0)).float().detach() * sampled
    (-(trusted * ratio * adv).sum()).backward()


def make_peft_step(args: argparse.Namespace, folder: Path) -> Any:
    """One StableReinforce step of transformers + PEFT on a batch; returns its seconds."""
    model, optimizer = peft_model(folder, args.rank, args.lr)

    def step(batch: list[Sample]) -> float:
        start = time.perf_counter()
        peft_stable_reinforce_backward(model, batch)
        return tinker_bench.finish_peft_step(optimizer, start)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument(
        "--max-operand", type=int, default=100, help="x, y in 0..this (the cookbook's 100)"
    )
    tinker_bench.add_lora_args(parser, lr=2e-4)
    args = parser.parse_args()
    o = tinker_bench.run_with_server(args, make_peft_step, run_sdk)
    rewards = o["rewards"]
    third = max(1, len(rewards) // 3)
    print(
        f"\nStableReinforce on {MODEL} (LoRA rank {args.rank}, lr {args.lr}), arithmetic "
        f"x + y, {args.batch_size} questions x {args.group_size} samples per step:"
    )
    print("  mean reward per step: " + " ".join(f"{r:.2f}" for r in rewards))
    print(
        f"  first {third} steps {statistics.fmean(rewards[:third]):.3f} -> last {third} "
        f"steps {statistics.fmean(rewards[-third:]):.3f}; wall time {o['wall_s']:.0f} s"
    )
    if o["train_s"]:
        print(
            f"  per step: sampling median {statistics.median(o['sample_s']):.2f} s, training "
            f"median {statistics.median(o['train_s']):.2f} s "
            f"({statistics.median(o['train_tokens']):.0f} tokens)"
        )
    tinker_bench.report_peft(args, o, "peft_train_s", "train_s", "training step")


if __name__ == "__main__":
    main()
