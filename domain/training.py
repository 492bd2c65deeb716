"""Fine-tuning and sampling of LoRA adapters (the Tinker face): values, errors and ports.

Pure standard library. Tensors travel as ``array.array`` (``'f'`` float32, ``'q'`` int64)
with a shape, so adapters convert to numpy or torch without copying (buffer protocol)
and the domain stays free of both.
"""

from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from domain.errors import InferError

TensorDtype = Literal["float32", "int64"]
LossFn = Literal["cross_entropy", "importance_sampling", "ppo", "cispo", "dro"]
LOSS_FNS: tuple[str, ...] = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro")
# Inputs each loss reads besides ``target_tokens`` (Tinker's loss_fn_inputs keys).
LOSS_INPUTS: Mapping[str, tuple[str, ...]] = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
    "cispo": ("target_tokens", "logprobs", "advantages"),
    "dro": ("target_tokens", "logprobs", "advantages"),
}
# Each loss's ``loss_fn_config`` keys and defaults (Tinker's). As in Tinker's documentation,
# ``clip_low_threshold`` / ``clip_high_threshold`` bound the ratio itself
# (``clamp(r, low, high)``), not offsets from 1: PPO 0.8 / 1.2 (epsilon 0.2), CISPO
# 0.0 / 4.0 (an upper cap only); DRO's quadratic penalty ``beta`` 0.05.
LOSS_CONFIG_DEFAULTS: Mapping[str, Mapping[str, float]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
    "dro": {"beta": 0.05},
}
CheckpointKind = Literal["training", "sampler", "external"]


# --- errors -----------------------------------------------------------------------------


class TrainingError(InferError):
    """Base of the fine-tuning API's errors; ``category`` is Tinker's error category."""

    category: Literal["user", "server"] = "user"


class NotFoundError(TrainingError):
    """No such session, run, sampler, checkpoint or future (for this API key)."""


class InvalidTrainingRequest(TrainingError, ValueError):
    """A request is malformed or inconsistent (bad shapes, unknown loss, bad path...)."""


class UnsupportedFeatureError(TrainingError):
    """A feature the SDK can ask for that this server does not have."""


class SequenceConflictError(TrainingError):
    """A training request's ``seq_id`` was already used for its run."""


class SessionClosedError(TrainingError):
    """The session finished or expired; its pending work was cancelled."""


class BackendFailure(TrainingError):
    """The training backend failed on valid input (a server-side error)."""

    category = "server"


# --- values -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TensorValue:
    """A dense tensor: row-major ``data`` (``'f'`` float32 or ``'q'`` int64) of ``shape``."""

    data: array
    shape: tuple[int, ...]

    @property
    def dtype(self) -> TensorDtype:
        return "int64" if self.data.typecode == "q" else "float32"

    @staticmethod
    def floats(values: Sequence[float]) -> "TensorValue":
        return TensorValue(array("f", values), (len(values),))

    @staticmethod
    def ints(values: Sequence[int]) -> "TensorValue":
        return TensorValue(array("q", values), (len(values),))


@dataclass(frozen=True, slots=True)
class Datum:
    """One training example: the model's input tokens and the loss's inputs, per position."""

    tokens: Sequence[int]
    loss_fn_inputs: Mapping[str, TensorValue]


@dataclass(frozen=True, slots=True)
class LoraSpec:
    rank: int
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True


@dataclass(frozen=True, slots=True)
class AdamParams:
    """AdamW with decoupled weight decay; ``grad_clip_norm`` 0 turns clipping off."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


@dataclass(frozen=True, slots=True)
class ForwardBackwardResult:
    """Per-datum outputs (``logprobs`` of the target tokens at least) and ``name:reduction``
    metrics (``loss:sum``)."""

    outputs: list[dict[str, TensorValue]]
    metrics: dict[str, float]


@dataclass(frozen=True, slots=True)
class SampleParams:
    """Tinker's SamplingParams. ``stop_strings``/``stop_token_ids`` both None: stop at EOS."""

    max_tokens: int
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop_strings: tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] | None = None


