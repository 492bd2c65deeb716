"""The TrainingBackend and SamplingBackend ports, one suite run against the fake (the numpy
ToyBackend) and the real adapters (the LoRA backend on a tiny torch Llama; the engine
sampler with multi-LoRA serving): the fake provably behaves like the real thing."""

import asyncio
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from adapters.fake import ByteTokenizer
from adapters.fake.toy_backend import ToyBackend
from adapters.torch.loading.loader import load_model
from adapters.torch.lora import forward as lora_module
from adapters.torch.lora.serving import LoraServing
from adapters.torch.lora.training import BaseModelEntry, LoraTrainingBackend
from adapters.torch.runtime.runner import TorchModelRunner
from application.engine.async_engine import AsyncEngine
from application.tinker.engine_sampler import EngineSampler
from domain.config import EngineConfig
from domain.tinker.batch import ForwardBackwardInput
from domain.tinker.errors import InvalidTrainingRequest, NotFoundError
from domain.tinker.values import (
    AdamParams,
    Datum,
    DimuonParams,
    LoraSpec,
    SampleRequest,
    TensorValue,
    TinkerSamplingParams,
    WeightsSource,
)
from tests.support.tiny_models import save_tiny_model

BASE = "base"
SEQ = [5, 17, 42, 7, 99, 3, 250, 8, 61]


def ce_datum(seq: list[int] = SEQ) -> Datum:
    return Datum(seq[:-1], {"target_tokens": TensorValue.ints(seq[1:])})


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny")
    save_tiny_model("llama", folder)
    return folder


@pytest.fixture(params=["toy", "lora"])
def backends(request: pytest.FixtureRequest, tiny_folder: Path) -> Iterator[tuple[Any, Any]]:
    """(TrainingBackend, SamplingBackend) over one base model named ``base``."""
    if request.param == "toy":
        toy = ToyBackend(BASE)
        yield toy, toy
        return
    trainer = LoraTrainingBackend([BaseModelEntry(BASE, tiny_folder, dtype=torch.float32)])
    model = load_model(tiny_folder, dtype=torch.float32)
    lora = LoraServing(model, live_state=trainer.peft_state)
    config = EngineConfig(max_num_seqs=8, max_model_len=128)
    engine = AsyncEngine(config, TorchModelRunner(model, config, lora=lora), ByteTokenizer())
    yield trainer, _Started(EngineSampler(engine, lora, [BASE]))


class _Started:
    """Runs the engine's loop around each sample call (tests have no server lifespan)."""

    def __init__(self, sampler: EngineSampler) -> None:
        self.sampler = sampler

    async def sample(self, *args: Any, **kwargs: Any) -> Any:
        self.sampler.engine.start()
        try:
            return await self.sampler.sample(*args, **kwargs)
        finally:
            await self.sampler.engine.stop()


def logprobs(trainer: Any, model_id: str, datum: Datum) -> list[float]:
    out = trainer.forward_backward(
        model_id, ForwardBackwardInput([datum], "cross_entropy"), backward=False
    )
    return list(out.outputs[0]["logprobs"].data)


def ce_pass(trainer: Any, model_id: str, backward: bool = True) -> Any:
    """Cross entropy on ``ce_datum()``: forward, and backward unless ``backward`` is off."""
    return trainer.forward_backward(
        model_id, ForwardBackwardInput([ce_datum()], "cross_entropy"), backward=backward
    )


def create_trained(trainer: Any, model_id: str, seed: int, steps: int) -> None:
    """A rank-4 adapter ``model_id`` of ``seed`` created and trained ``steps`` Adam steps
    (cross entropy on ``ce_datum()``, learning rate 0.05)."""
    trainer.create(model_id, BASE, LoraSpec(rank=4, seed=seed))
    for _ in range(steps):
        ce_pass(trainer, model_id)
        trainer.optim_step(model_id, AdamParams(learning_rate=0.05))


def assert_same_logprobs(trainer: Any, model_id: str, other: str, tolerance: float) -> None:
    assert logprobs(trainer, model_id, ce_datum()) == pytest.approx(
        logprobs(trainer, other, ce_datum()), abs=tolerance
    )


# --- TrainingBackend -------------------------------------------------------------------


