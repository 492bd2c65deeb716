"""Dimuon, Tinker's second optimizer (``DimuonParams``, optimizer version 1), on LoRA matrices.

Tinker documents the interface, not the algorithm: an EMA of the gradients (``beta1``), a
row and column preconditioner, a matrix-sign iteration, and a learning rate "applied to a
direction with Frobenius norm sqrt(rank)". This is our version of it. Per step, on each
matrix ``W`` (``[p, q]``) with gradient ``G`` (clipped to the global norm by the caller):

1. momentum ``M = beta1 * M + (1 - beta1) * G`` (from zero; no bias correction: the
   direction below does not depend on M's scale);
2. row/column preconditioning: ``X = M / rms(M)``, ``P = X / ((R + DAMPING)^¼ (C + DAMPING)^¼)``
   with ``R_i = mean_j X_ij²`` and ``C_j = mean_i X_ij²`` — diagonal Shampoo's
   ``L^-¼ M R^-¼`` with the momentum's own row and column second moments; the damping
   smooths it (DAMPING → ∞ is plain Muon);
3. matrix sign ``O ≈ U Vᵀ`` of ``P = U Σ Vᵀ``: NS_STEPS quintic Newton–Schulz iterations with
   Muon's coefficients on ``P / ‖P‖_F``;
4. ``D = O · sqrt(k) / ‖O‖_F`` with ``k = min(p, q)``, the LoRA rank: the direction's
   Frobenius norm is sqrt(rank) exactly (the iteration leaves singular values near 1, not
   at 1);
5. ``W -= learning_rate · D`` (no weight decay: DimuonParams has none).

A zero momentum (LoRA's A before B has moved) gives a zero step. Everything is float32.
"""

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

# Muon's quintic Newton–Schulz coefficients (Keller Jordan): singular values of a matrix of
# Frobenius norm 1 are pushed into about [0.7, 1.2] in five iterations.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
DAMPING = 0.1  # relative to the mean row / column second moment (1 after normalizing)
EPS = 1e-7  # normalization epsilon
_TINY = 1e-30  # keeps a zero matrix zero (no 0 / 0)


def newton_schulz(p: Tensor) -> Tensor:
    """≈ ``U Vᵀ`` of each ``p = U Σ Vᵀ`` (``[..., rows, cols]`` float32), by NS_STEPS quintic
    iterations."""
    tall = p.shape[-2] > p.shape[-1]
    x = p.mT if tall else p  # the Gram matrix x xᵀ is the small one
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + EPS)
    a, b, c = NS_COEFFICIENTS
    for _ in range(NS_STEPS):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


def directions(momenta: Tensor) -> Tensor:
    """The update direction (steps 2-4 above) of each matrix of ``momenta``
    (``[batch, rows, cols]``), float32."""
    m = momenta.float()
    x = m / (m.abs().amax(dim=(-2, -1), keepdim=True) + _TINY)  # no underflow in the squares
    x = x / (x.square().mean(dim=(-2, -1), keepdim=True) + _TINY).sqrt()
    sq = x.square()
    rows = (sq.mean(dim=-1, keepdim=True) + DAMPING) ** -0.25
    cols = (sq.mean(dim=-2, keepdim=True) + DAMPING) ** -0.25
    o = newton_schulz(x * rows * cols)
    k = min(o.shape[-2:])
    return o * (k**0.5 / (torch.linalg.matrix_norm(o, keepdim=True) + EPS))


def dimuon_direction(momentum: Tensor) -> Tensor:
    """One momentum tensor's update direction, its shape and float32: a vector is a one-row
    matrix, a tensor of more dimensions one row per first index."""
    rows = momentum.shape[0] if momentum.ndim > 1 else 1
    return directions(momentum.reshape(1, rows, -1))[0].reshape(momentum.shape)


class Dimuon(torch.optim.Optimizer):
    """Dimuon (see the module docstring) with ``lr`` and ``beta1`` per parameter group.

    State per parameter: ``momentum_buffer`` and ``step``. The matrices of one shape are
    orthogonalized as one batch (a LoRA adapter has a few shapes, hundreds of matrices).
    Gradient clipping is the caller's: one global norm over every parameter, as for AdamW."""

    def __init__(self, params: Iterable[Tensor], lr: float = 0.0, beta1: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "beta1": beta1})

    @torch.no_grad()
    def step(  # type: ignore[override]  # torch's overloads, as one signature
        self, closure: Callable[[], float] | None = None
    ) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, beta1 = group["lr"], group["beta1"]
            same_shape: dict[tuple[torch.Size, torch.device], list[Tensor]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                state: dict[str, Any] = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["momentum_buffer"] = torch.zeros_like(p)
                state["momentum_buffer"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
                state["step"] += 1
                same_shape.setdefault((p.shape, p.device), []).append(p)
            for (shape, _), params in same_shape.items():
                rows = shape[0] if len(shape) > 1 else 1
                momenta = torch.stack([self.state[p]["momentum_buffer"] for p in params])
                updates = directions(momenta.reshape(len(params), rows, -1))
                for p, d in zip(params, updates, strict=True):
                    p.add_(d.reshape(shape).to(p.dtype), alpha=-lr)
        return loss
