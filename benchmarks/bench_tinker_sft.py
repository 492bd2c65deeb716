"""Supervised LoRA fine-tuning of the default model through the stock tinker SDK.

Launches ``infer serve`` (default model, bf16, a temporary checkpoint folder), then drives
it with the ``tinker`` SDK as a user would: a LoRA training client, a fixed small dataset
(``benchmarks/data/fictional_facts.jsonl``: 32 one-turn chats about invented countries,
which the base model cannot know), cross-entropy on the assistant tokens only, AdamW.

Reported:
- the mean per-token loss over the whole dataset (a forward pass) before and after, and
  the first / last training-batch losses;
- seconds per step (forward_backward + optim_step, submitted together as the SDK
  recommends) and training tokens per second;
- greedy answers to the 32 questions from the base model and from the trained adapter
  (saved with save_weights_for_sampler, sampled through the serving engine): how many
  contain the right fact;
- side by side (``--peft-baseline``, default on): the same batches through transformers +
  PEFT (same rank, alpha 32, targets, AdamW settings, bf16 base weights, float32 LoRA
  weights, one right-padded batch per step) in this process, interleaved with ours — our
  step i, then PEFT's step i, never overlapping — and the median of the per-step ratios.

Usage:
    .venv/bin/python benchmarks/bench_tinker_sft.py [--steps 32] [--batch-size 8]
        [--rank 16] [--lr 1e-3] [--no-peft-baseline] [--result-json PATH] [--device cuda]
"""

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
import tinker_bench  # noqa: E402
from tinker_bench import MODEL  # noqa: E402

DATASET = REPO_ROOT / "benchmarks" / "data" / "fictional_facts.jsonl"


def load_examples(tokenizer: Any) -> list[dict[str, Any]]:
    """Token ids of each chat, the assistant span as training targets."""
    examples = []
    for line in DATASET.read_text().splitlines():
        messages = json.loads(line)["messages"]
        prompt_text = tokenizer.apply_chat_template(
            messages[:1], tokenize=False, add_generation_prompt=True
        )
        full_text = tokenizer.apply_chat_template(messages, tokenize=False)
        prompt = tokenizer.encode(prompt_text, add_special_tokens=False)
        full = tokenizer.encode(full_text, add_special_tokens=False)
        assert full[: len(prompt)] == prompt, "chat template is not prefix-stable"
        answer = messages[1]["content"]
        examples.append({"prompt": prompt, "tokens": full, "answer": answer})
    return examples


def datum(types: Any, example: dict[str, Any]) -> Any:
    tokens, n = example["tokens"], len(example["prompt"])
    weights = [0.0] * (n - 1) + [1.0] * (len(tokens) - n)  # predict the assistant's tokens
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
    )


def fact(answer: str) -> str:
    """The invented part of an answer ("... is Quillfen." -> "Quillfen")."""
    return answer.rsplit(" is ", 1)[1].removeprefix("the ").rstrip(".")


def accuracy(sampler: Any, types: Any, tokenizer: Any, examples: list[dict[str, Any]]) -> int:
    params = types.SamplingParams(max_tokens=24, temperature=0.0)
    futures = [sampler.sample(types.ModelInput.from_ints(e["prompt"]), 1, params) for e in examples]
    right = 0
    for e, f in zip(examples, futures, strict=True):
        text = tokenizer.decode(f.result().sequences[0].tokens)
        right += fact(e["answer"]).lower() in text.lower()
    return right


def mean_loss(tc: Any, types: Any, examples: list[dict[str, Any]]) -> float:
    out = tc.forward([datum(types, e) for e in examples], "cross_entropy").result()
    weight = sum(len(e["tokens"]) - len(e["prompt"]) for e in examples)
    return float(out.metrics["loss:sum"]) / weight


def batches(examples: list[dict[str, Any]], size: int, steps: int) -> list[list[int]]:
    """Indices of each step's batch: shuffled epochs, fixed seed."""
    rng, order, out = random.Random(0), [], []
    while len(out) < steps:
        if len(order) < size:
            epoch = list(range(len(examples)))
            rng.shuffle(epoch)
            order += epoch
        out.append(order[:size])
        order = order[size:]
    return out


