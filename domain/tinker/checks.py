"""What a training request must satisfy: loss configs and inputs, optimizer parameters,
checkpoint names; and the sizes a batch is metered by."""

import math
from collections.abc import Mapping, Sequence

from domain.tinker.errors import InvalidTrainingRequest
from domain.tinker.values import (
    LOSS_CONFIG_DEFAULTS,
    LOSS_FNS,
    LOSS_INPUTS,
    AdamParams,
    Datum,
    DimuonParams,
)


def loss_config(loss_fn: str, given: Mapping[str, float] | None) -> dict[str, float]:
    """The loss's config: its defaults updated with ``given``; unknown losses or keys raise."""
    if loss_fn not in LOSS_FNS:
        raise InvalidTrainingRequest(
            f"loss_fn: unknown loss {loss_fn!r} (supported: {', '.join(LOSS_FNS)})"
        )
    defaults = LOSS_CONFIG_DEFAULTS[loss_fn]
    unknown = sorted(set(given or {}) - set(defaults))
    if unknown:
        allowed = ", ".join(defaults) or "none"
        raise InvalidTrainingRequest(
            f"loss_fn_config: {unknown[0]!r} is not a parameter of {loss_fn} (allowed: {allowed})"
        )
    config = {**defaults, **{k: float(v) for k, v in (given or {}).items()}}
    if config.get("clip_low_threshold", 0.0) > config.get("clip_high_threshold", 0.0):
        raise InvalidTrainingRequest(
            "loss_fn_config: clip_low_threshold must not exceed clip_high_threshold"
        )
    return config


def check_data(data: Sequence[Datum], loss_fn: str) -> None:
    """Each datum has tokens and the loss's inputs, one value per input position; target
    tokens are integers, every other input a finite float."""
    if loss_fn not in LOSS_INPUTS:
        raise InvalidTrainingRequest(
            f"loss_fn {loss_fn!r} is not supported (supported: {', '.join(LOSS_FNS)})"
        )
    if not data:
        raise InvalidTrainingRequest("forward_backward needs at least one datum")
    for i, datum in enumerate(data):
        length = len(datum.tokens)
        if length == 0:
            raise InvalidTrainingRequest(f"data[{i}].model_input: needs at least one token")
        for key in LOSS_INPUTS[loss_fn]:
            value = datum.loss_fn_inputs.get(key)
            if value is None:
                if key == "weights":
                    continue  # cross_entropy weights default to 1
                raise InvalidTrainingRequest(f"data[{i}].loss_fn_inputs: {loss_fn} needs {key!r}")
            where = f"data[{i}].loss_fn_inputs[{key!r}]"
            if len(value.data) != length:
                raise InvalidTrainingRequest(
                    f"{where} has {len(value.data)} values for "
                    f"{length} input tokens (one per input position)"
                )
            if key == "target_tokens":
                if value.dtype != "int64":
                    raise InvalidTrainingRequest(f"{where}: token ids must be int64")
            elif not all(map(math.isfinite, value.data)):
                raise InvalidTrainingRequest(f"{where}: values must be finite float32 numbers")


# AdamW on a LoRA adapter: the step of each weight is about ``learning_rate``; beyond these
# bounds the adapter's weights overflow (a user error, reported as one).
MAX_LEARNING_RATE = 1.0


MAX_WEIGHT_DECAY = 1.0


def check_adam(p: AdamParams) -> None:
    """Every AdamW parameter finite and in range (``InvalidTrainingRequest`` names it)."""
    checks = [
        (
            "learning_rate",
            0 <= p.learning_rate <= MAX_LEARNING_RATE,
            f"in [0, {MAX_LEARNING_RATE}]",
        ),
        ("beta1", 0 <= p.beta1 < 1, "in [0, 1)"),
        ("beta2", 0 <= p.beta2 < 1, "in [0, 1)"),
        ("eps", 0 <= p.eps < math.inf, "finite and >= 0"),
        ("weight_decay", 0 <= p.weight_decay <= MAX_WEIGHT_DECAY, f"in [0, {MAX_WEIGHT_DECAY}]"),
        ("grad_clip_norm", 0 <= p.grad_clip_norm < math.inf, "finite and >= 0 (0: off)"),
    ]
    for name, ok, why in checks:  # NaN fails every comparison
        if not ok:
            raise InvalidTrainingRequest(
                f"adam_params.{name} must be {why}, got {getattr(p, name)}"
            )


def check_dimuon(p: DimuonParams) -> None:
    """Every Dimuon parameter finite and in range (``InvalidTrainingRequest`` names it)."""
    checks = [
        (
            "learning_rate",
            0 <= p.learning_rate <= MAX_LEARNING_RATE,
            f"in [0, {MAX_LEARNING_RATE}]",
        ),
        ("beta1", 0 <= p.beta1 < 1, "in [0, 1)"),
        ("grad_clip_norm", math.isfinite(p.grad_clip_norm), "finite (<= 0: off)"),
    ]
    for name, ok, why in checks:  # NaN fails every comparison
        if not ok:
            raise InvalidTrainingRequest(
                f"optimizer_params.{name} must be {why}, got {getattr(p, name)}"
            )


def data_tokens(data: Sequence[Datum]) -> int:
    return sum(len(d.tokens) for d in data)


def data_bytes(data: Sequence[Datum]) -> int:
    """The payload estimate the SDK uses: 4 bytes per token plus each tensor's bytes."""
    return sum(
        4 * len(d.tokens) + sum(v.data.itemsize * len(v.data) for v in d.loss_fn_inputs.values())
        for d in data
    )


def check_checkpoint_name(name: str) -> str:
    """A checkpoint name is one path segment of letters, digits, ``-``, ``_``, ``.``."""
    ok = name and len(name) <= 128 and name not in (".", "..")
    if not ok or any(not (c.isalnum() or c in "-_.") for c in name):
        raise InvalidTrainingRequest(
            f"checkpoint name {name!r} must be 1-128 letters, digits, '-', '_' or '.'"
        )
    return name
