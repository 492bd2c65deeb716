"""A PEFT adapter folder that learned a text, written by the LoRA training backend (the
format ``--lora-modules`` serves), for tests that serve one.

The recipe is meant to converge whatever the machine's kernels round like: a modest AdamW
step with the gradient clipped, training stopped as soon as the text is learned (AdamW keeps
stepping at full size once the gradients vanish, so training on past that point only adds
noise), and an error with the loss curve when it is not learned within ``max_steps``. A test
then serves an adapter that provably learned its text, never one that happened to land on it.
"""

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from adapters.torch.lora.peft import ADAPTER_WEIGHTS, write_config
from adapters.torch.lora.training import BaseModelEntry, LoraTrainingBackend
from domain.tinker.batch import ForwardBackwardInput
from domain.tinker.values import AdamParams, Datum, LoraSpec, TensorValue

# Training stops once the mean cross-entropy per predicted token is below this (nats):
# each target token then has a probability of about 0.99 or more, a margin that survives
# the serving kernels' rounding (a quantized base, other reduction orders).
CONVERGED_LOSS = 0.01


@dataclass(frozen=True, slots=True)
class TrainedAdapter:
    """The adapter's folder and the loss (summed over the text's tokens) before each step
    taken, then the loss of the saved weights last."""

    path: Path
    losses: list[float]


def trained_adapter(
    model_folder: Path,
    tokens: Sequence[int],
    out: Path,
    *,
    rank: int,
    learning_rate: float = 1e-3,
    grad_clip_norm: float = 1.0,
    max_steps: int = 40,
    seed: int = 1,
    dtype: torch.dtype = torch.bfloat16,
) -> TrainedAdapter:
    """``out``, holding an adapter of ``model_folder``'s model trained to continue ``tokens``
    (each token predicted from those before it) until it has learned them; AssertionError,
    with the loss curve, if it has not within ``max_steps`` AdamW steps."""
    backend = LoraTrainingBackend([BaseModelEntry("base", model_folder, dtype=dtype)])
    backend.create("adapter", "base", LoraSpec(rank=rank, seed=seed))
    datum = Datum(list(tokens[:-1]), {"target_tokens": TensorValue.ints(list(tokens[1:]))})
    batch = ForwardBackwardInput([datum], "cross_entropy")
    params = AdamParams(learning_rate=learning_rate, grad_clip_norm=grad_clip_norm)
    losses = train_until_learned(
        lambda: backend.forward_backward("adapter", batch, backward=True).metrics["loss:sum"],
        lambda: backend.optim_step("adapter", params),
        targets=len(tokens) - 1,
        max_steps=max_steps,
    )
    backend.save("adapter", out, optimizer=False)
    return TrainedAdapter(out, losses)


def train_until_learned(
    forward_backward: Callable[[], float],
    optim_step: Callable[[], object],
    *,
    targets: int,
    max_steps: int,
) -> list[float]:
    """The losses of ``forward_backward`` (a cross-entropy summed over ``targets`` tokens),
    each followed by ``optim_step`` until the mean is below :data:`CONVERGED_LOSS`; the last
    loss is that of the weights training stopped at. AssertionError, with the losses, if it
    is not below after ``max_steps`` steps."""
    losses: list[float] = []
    for _ in range(max_steps + 1):
        losses.append(forward_backward())
        if losses[-1] < CONVERGED_LOSS * targets or len(losses) > max_steps:
            break
        optim_step()
    assert losses[-1] < CONVERGED_LOSS * targets, f"the text was not learned: losses {losses}"
    return losses


MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def random_adapter(folder: Path, model: Path, rank: int, seed: int = 0) -> Path:
    """A PEFT adapter for ``model`` (its config.json's shapes) on every projection, random
    (B = 0.01 * random: the output changes), written to ``folder``; the folder."""
    config = json.loads((model / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    shapes = {  # module -> (in, out)
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv * head_dim),
        "v_proj": (hidden, kv * head_dim),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for layer in range(config["num_hidden_layers"]):
        for name, (n_in, n_out) in shapes.items():
            part = "self_attn" if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{name}"
            state[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=generator) / n_in**0.5
            state[f"{key}.lora_B.weight"] = 0.01 * torch.randn(n_out, rank, generator=generator)
    folder.mkdir(parents=True)
    save_file(state, str(folder / ADAPTER_WEIGHTS))
    write_config(folder, base_model=config.get("_name_or_path", "base"), rank=rank, modules=MODULES)
    return folder