def test_base_models_and_fresh_adapters_are_deterministic(backends) -> None:
    trainer, _ = backends
    assert [m.name for m in trainer.base_models] == [BASE]
    trainer.create("a", BASE, LoraSpec(rank=4, seed=1))
    trainer.create("b", BASE, LoraSpec(rank=4, seed=1))
    out = ce_pass(trainer, "a", backward=False)
    lp = list(out.outputs[0]["logprobs"].data)
    assert len(lp) == len(SEQ) - 1 and all(v <= 0 for v in lp)
    assert out.metrics["loss:sum"] == pytest.approx(-sum(lp), rel=1e-5)
    assert all(k.count(":") == 1 for k in out.metrics)
    # Same seed, same result; a fresh adapter is the base model (B = 0), whatever its seed.
    assert logprobs(trainer, "b", ce_datum()) == pytest.approx(lp, abs=1e-6)
    trainer.create("c", BASE, LoraSpec(rank=4, seed=2))
    assert logprobs(trainer, "c", ce_datum()) == pytest.approx(lp, abs=1e-5)


def test_gradients_accumulate_until_the_optimizer_step_lowers_the_loss(backends) -> None:
    trainer, _ = backends
    trainer.create("m", BASE, LoraSpec(rank=4, seed=3))
    before = -sum(logprobs(trainer, "m", ce_datum()))
    # The LoRA backend's B·A counts alpha / rank = 8 times, the toy's once. At 0.05 the tiny
    # Llama's loss jumped about: after 5 steps above 0.8x for some seeds and dtypes (up to
    # 2.8x); at 5e-3, the gradient clipped, 0.17-0.28x for every one tried.
    if isinstance(trainer, ToyBackend):
        adam = AdamParams(learning_rate=0.05)
    else:
        adam = AdamParams(learning_rate=5e-3, grad_clip_norm=1.0)
    for _ in range(5):
        ce_pass(trainer, "m")
        metrics = trainer.optim_step("m", adam)
        assert all(k.count(":") == 1 for k in metrics)
    assert -sum(logprobs(trainer, "m", ce_datum())) < 0.8 * before
    # A forward-only call adds no gradient: with or without one in between, the same step.
    trainer.create("fresh-m", BASE, LoraSpec(rank=4, seed=3))
    trainer.create("fresh-n", BASE, LoraSpec(rank=4, seed=3))
    for model_id, extra in (("fresh-m", True), ("fresh-n", False)):
        ce_pass(trainer, model_id)
        if extra:
            ce_pass(trainer, model_id, backward=False)
        trainer.optim_step(model_id, AdamParams(learning_rate=0.05))
    assert_same_logprobs(trainer, "fresh-m", "fresh-n", 1e-6)


