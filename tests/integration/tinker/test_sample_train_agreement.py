"""Tinker on one engine: the logprobs the serving engine gives a sequence (``compute_logprobs``:
a sample's prompt logprobs) are the trainer's ``forward`` logprobs of the same tokens and
weights. A quantized model trains on the engine's weights and CPU kernels (trainable through
them: ``reference_grad.py``) and a step scoring prompt tokens runs every row through the
dequantized tiles, as the trainer does, so where both run the same kernels (bf16 on an
AVX512-BF16 CPU: the prompt attention, norm, gating and RoPE kernels) they are the same
bits, whatever the prompt's length or chunking; in float32 (PyTorch's SDPA over differently
padded shapes) within 1e-5.
docs/tinker.md gives the default model's figures (benchmarks/bench_sample_train_agreement.py).
"""

import asyncio
from array import array
from pathlib import Path
from typing import Any

import pytest
import torch

from adapters.torch.cpu.kernels import cpu_kernels
from adapters.torch.cpu.portable import portable_kernels
from application.engine.request_ids import new_request_id
from domain.config import EngineConfig
from domain.request import AdmitCall
from domain.sampling import SamplingParams
from domain.tinker.batch import ForwardBackwardInput
from domain.tinker.values import Datum, LoraSpec, TensorValue
from entrypoints.config import ServerConfig
from entrypoints.container import create_container
from tests.support.tiny_models import save_tiny_model

pytestmark = pytest.mark.skipif(portable_kernels() is None, reason="no C++ toolchain")
LENGTHS = (9, 23, 47)  # fewer rows than any tuned switch, and more


def prompts() -> list[list[int]]:
    """Three unrelated prompts, and two sharing a 24-token prefix (the trainer packs them:
    the prefix runs once, each sequence's own rows after it, as DPO's chosen and rejected)."""
    gen = torch.Generator().manual_seed(0)
    alone = [torch.randint(1, 256, (n,), generator=gen).tolist() for n in LENGTHS]
    prefix = torch.randint(1, 256, (24,), generator=gen).tolist()
    pair = [prefix + torch.randint(1, 256, (n,), generator=gen).tolist() for n in (11, 30)]
    return alone + pair


async def engine_logprobs(container: Any, ids: list[list[int]], together: bool) -> list[Any]:
    engine = container.async_engine()
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=True)
    engine.start()
    try:

        async def one(p: list[int]) -> list[float]:
            [stream] = engine.submit(AdmitCall((new_request_id("agree"),), (p,), params))
            outputs = [o async for o in stream]
            return list(outputs[0].prompt_logprobs or ())

        if together:
            return list(await asyncio.gather(*(one(p) for p in ids)))
        return [await one(p) for p in ids]
    finally:
        await engine.idle()
        await engine.stop()


def trainer_logprobs(container: Any, ids: list[list[int]]) -> list[list[float]]:
    backend = container.training.backend()
    backend.create("agreement", container.backend.served_names()[0], LoraSpec(rank=4, seed=0))
    data = [
        Datum(
            p[:-1],
            {
                "target_tokens": TensorValue(array("q", p[1:]), (len(p) - 1,)),
                "weights": TensorValue.floats([1.0] * (len(p) - 1)),
            },
        )
        for p in ids
    ]
    steps = backend.forward_backward_steps(
        "agreement", ForwardBackwardInput(data, "cross_entropy"), backward=True
    )
    while True:
        try:
            next(steps)
        except StopIteration as done:
            result = done.value
            break
    backend.release("agreement")
    return [list(o["logprobs"].data) for o in result.outputs]


@pytest.mark.parametrize(
    ("family", "dtype"),
    [("qwen3", "bfloat16"), ("gemma3", "bfloat16"), ("llama", "float32"), ("qwen3", "float32")],
)
def test_sampling_and_training_logprobs_agree(family: str, dtype: str, tmp_path: Path) -> None:
    if dtype == "bfloat16" and cpu_kernels() is None:
        pytest.skip("no AVX512-BF16 kernels: bf16 rounds apart between the two paths")
    folder = tmp_path / "model"
    save_tiny_model(family, folder)
    config = ServerConfig.for_model(
        str(folder),
        dtype=dtype,
        device="cpu",
        quantization="int4",
        cache_dir=str(tmp_path / "cache"),
        progress=False,
        enabled=True,
        checkpoint_dir=str(tmp_path / "ckpt"),
        engine=EngineConfig(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32),
    )
    container = create_container(config)
    ids = prompts()
    trained = trainer_logprobs(container, ids)  # with a backward: the trainable path
    together = asyncio.run(engine_logprobs(container, ids, together=True))  # chunked by 32
    alone = asyncio.run(engine_logprobs(container, ids, together=False))  # one a step
    for got in (together, alone):
        for engine_row, trainer_row in zip(got, trained, strict=True):
            assert len(engine_row) == len(trainer_row)
            if dtype == "bfloat16":
                assert engine_row == trainer_row
            else:
                assert max(abs(a - b) for a, b in zip(engine_row, trainer_row, strict=True)) < 1e-5
