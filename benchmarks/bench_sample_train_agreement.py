"""Tinker's on-policy promise, measured: the logprobs the serving engine gives a sequence
(``compute_logprobs`` / a sample's prompt logprobs) against the trainer's ``forward`` on the
same tokens and weights (the base model: a fresh adapter's B is zero).

Both run in this process on the default model, as ``infer serve`` builds them (``--dtype
auto``'s choice, GGUF quantization, the engine's kernels and tuning), for a few chats of
different lengths scored in one step and again one at a time after a prefix cache hit; with
``--batch-invariant`` off and on. Reported per mode: the largest |Δ| of a token's logprob,
the mean |Δ|, and the mean of (engine − trainer) over the tokens (the cookbook's
``kl_sample_train_v1`` estimator of KL(sampler || trainer)).

Usage: .venv/bin/python benchmarks/bench_sample_train_agreement.py [--modes off,on]
"""

import argparse
import asyncio
import json
import sys
from array import array
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from application.engine.request_ids import new_request_id  # noqa: E402
from domain.config import EngineConfig  # noqa: E402
from domain.request import AdmitCall  # noqa: E402
from domain.sampling import SamplingParams  # noqa: E402
from domain.tinker.batch import ForwardBackwardInput  # noqa: E402
from domain.tinker.values import Datum, LoraSpec, TensorValue  # noqa: E402
from entrypoints.config import ServerConfig  # noqa: E402
from entrypoints.container import create_container  # noqa: E402

CHATS = [
    [
        ("user", "Write a Python function that reverses a string."),
        (
            "assistant",
            "def reverse(s):\n    return s[::-1]\n\nThis uses slicing with a step of -1.",
        ),
    ],
    [("user", "What is the capital of France?"), ("assistant", "Paris is the capital of France.")],
    [
        ("user", "Tell me a short story about a dragon who learns to read."),
        (
            "assistant",
            "Once upon a time, a young dragon named Ember found a book in a cave. "
            "She could not read the strange marks, so she asked an old owl to teach her. Every "
            "night they practised letters by the light of her own small flame, until one spring "
            "morning Ember read the whole book aloud to the forest.",
        ),
    ],
]


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


async def engine_logprobs(container, prompts: list[list[int]], together: bool) -> list[list[float]]:
    engine = container.async_engine()
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=True)
    engine.start()
    try:

        async def one(ids: list[int]) -> list[float]:
            [stream] = engine.submit(AdmitCall.one(new_request_id("agree"), ids, params))
            outs = [o async for o in stream]
            return list(outs[0].prompt_logprobs or ())

        if together:
            return list(await asyncio.gather(*(one(p) for p in prompts)))
        return [await one(p) for p in prompts]
    finally:
        await engine.idle()
        await engine.stop()


def trainer_logprobs(container, prompts: list[list[int]]) -> list[list[float]]:
    backend = container.training.backend()  # the LoRA trainer over the served model
    name = container.backend.served_names()[0]
    backend.create("agreement", name, LoraSpec(rank=8, seed=0))
    data = [
        Datum(
            p[:-1],
            {
                "target_tokens": TensorValue(array("q", p[1:]), (len(p) - 1,)),
                "weights": TensorValue.floats([1.0] * (len(p) - 1)),
            },
        )
        for p in prompts
    ]
    steps = backend.forward_backward_steps(
        "agreement", ForwardBackwardInput(data, "cross_entropy"), backward=False
    )
    try:
        while True:
            next(steps)
    except StopIteration as done:
        result = done.value
    backend.release("agreement")
    return [list(o["logprobs"].data) for o in result.outputs]


def compare(engine: list[list[float]], trainer: list[list[float]]) -> dict[str, float]:
    deltas = [
        e - t for es, ts in zip(engine, trainer, strict=True) for e, t in zip(es, ts, strict=True)
    ]
    return {
        "tokens": len(deltas),
        "max_abs": max(abs(d) for d in deltas),
        "mean_abs": sum(abs(d) for d in deltas) / len(deltas),
        "kl_v1": sum(deltas) / len(deltas),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="off,on")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    rows = []
    for mode in args.modes.split(","):
        config = ServerConfig.for_model(
            None,
            dtype=args.dtype,
            quantization="auto",
            enabled=True,
            engine=EngineConfig(max_model_len=2048, max_num_seqs=64, batch_invariant=mode == "on"),
        )
        container = create_container(config)
        tokenizer = container.backend.tokenizer()
        prompts = [
            tokenizer.render_chat(
                [{"role": r, "content": c} for r, c in chat], add_generation_prompt=False
            )
            for chat in CHATS
        ]
        trainer = trainer_logprobs(container, prompts)
        together = asyncio.run(engine_logprobs(container, prompts, together=True))
        cached = asyncio.run(engine_logprobs(container, prompts, together=False))
        for label, got in (("in one step", together), ("again, prefix cached", cached)):
            row = {
                "batch_invariant": mode,
                "engine": label,
                "dtype": container.backend.dtype(),
                **compare(got, trainer),
            }
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    print(f"CPU: {cpu_name()}")
    print(
        "| --batch-invariant | engine scored | dtype | tokens | max abs Δ | mean abs Δ "
        "| mean Δ (KL v1) |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['batch_invariant']} | {r['engine']} | {r['dtype']} | {r['tokens']} | "
            f"{r['max_abs']:.2e} | {r['mean_abs']:.2e} | {r['kl_v1']:.2e} |"
        )


if __name__ == "__main__":
    main()
