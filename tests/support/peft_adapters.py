"""A PEFT adapter folder that learned a text, written by the LoRA training backend (the
format ``--lora-modules`` serves), for tests that serve one."""

from collections.abc import Sequence
from pathlib import Path

import torch

from adapters.torch.lora.training import BaseModelEntry, LoraTrainingBackend
from domain.training import AdamParams, Datum, ForwardBackwardInput, LoraSpec, TensorValue


def trained_adapter(
    model_folder: Path,
    tokens: Sequence[int],
    out: Path,
    *,
    rank: int,
    steps: int,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """``out``, holding an adapter of ``model_folder``'s model trained ``steps`` times to
    continue ``tokens`` (each token predicted from those before it)."""
    backend = LoraTrainingBackend([BaseModelEntry("base", model_folder, dtype=dtype)])
    backend.create("adapter", "base", LoraSpec(rank=rank, seed=1))
    datum = Datum(list(tokens[:-1]), {"target_tokens": TensorValue.ints(list(tokens[1:]))})
    for _ in range(steps):
        batch = ForwardBackwardInput([datum], "cross_entropy")
        backend.forward_backward("adapter", batch, backward=True)
        backend.optim_step("adapter", AdamParams(learning_rate=0.05))
    backend.save("adapter", out, optimizer=False)
    return out
