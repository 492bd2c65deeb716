"""Dimuon as docs/tinker.md documents it, written out plainly in float64 torch: the reference the
LoRA backend's and the toy backend's steps are checked against."""

import math

from torch import Tensor


def direction(momentum: Tensor) -> Tensor:
    """Row/column preconditioning (damping 0.1), five quintic Newton–Schulz iterations
    (3.4445, -4.7750, 2.0315), Frobenius norm sqrt(min(shape))."""
    x = momentum.double()
    x = x / x.square().mean().sqrt()
    r = x.square().mean(dim=1, keepdim=True)
    c = x.square().mean(dim=0, keepdim=True)
    p = x / ((r + 0.1) * (c + 0.1)) ** 0.25
    wide = p.shape[0] <= p.shape[1]
    y = p if wide else p.T
    y = y / y.norm()
    for _ in range(5):
        a = y @ y.T
        y = 3.4445 * y - 4.7750 * a @ y + 2.0315 * a @ a @ y
    o = y if wide else y.T
    return o * math.sqrt(min(o.shape)) / o.norm()


def step(
    weights: list[Tensor],
    grads: list[Tensor],
    momenta: list[Tensor],
    *,
    lr: float,
    beta1: float,
    clip: float,
) -> tuple[list[Tensor], list[Tensor]]:
    """One step over every matrix: (new weights, new momenta), float64. ``clip`` > 0 scales
    the gradients to at most that global norm; a zero momentum leaves its matrix."""
    norm = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
    scale = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0
    new_w, new_m = [], []
    for w, g, m in zip(weights, grads, momenta, strict=True):
        m = beta1 * m.double() + (1 - beta1) * scale * g.double()
        moved = m.abs().max() > 0
        new_m.append(m)
        new_w.append(w.double() - lr * direction(m) if moved else w.double())
    return new_w, new_m
