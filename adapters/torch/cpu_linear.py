"""oneDNN-prepacked linear layers for CPU inference, swapped in from outside the model.

A bf16 ``F.linear`` with one input row reaches about half of this machine's memory
bandwidth; the same matmul on a weight prepacked into oneDNN's blocked layout (what
inductor's freezing pass does) is ~1.5x faster and gives identical results. Packed weights
are opaque (no autograd, no state_dict), so only inference models are packed.
"""

import torch
from torch import Tensor, nn


class PackedLinear(nn.Module):
    """``y = x @ W.T (+ b)`` with ``W`` prepacked by oneDNN; any number of leading dims."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def can_pack(model: nn.Module) -> bool:
    """Packing needs oneDNN with bf16 support, a CPU model and bf16 weights."""
    weight = next(model.parameters())
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def pack_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` in ``model`` by a :class:`PackedLinear`; returns how many."""
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, PackedLinear(linear))
    return len(targets)