TopK = list[tuple[int, float]]  # (token id, logprob) pairs, best first


@dataclass(frozen=True, slots=True)
class SampledSequence:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: Literal["stop", "length"]
    topk: list[TopK] | None = None  # per sampled token, when top-k sample logprobs are asked


@dataclass(frozen=True, slots=True)
class SampleResult:
    sequences: list[SampledSequence]
    # One entry per prompt token; the first is None (nothing predicts it).
    prompt_logprobs: list[float | None] | None = None
    # The same positions' top-k alternatives, when asked (the first is None).
    topk_prompt: list[TopK | None] | None = None


@dataclass(frozen=True, slots=True)
class BaseModelInfo:
    """A base model the backend can put adapters on."""

    name: str
    max_context_length: int
    arch: str
    tokenizer_id: str
    aliases: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class WeightsSource:
    """What a sampler samples from: a base model plus, optionally, adapter weights — a saved
    checkpoint folder (``path``) or a live training run's current weights (``model_id``)."""

    base_model: str
    path: Path | None = None
    model_id: str | None = None


@dataclass(slots=True)
class RunRecord:
    """A training run (one LoRA adapter being trained), as listed and persisted."""

    run_id: str
    owner: str
    session_id: str
    base_model: str
    lora: LoraSpec
    created_at: float
    last_request_at: float
    user_metadata: dict[str, str] = field(default_factory=dict)
    corrupted: bool = False


@dataclass(slots=True)
class CheckpointRecord:
    """A saved checkpoint: ``kind`` training (weights + optimizer state), sampler (weights)
    or external (weights in PEFT's format, to download)."""

    run_id: str
    kind: CheckpointKind
    name: str
    owner: str
    base_model: str
    lora: LoraSpec
    created_at: float
    size_bytes: int
    user_metadata: dict[str, str] = field(default_factory=dict)
    expires_at: float | None = None
    public: bool = False

    @property
    def checkpoint_id(self) -> str:
        return checkpoint_id(self.kind, self.name)

    @property
    def tinker_path(self) -> str:
        return f"tinker://{self.run_id}/{self.checkpoint_id}"


# A checkpoint kind's segment in tinker:// paths and checkpoint ids.
SEGMENTS: dict[str, str] = {
    "training": "weights",
    "sampler": "sampler_weights",
    "external": "external_weights",
}
_KIND: dict[str, CheckpointKind] = {
    "weights": "training",
    "sampler_weights": "sampler",
    "external_weights": "external",
}


def checkpoint_id(kind: CheckpointKind, name: str) -> str:
    return f"{SEGMENTS[kind]}/{name}"


@dataclass(frozen=True, slots=True)
class CheckpointRef:
    run_id: str
    kind: CheckpointKind
    name: str

    @staticmethod
    def parse(path: str) -> "CheckpointRef":
        """``tinker://<run>/weights/<name>`` (or ``sampler_weights``, ``external_weights``)."""
        if not path.startswith("tinker://"):
            raise InvalidTrainingRequest(f"not a tinker:// checkpoint path: {path!r}")
        parts = path[len("tinker://") :].split("/")
        if len(parts) != 3 or parts[1] not in _KIND or not parts[0] or not parts[2]:
            raise InvalidTrainingRequest(
                f"checkpoint path {path!r} is not tinker://<run>/weights/<name> "
                "(or sampler_weights/<name>, external_weights/<name>)"
            )
        return CheckpointRef(parts[0], _KIND[parts[1]], parts[2])

    @staticmethod
    def from_id(run_id: str, checkpoint_id: str) -> "CheckpointRef":
        """From a run and a checkpoint id such as ``weights/step-1``."""
        return CheckpointRef.parse(f"tinker://{run_id}/{checkpoint_id}")


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
    """Each datum has tokens and the loss's inputs, one value per input position."""
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
            if len(value.data) != length:
                raise InvalidTrainingRequest(
                    f"data[{i}].loss_fn_inputs[{key!r}] has {len(value.data)} values for "
                    f"{length} input tokens (one per input position)"
                )