def run_sdk(args: argparse.Namespace, url: str, peft_step: Any = None) -> dict[str, Any]:
    import tinker
    from tinker import types

    sc = tinker.ServiceClient(base_url=url, api_key="tml-benchmark")
    tc = sc.create_lora_training_client(base_model=MODEL, rank=args.rank, seed=0).result()
    tokenizer = tc.get_tokenizer()
    examples = load_examples(tokenizer)
    base_sampler = sc.create_sampling_client(base_model=MODEL).result()
    print("base model answers ...", file=sys.stderr, flush=True)
    right_before = accuracy(base_sampler, types, tokenizer, examples)
    loss_before = mean_loss(tc, types, examples)
    adam = types.AdamParams(learning_rate=args.lr)
    plan = batches(examples, args.batch_size, args.steps)
    step_s, batch_losses, tokens, peft_s = [], [], 0, []
    for step, idx in enumerate(plan, 1):
        data = [datum(types, examples[i]) for i in idx]
        start = time.perf_counter()
        fb = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(adam)
        result, _ = fb.result(), opt.result()
        step_s.append(time.perf_counter() - start)
        weight = sum(len(examples[i]["tokens"]) - len(examples[i]["prompt"]) for i in idx)
        batch_losses.append(result.metrics["loss:sum"] / weight)
        tokens += sum(len(examples[i]["tokens"]) - 1 for i in idx)
        line = f"step {step:3d}/{len(plan)}  loss/token {batch_losses[-1]:.3f}  {step_s[-1]:.2f} s"
        if peft_step is not None:
            peft_s.append(peft_step(idx))
            line += f"  (PEFT {peft_s[-1]:.2f} s)"
        print(line, file=sys.stderr, flush=True)
    loss_after = mean_loss(tc, types, examples)
    path = tc.save_weights_for_sampler("final").result().path
    trained = sc.create_sampling_client(model_path=path).result()
    print("trained adapter answers ...", file=sys.stderr, flush=True)
    right_after = accuracy(trained, types, tokenizer, examples)
    sc.close("success").result()
    return {
        "examples": len(examples),
        "steps": len(plan),
        "loss_before": loss_before,
        "loss_after": loss_after,
        "first_batch_loss": batch_losses[0],
        "last_batch_loss": batch_losses[-1],
        "step_s_median": statistics.median(step_s),
        "step_s_mean": statistics.fmean(step_s),
        "train_tokens_per_s": tokens / sum(step_s),
        "right_before": right_before,
        "right_after": right_after,
        "sampler_path": path,
        "step_s": step_s,
        "peft_step_s": peft_s,
    }


def make_peft_step(args: argparse.Namespace, folder: Path) -> Any:
    """A function running one step of transformers + PEFT on a batch (by example indices);
    returns its seconds."""
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    examples = load_examples(tokenizer)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model, optimizer = tinker_bench.peft_model(folder, args.rank, args.lr, device)

    def step(idx: list[int]) -> float:
        batch = [examples[i] for i in idx]
        start = time.perf_counter()
        # One right-padded batch, as ours runs it; the loss over the assistant tokens only.
        width = max(len(e["tokens"]) for e in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        weights = torch.zeros(len(batch), width - 1)
        for row, e in enumerate(batch):
            ids[row, : len(e["tokens"])] = torch.tensor(e["tokens"])
            mask[row, : len(e["tokens"])] = 1
            weights[row, len(e["prompt"]) - 1 : len(e["tokens"]) - 1] = 1.0
        ids, mask, weights = ids.to(device), mask.to(device), weights.to(device)
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(2, ids[:, 1:, None])[..., 0]
        (-(logp * weights).sum()).backward()
        return tinker_bench.finish_peft_step(optimizer, start, device)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8)
    tinker_bench.add_lora_args(parser, lr=1e-3)
    parser.add_argument("--device", default=None, help="server and PEFT device (default: auto)")
    args = parser.parse_args()
    device_flags = ["--device", args.device] if args.device else []
    o = tinker_bench.run_with_server(args, make_peft_step, run_sdk, *device_flags)
    print(f"\nSFT of {MODEL} (LoRA rank {args.rank}, lr {args.lr}) on {o['examples']} chats:")
    print(f"  mean loss/token over the dataset: {o['loss_before']:.3f} -> {o['loss_after']:.3f}")
    print(
        f"  batch loss/token: step 1 {o['first_batch_loss']:.3f}, "
        f"step {o['steps']} {o['last_batch_loss']:.3f}"
    )
    print(
        f"  facts answered right (greedy): {o['right_before']}/{o['examples']} -> "
        f"{o['right_after']}/{o['examples']}"
    )
    print(
        f"  seconds per step (batch {args.batch_size}): median {o['step_s_median']:.2f}, "
        f"mean {o['step_s_mean']:.2f}; {o['train_tokens_per_s']:.0f} training tokens/s"
    )
    tinker_bench.report_peft(args, o, "peft_step_s", "step_s", "step")


if __name__ == "__main__":
    main()
