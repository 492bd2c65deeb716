"""Training through inference kernels: the forward is a kernel's (so a trainer's logprobs
round as the serving engine's, bit for bit), the gradient that of a plain PyTorch
computation of the same function (the kernels have no backward).

``through(kernel, reference, *inputs)`` returns ``kernel(*inputs)``; backward runs
``reference(*inputs)`` again under autograd and differentiates it. The two agree to
rounding, so the gradient is the reference's at the kernel's inputs (as activation
checkpointing recomputes a forward). Inputs that need no gradient (frozen weights) get none.
"""

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor

Fn = Callable[..., Tensor]


class _Through(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, kernel: Fn, reference: Fn, *inputs: Tensor) -> Tensor:
        ctx.reference = reference
        ctx.save_for_backward(*inputs)
        with torch.no_grad():
            return kernel(*inputs)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        wanted = ctx.needs_input_grad[2:]
        inputs = [
            t.detach().requires_grad_(w) if isinstance(t, Tensor) else t
            for t, w in zip(ctx.saved_tensors, wanted, strict=True)
        ]
        with torch.enable_grad():
            out = ctx.reference(*inputs)
        needed = [t for t, w in zip(inputs, wanted, strict=True) if w]
        grads = iter(torch.autograd.grad(out, needed, grad, allow_unused=True))
        return (None, None, *[next(grads) if w else None for w in wanted])


def through(kernel: Fn, reference: Fn, *inputs: Tensor) -> Tensor:
    """``kernel(*inputs)``, differentiable as ``reference(*inputs)`` where a gradient is
    needed (grad mode on and an input requires it); the kernel alone otherwise."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        return cast(Tensor, _Through.apply(kernel, reference, *inputs))
    return kernel(*inputs)