def check_checkpoint_name(name: str) -> str:
    """A checkpoint name is one path segment of letters, digits, ``-``, ``_``, ``.``."""
    ok = name and len(name) <= 128 and name not in (".", "..")
    if not ok or any(not (c.isalnum() or c in "-_.") for c in name):
        raise InvalidTrainingRequest(
            f"checkpoint name {name!r} must be 1-128 letters, digits, '-', '_' or '.'"
        )
    return name


# --- ports ------------------------------------------------------------------------------


class TrainingBackend(Protocol):
    """Holds trainable adapters by model id and runs their training steps.

    Calls for one model arrive one at a time in ``seq_id`` order (the TrainingController
    guarantees it), from a worker thread. Implementations: the numpy ToyBackend and the
    LoRA backend on our torch models.
    """

    @property
    def base_models(self) -> Sequence[BaseModelInfo]: ...

    def create(self, model_id: str, base_model: str, lora: LoraSpec) -> None:
        """A fresh adapter (deterministic for a given ``lora.seed``)."""
        ...

    def forward_backward(
        self,
        model_id: str,
        data: Sequence[Datum],
        loss_fn: str,
        loss_fn_config: Mapping[str, float],
        *,
        backward: bool,
    ) -> ForwardBackwardResult:
        """Loss and per-token target logprobs; with ``backward`` also adds the loss's
        gradients to the adapter's accumulated gradients."""
        ...

    def optim_step(self, model_id: str, params: AdamParams) -> dict[str, float]:
        """One AdamW step on the accumulated gradients, which it then clears."""
        ...

    def save(self, model_id: str, folder: Path, *, optimizer: bool) -> None:
        """Write the adapter into ``folder`` — for the LoRA backend in PEFT's format
        (``adapter_model.safetensors`` + ``adapter_config.json``), so a checkpoint is also a
        download — and the optimizer state too when ``optimizer``."""
        ...

    def load(self, model_id: str, folder: Path, *, optimizer: bool) -> None:
        """Replace the adapter's weights (and optimizer state) with ``folder``'s."""
        ...

    def release(self, model_id: str) -> None:
        """Forget the model (free its memory). Unknown ids are ignored."""
        ...


class SamplingBackend(Protocol):
    """Samples from a base model with optional adapter weights applied per request."""

    async def sample(
        self,
        source: WeightsSource,
        prompt: Sequence[int],
        params: SampleParams,
        num_samples: int,
        *,
        prompt_logprobs: bool,
        topk_prompt: int = 0,
        topk_sample: int = 0,
    ) -> SampleResult:
        """``topk_prompt`` / ``topk_sample``: also the top-k alternatives at each prompt
        position / each sampled token (0: none)."""
        ...


class CheckpointStorage(Protocol):
    """Durable runs and checkpoints (a folder per checkpoint), surviving restarts.

    Checkpoints are written into a scratch folder from :meth:`scratch` and published by
    :meth:`commit` in one atomic step, so a crash never leaves half a checkpoint listed.
    """

    def load_all(self) -> tuple[list[RunRecord], list[CheckpointRecord]]: ...

    def save_run(self, run: RunRecord) -> None: ...

    def scratch(self) -> Path:
        """A new empty folder to write a checkpoint into."""
        ...

    def commit(self, scratch: Path, record: CheckpointRecord, *, overwrite: bool) -> None:
        """Publish ``scratch`` as ``record``'s folder (its size filled in by the caller)."""
        ...

    def discard(self, scratch: Path) -> None: ...

    def folder(self, run_id: str, kind: CheckpointKind, name: str) -> Path: ...

    def delete(self, record: CheckpointRecord) -> None: ...

    def update(self, record: CheckpointRecord) -> None:
        """Rewrite a checkpoint's metadata (ttl, public)."""
        ...
