"""PEFT's LoRA adapter format, in one place (the training backend writes and reads it, the
serving adapters load it).

An adapter folder holds ``adapter_model.safetensors`` (tensors named
``base_model.model.<module>.lora_A.weight`` / ``lora_B``, by Hugging Face module name) and
``adapter_config.json``. Each linear of ours that LoRA can target holds one or more of those
modules in row order (``wqkv``: q, k, v; ``w13``: gate, up); updates are scaled by
``lora_alpha / r``.
"""

import json
from collections.abc import Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

from safetensors import SafetensorError, safe_open
from torch import Tensor

from adapters.torch.models.config import ModelConfig
from domain.tinker.errors import InvalidTrainingRequest
from domain.tinker.values import LoraSpec

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
# The alpha our adapters are trained with (and the only one a training load accepts).
LORA_ALPHA = 32
ATTN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
UNEMBED_TARGETS = ("lm_head",)
# The target groups a LoraSpec switches on and off together.
GROUPS = {"attn": ATTN_TARGETS, "mlp": MLP_TARGETS, "unembed": UNEMBED_TARGETS}

Pair = tuple[Tensor | None, Tensor | None]  # (A [r, in], B [out, r]) as far as found
T = TypeVar("T")


def tensor_key(module: str, matrix: Literal["A", "B"]) -> str:
    """The tensor name of ``module``'s LoRA ``A`` or ``B`` matrix."""
    return f"base_model.model.{module}.lora_{matrix}.weight"


def module_pairs(state: Mapping[str, T]) -> dict[str, tuple[T | None, T | None]]:
    """``state``'s (A, B) by module name (tensors, or their shapes); tensors that are not
    LoRA matrices are ignored."""
    pairs: dict[str, tuple[T | None, T | None]] = {}
    for key, value in state.items():
        if not key.endswith((".lora_A.weight", ".lora_B.weight")):
            continue
        module = key.removeprefix("base_model.model.").rsplit(".lora_", 1)[0]
        a, b = pairs.get(module, (None, None))
        pairs[module] = (value, b) if ".lora_A." in key else (a, value)
    return pairs


def site_parts(num_layers: int) -> Iterator[tuple[str, tuple[str, ...]]]:
    """(our module path, the PEFT module names of its row slices) of every target linear."""
    for i in range(num_layers):
        ours, peft = f"layers.{i}", f"model.layers.{i}"
        yield f"{ours}.attn.wqkv", tuple(f"{peft}.self_attn.{p}" for p in ATTN_TARGETS[:3])
        yield f"{ours}.attn.wo", (f"{peft}.self_attn.o_proj",)
        yield f"{ours}.mlp.w13", (f"{peft}.mlp.gate_proj", f"{peft}.mlp.up_proj")
        yield f"{ours}.mlp.w2", (f"{peft}.mlp.down_proj",)
    yield "lm_head", ("lm_head",)


def part_rows(config: ModelConfig, parts: tuple[str, ...]) -> list[int]:
    """Output rows of each PEFT module in ``parts``."""
    rows = {
        "q_proj": config.q_size,
        "k_proj": config.kv_size,
        "v_proj": config.kv_size,
        "o_proj": config.hidden_size,
        "gate_proj": config.intermediate_size,
        "up_proj": config.intermediate_size,
        "down_proj": config.hidden_size,
        "lm_head": config.vocab_size,
    }
    return [rows[name.rsplit(".", 1)[-1]] for name in parts]


def in_features(config: ModelConfig, path: str) -> int:
    """Input features of our linear at ``path`` (a site of :func:`site_parts`)."""
    if path.endswith(".wo"):
        return config.q_size
    return config.intermediate_size if path.endswith(".w2") else config.hidden_size


def check_pair(
    name: str, a: Sequence[int] | None, b: Sequence[int] | None, features: int, rows: int
) -> None:
    """``InvalidTrainingRequest`` unless the shapes of PEFT module ``name``'s A and B are
    ``[r, features]`` and ``[rows, r]`` (this model's widths)."""
    if a is None or b is None or len(a) != 2 or len(b) != 2 or a[0] != b[1]:
        raise InvalidTrainingRequest(f"adapter tensors for {name} have wrong shapes")
    width = (a[1], b[0])
    if width != (features, rows):  # another base model's widths
        raise InvalidTrainingRequest(
            f"adapter tensors for {name} map {width[0]} -> {width[1]} features, "
            f"this model's {features} -> {rows}: an adapter of another base model"
        )


def check_rank(config: Mapping[str, Any], max_rank: int | None) -> None:
    """``InvalidTrainingRequest`` when an ``adapter_config.json``'s rank is over
    ``max_rank`` (``--max-lora-rank``; None: any)."""
    rank = config.get("r")
    if max_rank is not None and isinstance(rank, int) and rank > max_rank:
        raise InvalidTrainingRequest(
            f"its rank {rank} is over the server's --max-lora-rank {max_rank}"
        )


