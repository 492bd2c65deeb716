"""Dimuon: the torch optimizer and the toy backend's numpy step against the reference
(tests/support/dimuon_reference.py, the formula docs/tinker.md documents), on fixed inputs."""

import math

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from adapters.fake.toy_backend import ToyBackend
from adapters.torch.lora.dimuon import Dimuon, dimuon_direction
from domain.tinker.batch import ForwardBackwardInput
from domain.tinker.checks import check_dimuon
from domain.tinker.errors import InvalidTrainingRequest
from domain.tinker.values import AdamParams, Datum, DimuonParams, LoraSpec, TensorValue
from tests.support import dimuon_reference as reference

SHAPES = [(4, 24), (24, 4), (3, 3), (1, 7), (4, 24)]  # two of one shape: one batch


def test_the_direction_is_an_orthogonalized_matrix_of_frobenius_norm_sqrt_rank() -> None:
    torch.manual_seed(0)
    for shape in SHAPES:
        m = torch.randn(*shape)
        d = dimuon_direction(m)
        assert d.shape == m.shape and d.dtype == torch.float32
        k = min(shape)
        assert torch.linalg.matrix_norm(d).item() == pytest.approx(math.sqrt(k), rel=1e-5)
        # Newton–Schulz leaves every singular value near 1 (Muon's band is about 0.7-1.2).
        singular = torch.linalg.svdvals(d * math.sqrt(k) / torch.linalg.matrix_norm(d))
        assert singular.min() > 0.6 and singular.max() < 1.35, (shape, singular)
        # Scale-free: a gradient a trillion times smaller points the same way.
        assert_close(dimuon_direction(m * 1e-12), d, atol=1e-6, rtol=1e-5)
        assert_close(d.double(), reference.direction(m), atol=2e-6, rtol=1e-5)
    assert not dimuon_direction(torch.zeros(4, 8)).any()  # zero momentum, zero step


def test_the_torch_optimizer_matches_the_reference_step_by_step() -> None:
    generator = torch.Generator().manual_seed(1)
    weights = [torch.randn(*s, generator=generator) for s in SHAPES]
    params = [w.clone().requires_grad_() for w in weights]
    optimizer = Dimuon(params, lr=0.03, beta1=0.7)
    momenta = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
    ref = [w.double() for w in weights]
    for n in range(3):
        grads = [torch.randn(*s, generator=generator) for s in SHAPES]
        if n == 0:
            grads[0] = torch.zeros(SHAPES[0])  # LoRA's A at the first step: no gradient
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        optimizer.step()
        ref, momenta = reference.step(ref, grads, momenta, lr=0.03, beta1=0.7, clip=0.0)
        for p, w, m in zip(params, ref, momenta, strict=True):
            assert_close(p.detach().double(), w, atol=2e-6, rtol=1e-5)
            assert_close(optimizer.state[p]["momentum_buffer"].double(), m, atol=1e-7, rtol=1e-6)
        if n == 0:
            assert torch.equal(params[0].detach(), weights[0])  # the zero momentum stayed put
    assert all(float(optimizer.state[p]["step"]) == 3 for p in params)


@pytest.mark.parametrize("clip", [0.0, 0.5])
def test_the_toy_backend_step_matches_the_reference(clip: float) -> None:
    toy = ToyBackend("toy", vocab_size=40, dim=12)
    toy.create("m", "toy", LoraSpec(rank=3, seed=2))
    adapter = toy._get("m")
    seq = [3, 9, 27, 1, 30, 11, 5]
    batch = ForwardBackwardInput(
        [Datum(seq[:-1], {"target_tokens": TensorValue.ints(seq[1:])})], "cross_entropy"
    )
    momenta = [torch.zeros(adapter.a.shape, dtype=torch.float64)]
    momenta.append(torch.zeros(adapter.b.shape, dtype=torch.float64))
    for n in range(3):
        toy.forward_backward("m", batch, backward=True)
        grads = [torch.from_numpy(adapter.grad_a.copy()), torch.from_numpy(adapter.grad_b.copy())]
        before = [torch.from_numpy(adapter.a.copy()), torch.from_numpy(adapter.b.copy())]
        if clip:
            assert math.sqrt(sum(float(g.square().sum()) for g in grads)) > clip
        metrics = toy.optim_step(
            "m", DimuonParams(learning_rate=0.2, beta1=0.6, grad_clip_norm=clip)
        )
        want, momenta = reference.step(before, grads, momenta, lr=0.2, beta1=0.6, clip=clip)
        got = [torch.from_numpy(adapter.a), torch.from_numpy(adapter.b)]
        for g, w in zip(got, want, strict=True):
            assert_close(g.double(), w, atol=2e-6, rtol=1e-5)
        if n == 0:  # B started at zero, so A had no gradient and did not move
            assert torch.equal(got[0], before[0]) and not torch.equal(got[1], before[1])
        norm = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
        assert metrics["grad_norm:mean"] == pytest.approx(norm, rel=1e-5)
    # AdamW on a model that has Dimuon momentum is refused, whatever the caller checked.
    with pytest.raises(InvalidTrainingRequest, match="dimuon"):
        toy.optim_step("m", AdamParams())


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("learning_rate", -0.1),
        ("learning_rate", 2.0),
        ("learning_rate", math.nan),
        ("beta1", 1.0),
        ("beta1", -0.5),
        ("grad_clip_norm", math.inf),
        ("grad_clip_norm", math.nan),
    ],
)
def test_check_dimuon_names_the_bad_parameter(field: str, value: float) -> None:
    params = DimuonParams(**{"learning_rate": 0.01, field: value})
    with pytest.raises(InvalidTrainingRequest, match=f"optimizer_params.{field}"):
        check_dimuon(params)


def test_check_dimuon_takes_the_sdk_defaults_and_a_nonpositive_clip() -> None:
    for params in (
        DimuonParams(learning_rate=0.0),
        DimuonParams(learning_rate=1.0, beta1=0.0, grad_clip_norm=-1.0),
    ):
        check_dimuon(params)
    assert np.isclose(DimuonParams(learning_rate=0.1).beta1, 0.9)
