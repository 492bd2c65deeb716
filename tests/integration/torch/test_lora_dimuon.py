"""Dimuon in the LoRA training backend (a tiny random Llama, fp32, CPU): its steps against
the reference (tests/support/dimuon_reference.py) on the backend's own gradients, with and
without clipping, and its momentum in the optimizer state file."""

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.testing import assert_close

from adapters.torch.lora.training import OPTIMIZER_STATE, BaseModelEntry, LoraTrainingBackend
from domain.tinker.batch import ForwardBackwardInput
from domain.tinker.errors import InvalidTrainingRequest
from domain.tinker.values import AdamParams, Datum, DimuonParams, LoraSpec, TensorValue
from tests.support import dimuon_reference as reference
from tests.support.tiny_models import save_tiny_model

SEQS = [[5, 17, 42, 7, 99, 3, 250, 8, 61], [11, 4, 200, 9, 31]]


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> LoraTrainingBackend:
    folder = tmp_path_factory.mktemp("llama")
    save_tiny_model("llama", folder)
    return LoraTrainingBackend([BaseModelEntry("llama", folder, dtype=torch.float32)])


def _batch() -> ForwardBackwardInput:
    data = [Datum(s[:-1], {"target_tokens": TensorValue.ints(s[1:])}) for s in SEQS]
    return ForwardBackwardInput(data, "cross_entropy")


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_dimuon_steps_equal_the_reference_on_the_backends_gradients(
    backend: LoraTrainingBackend, clip: float
) -> None:
    model_id = f"clip-{clip}"
    backend.create(model_id, "llama", LoraSpec(rank=4, seed=3, train_unembed=False))
    params = backend._adapter(model_id).params
    momenta = [torch.zeros(p.shape, dtype=torch.float64) for p in params]
    dimuon = DimuonParams(learning_rate=0.02, beta1=0.7, grad_clip_norm=clip)
    for n in range(3):
        backend.forward_backward(model_id, _batch(), backward=True)
        grads = [p.grad.detach().clone() for p in params if p.grad is not None]
        before = [p.detach().clone() for p in params]
        norm = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
        if clip:
            assert norm > clip  # the clip applies
        metrics = backend.optim_step(model_id, dimuon)
        assert metrics["grad_norm:mean"] == pytest.approx(norm, rel=1e-5)
        want, momenta = reference.step(before, grads, momenta, lr=0.02, beta1=0.7, clip=clip)
        for p, w, b in zip(params, want, before, strict=True):
            assert_close(p.detach().double(), w, atol=1e-6, rtol=1e-5)
            moved = torch.linalg.matrix_norm(p.detach() - b).item()
            if n == 0 and p.shape[0] == 4:  # every A: B = 0 gave it no gradient, no step
                assert moved == 0
            else:  # each matrix moves by learning_rate * sqrt(rank) exactly
                assert moved == pytest.approx(0.02 * math.sqrt(4), rel=1e-4)
    backend.release(model_id)


def test_the_state_file_holds_the_momentum_and_loads_back(
    backend: LoraTrainingBackend, tmp_path: Path
) -> None:
    backend.create("saved", "llama", LoraSpec(rank=4, seed=4))
    for _ in range(2):
        backend.forward_backward("saved", _batch(), backward=True)
        backend.optim_step("saved", DimuonParams(learning_rate=0.02))
    backend.save("saved", tmp_path, optimizer=True)
    tensors = load_file(tmp_path / OPTIMIZER_STATE)
    adapter = backend._adapter("saved")
    keys = list(adapter.state_dict())
    assert set(tensors) == {f"{k}.{s}" for k in keys for s in ("momentum_buffer", "step")}
    for key, p in zip(keys, adapter.params, strict=True):
        assert torch.equal(
            tensors[f"{key}.momentum_buffer"], adapter.optimizer.state[p]["momentum_buffer"]
        )
        assert tensors[f"{key}.step"].item() == 2
    backend.create("loaded", "llama", LoraSpec(rank=4, seed=5))
    backend.load("loaded", tmp_path, optimizer=True)
    loaded = backend._adapter("loaded")
    assert loaded.family == "dimuon"
    for p in loaded.params:
        assert float(loaded.optimizer.state[p]["step"]) == 2
    with pytest.raises(InvalidTrainingRequest, match="dimuon"):
        backend.optim_step("loaded", AdamParams())
    # Weights only: a fresh optimizer, whichever family steps first.
    backend.load("loaded", tmp_path, optimizer=False)
    backend.optim_step("loaded", AdamParams())
    assert backend._adapter("loaded").family == "adamw"