def check_folder(folder: Path, model: ModelConfig, max_rank: int | None = None) -> None:
    """What loading the PEFT adapter in ``folder`` for ``model`` checks (its
    ``adapter_config.json``, its rank, each matrix's widths), without loading it: the
    shapes are read from the safetensors header. ``InvalidTrainingRequest`` saying what is
    wrong, as :meth:`~adapters.torch.lora.serving.LoraServing.load_folder` says it (a fleet's
    ingress checks a folder so, holding no weights)."""
    config = read_config(folder)
    check_rank(config, max_rank)
    try:
        scale(config)
        with safe_open(str(folder / ADAPTER_WEIGHTS), framework="pt") as weights:
            shapes = {k: tuple(weights.get_slice(k).get_shape()) for k in weights.keys()}  # noqa: SIM118
    except (OSError, ValueError, SafetensorError) as e:  # named without the server's path
        raise InvalidTrainingRequest("the checkpoint is not a readable LoRA adapter") from e
    pairs = module_pairs(shapes)
    targeted = False
    for path, names in site_parts(model.num_layers):
        for name, rows in zip(names, part_rows(model, names), strict=True):
            if name in pairs:
                check_pair(name, *pairs[name], in_features(model, path), rows)
                targeted = True
    if not targeted:
        raise InvalidTrainingRequest("the adapter targets no module of this model")


def targets(spec: LoraSpec) -> frozenset[str]:
    """The PEFT ``target_modules`` a spec trains."""
    on = {"attn": spec.train_attn, "mlp": spec.train_mlp, "unembed": spec.train_unembed}
    return frozenset(name for group, names in GROUPS.items() if on[group] for name in names)


def scale(config: Mapping[str, Any]) -> float:
    """The update scale ``lora_alpha / r`` of an ``adapter_config.json`` (alpha defaults to
    r, as in PEFT)."""
    rank = config.get("r")
    alpha = config.get("lora_alpha", rank)
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, int | float):
        raise InvalidTrainingRequest(f"{ADAPTER_CONFIG}: r must be a positive integer")
    return float(alpha) / float(rank)


def write_config(folder: Path, *, base_model: str, rank: int, modules: Collection[str]) -> None:
    """Write the ``adapter_config.json`` of an adapter of ``rank`` on ``modules``."""
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": LORA_ALPHA,
        "lora_dropout": 0.0,
        "target_modules": sorted(modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def read_config(folder: Path) -> dict[str, Any]:
    """``folder``'s ``adapter_config.json`` (errors name the file, never the folder)."""
    path = folder / ADAPTER_CONFIG
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise InvalidTrainingRequest(f"{path.name}: missing (not a LoRA checkpoint)") from e
    except (OSError, ValueError) as e:
        raise InvalidTrainingRequest(f"{path.name}: unreadable") from e
    if not isinstance(raw, dict):
        raise InvalidTrainingRequest(f"{path.name}: not a JSON object")
    return raw


def read_lora_spec(folder: Path) -> LoraSpec:
    """The rank and targets of the PEFT adapter in ``folder``, if it is one our training
    backend can continue (alpha ``LORA_ALPHA``, plain LoRA, whole target groups)."""
    raw = read_config(folder)
    where = ADAPTER_CONFIG  # named by file, never by where the server keeps it
    if raw.get("peft_type") != "LORA":
        raise InvalidTrainingRequest(f"{where}: peft_type is {raw.get('peft_type')!r}, not LORA")
    rank, alpha = raw.get("r"), raw.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1:
        raise InvalidTrainingRequest(f"{where}: r must be a positive integer, got {rank!r}")
    if alpha != LORA_ALPHA:
        raise InvalidTrainingRequest(f"{where}: lora_alpha {alpha!r} (only {LORA_ALPHA} is served)")
    for flag in ("use_dora", "use_rslora", "fan_in_fan_out"):
        if raw.get(flag):
            raise InvalidTrainingRequest(f"{where}: {flag} is not supported")
    modules = raw.get("target_modules")
    if not isinstance(modules, list):
        raise InvalidTrainingRequest(f"{where}: target_modules must be a list of module names")
    groups = {g: set(names) & set(modules) for g, names in GROUPS.items()}
    if set(modules) != set().union(*groups.values()) or any(
        found and found != set(GROUPS[g]) for g, found in groups.items()
    ):
        raise InvalidTrainingRequest(
            f"{where}: target_modules {sorted(modules)} must be whole groups of "
            f"{[list(names) for names in GROUPS.values()]}"
        )
    return LoraSpec(
        rank=rank,
        train_mlp=bool(groups["mlp"]),
        train_attn=bool(groups["attn"]),
        train_unembed=bool(groups["unembed"]),
    )