def test_forward_backward_in_pieces_interleaves_models_with_the_same_result(
    backends, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pieces of two models' calls alternate (as the FairScheduler runs them) and each
    model ends where one whole call would have: same outputs, same step."""
    trainer, _ = backends
    monkeypatch.setattr(lora_module, "TOKENS_PER_MICRO_BATCH", 8)  # a datum per piece
    data = [ce_datum(SEQ), ce_datum(SEQ[::-1]), ce_datum(SEQ[2:])]
    for model_id in ("whole", "piece-a", "piece-b"):
        trainer.create(model_id, BASE, LoraSpec(rank=4, seed=5))
    whole = trainer.forward_backward(
        "whole", ForwardBackwardInput(data, "cross_entropy"), backward=True
    )
    steps = [
        trainer.forward_backward_steps(
            m, ForwardBackwardInput(data, "cross_entropy"), backward=True
        )
        for m in ("piece-a", "piece-b")
    ]
    results: dict[int, Any] = {}
    pieces = 0
    while len(results) < 2:  # round-robin, one piece each
        for i, s in enumerate(steps):
            if i in results:
                continue
            try:
                next(s)
                pieces += 1
            except StopIteration as done:
                results[i] = done.value
    assert pieces >= 4  # more than one piece per call
    for result in results.values():
        assert result.metrics["loss:sum"] == pytest.approx(whole.metrics["loss:sum"], rel=1e-5)
    for model_id in ("whole", "piece-a", "piece-b"):
        trainer.optim_step(model_id, AdamParams(learning_rate=0.05))
    expected = logprobs(trainer, "whole", ce_datum())
    for model_id in ("piece-a", "piece-b"):
        assert logprobs(trainer, model_id, ce_datum()) == pytest.approx(expected, abs=1e-5)
    # A released model is gone, and a piece of it afterwards says so.
    late = trainer.forward_backward_steps(
        "piece-a", ForwardBackwardInput(data, "cross_entropy"), backward=False
    )
    next(late)
    trainer.release("piece-a")
    with pytest.raises(NotFoundError):
        next(late)


def test_each_loss_reports_its_formula_over_the_logprobs(backends) -> None:
    trainer, _ = backends
    trainer.create("m", BASE, LoraSpec(rank=4, seed=4))
    n = len(SEQ) - 1
    lp = logprobs(trainer, "m", ce_datum())
    q = [v - 0.1 * (i % 3) for i, v in enumerate(lp)]  # an off-policy sampler
    adv = [(-1) ** i * (0.5 + i / n) for i in range(n)]
    inputs = {
        "target_tokens": TensorValue.ints(SEQ[1:]),
        "logprobs": TensorValue.floats(q),
        "advantages": TensorValue.floats(adv),
        "sequence_ratio_mask": TensorValue.floats([0.0, 0.0] + [1.0] * (n - 2)),
        # stable_reinforce: the recorded sampler logprobs count on the sampled positions only
        "sampled_mask": TensorValue.floats([0.0, 0.0] + [1.0] * (n - 2)),
    }
    r = [math.exp(a - b) for a, b in zip(lp, q, strict=True)]
    # GSPO: one ratio, the geometric mean over the masked positions, on every token
    s = math.exp(sum(a - b for a, b in zip(lp[2:], q[2:], strict=True)) / (n - 2))
    expected = {
        "importance_sampling": -sum(x * a for x, a in zip(r, adv, strict=True)),
        "ppo": -sum(min(x * a, min(max(x, 0.8), 1.2) * a) for x, a in zip(r, adv, strict=True)),
        "cispo": -sum(min(max(x, 0.0), 4.0) * v * a for x, v, a in zip(r, lp, adv, strict=True)),
        "dro": -sum(v * a - 0.025 * (v - b) ** 2 for v, b, a in zip(lp, q, adv, strict=True)),
        "gspo": -sum(min(s * a, min(max(s, 0.8), 1.2) * a) for a in adv),
        # every ratio here is within the trust band [0.5, 2]; kl_coeff defaults to 0
        "stable_reinforce": -sum(x * a for x, a in zip(r[2:], adv[2:], strict=True)),
    }
    for loss, value in expected.items():
        out = trainer.forward_backward(
            "m", ForwardBackwardInput([Datum(SEQ[:-1], inputs)], loss), backward=False
        )
        assert out.metrics["loss:sum"] == pytest.approx(value, rel=1e-4, abs=1e-5), loss


def test_save_and_load_round_trip_with_and_without_the_optimizer(backends, tmp_path) -> None:
    trainer, _ = backends
    create_trained(trainer, "m", seed=5, steps=2)
    trainer.save("m", tmp_path, optimizer=True)
    trainer.create("copy", BASE, LoraSpec(rank=4, seed=9))
    trainer.load("copy", tmp_path, optimizer=True)
    assert_same_logprobs(trainer, "copy", "m", 1e-6)
    for model_id in ("m", "copy"):  # the same next step: the optimizer state came along
        ce_pass(trainer, model_id)
        trainer.optim_step(model_id, AdamParams(learning_rate=0.05))
    assert_same_logprobs(trainer, "copy", "m", 1e-5)


def test_dimuon_steps_lower_the_loss_and_its_momentum_survives_save_and_load(
    backends, tmp_path
) -> None:
    trainer, _ = backends
    # Each matrix moves by learning_rate * sqrt(rank) (Frobenius): the LoRA backend's B·A
    # counts alpha / rank = 8 times, the toy's once.
    lr = 0.4 if isinstance(trainer, ToyBackend) else 0.05
    dimuon = DimuonParams(learning_rate=lr, beta1=0.8)

    def step(model_id: str) -> dict[str, float]:
        ce_pass(trainer, model_id)
        return trainer.optim_step(model_id, dimuon)

    trainer.create("m", BASE, LoraSpec(rank=4, seed=5))
    before = -sum(logprobs(trainer, "m", ce_datum()))
    for _ in range(4):
        metrics = step("m")
        assert metrics["learning_rate:mean"] == lr and metrics["grad_norm:mean"] > 0
    assert -sum(logprobs(trainer, "m", ce_datum())) < 0.8 * before
    trainer.save("m", tmp_path, optimizer=True)
    # With the momentum: the same next step. Weights only: the momentum starts over.
    for model_id, with_state in (("resumed", True), ("weights", False)):
        trainer.create(model_id, BASE, LoraSpec(rank=4, seed=9))
        trainer.load(model_id, tmp_path, optimizer=with_state)
    for model_id in ("m", "resumed", "weights"):
        step(model_id)
    expected = logprobs(trainer, "m", ce_datum())
    assert logprobs(trainer, "resumed", ce_datum()) == pytest.approx(expected, abs=1e-5)
    assert logprobs(trainer, "weights", ce_datum()) != pytest.approx(expected, abs=1e-4)
    # A model with Dimuon state takes no AdamW step (and the reverse).
    with pytest.raises(InvalidTrainingRequest, match="dimuon"):
        trainer.optim_step("resumed", AdamParams(learning_rate=0.05))
    trainer.create("adam", BASE, LoraSpec(rank=4, seed=9))
    trainer.optim_step("adam", AdamParams(learning_rate=0.05))
    with pytest.raises(InvalidTrainingRequest, match="adamw"):
        trainer.optim_step("adam", dimuon)


def test_bad_input_and_unknown_models_raise_the_domain_errors(backends) -> None:
    trainer, _ = backends
    with pytest.raises((NotFoundError, InvalidTrainingRequest)):
        trainer.create("x", "no-such-model", LoraSpec(rank=4))
    trainer.create("m", BASE, LoraSpec(rank=4, seed=6))
    with pytest.raises(InvalidTrainingRequest):
        trainer.forward_backward(
            "m", ForwardBackwardInput([ce_datum([1, 99999])], "cross_entropy"), backward=True
        )
    trainer.release("m")
    with pytest.raises(NotFoundError):
        ce_pass(trainer, "m")
    trainer.release("m")  # twice: ignored


# --- SamplingBackend -------------------------------------------------------------------


def test_samples_carry_logprobs_stop_reasons_and_prompt_logprobs(backends, tmp_path) -> None:
    trainer, sampler = backends
    create_trained(trainer, "m", seed=7, steps=3)
    trainer.save("m", tmp_path, optimizer=False)

    async def run(source: WeightsSource, params: TinkerSamplingParams, n: int = 2) -> Any:
        return await sampler.sample(source, SampleRequest(SEQ, params, n, prompt_logprobs=True))

    params = TinkerSamplingParams(max_tokens=6, temperature=1.0, seed=11)
    saved = asyncio.run(run(WeightsSource(BASE, path=tmp_path), params))
    live = asyncio.run(run(WeightsSource(BASE, model_id="m"), params))
    assert len(saved.sequences) == 2
    for seq in saved.sequences:
        assert len(seq.tokens) == len(seq.logprobs) == 6 and seq.stop_reason == "length"
        assert all(v <= 0 for v in seq.logprobs)
    # Saved and live weights are the same adapter; same seeds, same samples.
    assert [s.tokens for s in saved.sequences] == [s.tokens for s in live.sequences]
    # Prompt logprobs: None first, then what the training forward computes.
    scored = saved.prompt_logprobs
    assert scored is not None and scored[0] is None and len(scored) == len(SEQ)
    assert scored[1:] == pytest.approx(logprobs(trainer, "m", ce_datum()), abs=1e-4)
    # A stop token ends a sequence with reason "stop", the token included.
    first = saved.sequences[0].tokens[0]
    stop = TinkerSamplingParams(max_tokens=6, temperature=1.0, seed=11, stop_token_ids=(first,))
    stopped = asyncio.run(run(WeightsSource(BASE, path=tmp_path), stop, 1))
    assert stopped.sequences[0].tokens == [first] and stopped.sequences[0].stop_reason == "stop"
    # The base model samples differently from the trained adapter (greedy, same prompt).
    greedy = TinkerSamplingParams(max_tokens=6, temperature=0.0)
    base = asyncio.run(run(WeightsSource(BASE), greedy, 1))
    tuned = asyncio.run(run(WeightsSource(BASE, path=tmp_path), greedy, 1))
    assert base.prompt_logprobs != tuned.prompt_logprobs
