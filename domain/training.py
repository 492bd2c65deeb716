"""Fine-tuning and sampling of LoRA adapters (the Tinker face): values, errors and ports.

Pure standard library. Tensors travel as ``array.array`` (``'f'`` float32, ``'q'`` int64)
with a shape, so adapters convert to numpy or torch without copying (buffer protocol)
and the domain stays free of both.
"""

import math
from array import array
from collections.abc import Callable, Generator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol, TypeVar

from domain.errors import InferError

if TYPE_CHECKING:
    from domain.custom_loss import CustomLoss

TensorDtype = Literal["float32", "int64"]
LossFn = Literal["cross_entropy", "importance_sampling", "ppo", "cispo", "dro"]
LOSS_FNS: tuple[str, ...] = (
    "cross_entropy",
    "importance_sampling",
    "ppo",
    "cispo",
    "dro",
    "gspo",
    "stable_reinforce",
    "custom",  # a loss the client stored with create_custom_loss (domain/custom_loss.py)
)
# Inputs each loss reads besides ``target_tokens`` (Tinker's loss_fn_inputs keys).
LOSS_INPUTS: Mapping[str, tuple[str, ...]] = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
    "cispo": ("target_tokens", "logprobs", "advantages"),
    "dro": ("target_tokens", "logprobs", "advantages"),
    # GSPO-token: one ratio per datum, over the positions sequence_ratio_mask marks.
    "gspo": ("target_tokens", "logprobs", "advantages", "sequence_ratio_mask"),
    # The client sends target_tokens, advantages and provenance spans; the server fills
    # logprobs (the sampler's, as recorded) and sampled_mask from the recorded sequences
    # (:func:`resolve_provenance`), whatever the client put there.
    "stable_reinforce": ("target_tokens", "logprobs", "advantages", "sampled_mask"),
    # custom: the stored loss names the rest (domain.custom_loss.check_custom_data)
    "custom": ("target_tokens",),
}
# Each loss's ``loss_fn_config`` keys and defaults (Tinker's). As in Tinker's documentation,
# ``clip_low_threshold`` / ``clip_high_threshold`` bound the ratio itself
# (``clamp(r, low, high)``), not offsets from 1: PPO 0.8 / 1.2 (epsilon 0.2), CISPO
# 0.0 / 4.0 (an upper cap only); DRO's quadratic penalty ``beta`` 0.05. GSPO's page names
# no defaults: PPO's 0.8 / 1.2 (the cookbook's rl_loop passes none).
LOSS_CONFIG_DEFAULTS: Mapping[str, Mapping[str, float]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
    "dro": {"beta": 0.05},
    "gspo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    # The weight of the KL(sampler || learner) penalty on sampled tokens (Tinker's name).
    "stable_reinforce": {"kl_coeff": 0.0},
    "custom": {},  # its loss_id is resolved before the backend sees the batch
}
# StableReinforce's trust band: a sampled token whose ratio learner/sampler (against the
# logprob recorded when it was sampled) falls outside it carries no policy gradient.
STABLE_REINFORCE_TRUST = (0.5, 2.0)
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


class RetryLaterError(TrainingError):
    """A per-run queue is full for now (HTTP 429, which the SDK retries): the request is
    fine and is accepted once earlier requests of the run have run."""


class BackendFailure(TrainingError):
    """The training backend failed on valid input (a server-side error)."""

    category = "server"


# --- limits -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TinkerLimits:
    """What one API key may ask of the fine-tuning API (each an ``infer serve`` flag).

    ``max_pending_*`` bound the requests of one run that wait for their turn (behind the
    one running or behind a ``seq_id`` gap) and their estimated payload (4 bytes per token
    plus tensor bytes, as the SDK estimates it); ``max_seq_ahead`` how far beyond the next
    expected ``seq_id`` a request may be numbered; ``max_sample_requests`` how many Tinker
    sampling requests are in the serving engine at once (the rest wait their turn, tenants
    taking turns), so OpenAI traffic keeps the engine's waiting queue;
    ``max_recorded_tokens``: tokens of sampled sequences kept for ``stable_reinforce``
    (``record_stability_info``), in all; beyond it the least recently used go.
    """

    max_runs_per_key: int = 8
    max_lora_rank: int = 128
    max_tokens_per_request: int = 131072
    max_pending_requests: int = 128
    max_pending_bytes: int = 256 << 20
    max_seq_ahead: int = 1024
    max_sample_requests: int = 8
    max_recorded_tokens: int = 16 << 20

    def __post_init__(self) -> None:
        for name in self.__slots__:
            if getattr(self, name) < 1:
                raise ValueError(f"TinkerLimits.{name} must be at least 1")


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
class ProvenanceSpan:
    """Where a run of a datum's positions comes from (Tinker's ``PromptProvenanceSpan`` /
    ``SampledProvenanceSpan``): positions ``[offset, offset + length)`` of a recorded
    sequence's request prompt, or of its sampled tokens when ``sampled``."""

    sequence_id: str
    offset: int
    length: int
    sampled: bool


Spans = tuple[ProvenanceSpan, ...]


@dataclass(frozen=True, slots=True)
class Datum:
    """One training example: the model's input tokens and the loss's inputs, per position;
    optionally where each position came from (spans tiling ``tokens`` and
    ``loss_fn_inputs['target_tokens']``, for ``stable_reinforce``)."""

    tokens: Sequence[int]
    loss_fn_inputs: Mapping[str, TensorValue]
    model_input_spans: Spans | None = None
    loss_fn_input_spans: Spans | None = None


@dataclass(frozen=True, slots=True)
class RecordedSequence:
    """A sampled sequence the server recorded (``record_stability_info``): its request's
    prompt, its tokens and the sampler's logprob of each."""

    prompt: Sequence[int]
    tokens: Sequence[int]
    logprobs: Sequence[float]


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
class DimuonParams:
    """One Dimuon step (Tinker's ``DimuonParams``, optimizer version 1): momentum EMA
    ``beta1``, then each LoRA matrix's momentum row/column-preconditioned and orthogonalized;
    ``grad_clip_norm`` <= 0 turns clipping off."""

    learning_rate: float
    grad_clip_norm: float = 0.0
    beta1: float = 0.9


# The optimizer a run is created with (Tinker's ``optimizer_config.type``), for its lifetime.
OptimizerFamily = Literal["adamw", "dimuon"]
OPTIMIZERS: tuple[OptimizerFamily, ...] = ("adamw", "dimuon")


def optimizer_of(params: AdamParams | DimuonParams) -> OptimizerFamily:
    return "dimuon" if isinstance(params, DimuonParams) else "adamw"


@dataclass(frozen=True, slots=True)
class ForwardBackwardInput:
    """One forward/backward call's batch (Tinker's ``ForwardBackwardInput``): the data and
    the loss over it, ``loss_fn_config`` as given (:func:`loss_config` fills defaults);
    ``custom_loss``: for loss_fn ``custom``, the stored loss its ``loss_id`` names."""

    data: Sequence[Datum]
    loss_fn: str
    loss_fn_config: Mapping[str, float] = field(default_factory=dict)
    custom_loss: "CustomLoss | None" = None


@dataclass(frozen=True, slots=True)
class ForwardBackwardResult:
    """Per-datum outputs (``logprobs`` of the target tokens at least) and ``name:reduction``
    metrics (``loss:sum``)."""

    outputs: list[dict[str, TensorValue]]
    metrics: dict[str, float]


@dataclass(frozen=True, slots=True)
class TinkerSamplingParams:
    """Tinker's SamplingParams. ``stop_strings``/``stop_token_ids`` both None: stop at EOS."""

    max_tokens: int
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop_strings: tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class PromptTable:
    """A ``[len(prompt) - 1, K]`` table over prompt positions (row i: position i + 1), laid
    out as Tinker's ``TensorData``: ``values`` row-major (dense), or with ``crow_indices``
    and ``col_indices`` (sparse CSR) the listed cells' values only. Tinker's
    ``target_prompt_logprobs`` (token ids, -1: nothing asked) and its answer (logprobs, 0.0
    where nothing was asked) share one layout."""

    shape: tuple[int, int]
    values: Sequence[float]  # token ids (ints) in a request
    crow_indices: Sequence[int] | None = None
    col_indices: Sequence[int] | None = None

    def value_rows(self) -> list[int]:
        """The row of each of ``values``."""
        if self.crow_indices is None:
            width = self.shape[1]
            return [i // width for i in range(len(self.values))]
        crow = self.crow_indices
        return [r for r in range(self.shape[0]) for _ in range(crow[r + 1] - crow[r])]

    def row_ids(self) -> tuple[tuple[int, ...], ...]:
        """Per row, the distinct ids its cells ask for (ascending; -1 left out)."""
        rows: list[set[int]] = [set() for _ in range(self.shape[0])]
        for row, value in zip(self.value_rows(), self.values, strict=True):
            if value != -1:
                rows[row].add(int(value))
        return tuple(tuple(sorted(ids)) for ids in rows)

    def scored(self, logprobs: Sequence[Mapping[int, float]]) -> "PromptTable":
        """This table of ids as its logprobs: each cell's id looked up in its row's
        ``logprobs`` (0.0 for -1), in the same layout."""
        values = [
            0.0 if value == -1 else logprobs[row][int(value)]
            for row, value in zip(self.value_rows(), self.values, strict=True)
        ]
        return PromptTable(self.shape, values, self.crow_indices, self.col_indices)


@dataclass(frozen=True, slots=True)
class PromptAltTokens:
    """Tinker's ``prompt_alt_tokens``: ``k`` tokens drawn at each prompt position after the
    first; ``tokens[i]`` and ``logprobs[i]`` (the model's) are position i + 1's."""

    k: int
    tokens: list[list[int]]
    logprobs: list[list[float]]


@dataclass(frozen=True, slots=True)
class SampleRequest:
    """One sampling call (Tinker's ``SampleRequest``): ``num_samples`` sequences after
    ``prompt``; ``prompt_logprobs``: each prompt token's logprob too; ``topk_prompt`` /
    ``topk_sample``: the top-k alternatives at each prompt position / each sampled token
    (0: none); ``target_prompt``: the ids whose logprobs to report at prompt positions;
    ``prompt_alt_k``: tokens to draw at each prompt position after the first, at the
    request's temperature; ``prompt_logprobs_last_n``: only the last n prompt logprobs
    and top-k rows are wanted (a backend may leave the others out: None, or NaN).
    Prompt scores come from the first sample's prefill."""

    prompt: Sequence[int]
    params: TinkerSamplingParams
    num_samples: int = 1
    prompt_logprobs: bool = False
    topk_prompt: int = 0
    topk_sample: int = 0
    target_prompt: PromptTable | None = None
    prompt_alt_k: int = 0
    prompt_logprobs_last_n: int | None = None


TopK = list[tuple[int, float]]  # (token id, logprob) pairs, best first


@dataclass(frozen=True, slots=True)
class SampledSequence:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: Literal["stop", "length"]
    topk: list[TopK] | None = None  # per sampled token, when top-k sample logprobs are asked


@dataclass(frozen=True, slots=True)
class TinkerSampleResult:
    sequences: list[SampledSequence]
    # One entry per prompt token; the first is None (nothing predicts it).
    prompt_logprobs: list[float | None] | None = None
    # The same positions' top-k alternatives, when asked (the first is None).
    topk_prompt: list[TopK | None] | None = None
    # The logprobs of ``SampleRequest.target_prompt``'s ids, in its layout, when asked.
    target_prompt_logprobs: PromptTable | None = None
    # The draws ``SampleRequest.prompt_alt_k`` asked for.
    prompt_alt_tokens: PromptAltTokens | None = None


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
    optimizer: OptimizerFamily = "adamw"


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
    # Which save this is: a new value each time a checkpoint is written (an overwrite or
    # a delete and save again under the name), so links signed for one never serve another.
    version: str = ""
    optimizer: OptimizerFamily = "adamw"  # the run's: what a training checkpoint's state is of

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


def resolve_provenance(
    data: Sequence[Datum], recorded: Callable[[str], RecordedSequence]
) -> list[Datum]:
    """``stable_reinforce``'s data with the server's inputs filled in from the recorded
    sequences their spans name (``recorded(sequence_id)``, raising for an unknown one):
    ``logprobs`` (the sampler's recorded logprob at sampled positions, 0 elsewhere) and
    ``sampled_mask`` (1 at sampled positions). Every span must name recorded tokens equal
    to the datum's, the spans must tile the datum, and advantages must be 0 off sampled
    tokens (``InvalidTrainingRequest`` names the datum and the span)."""
    out = []
    for i, datum in enumerate(data):
        where = f"data[{i}]"
        if datum.model_input_spans is None or datum.loss_fn_input_spans is None:
            raise InvalidTrainingRequest(
                f"{where}: stable_reinforce needs provenance on every datum "
                "(Datum.with_provenance naming the sampled sequences, sampled with "
                "record_stability_info=True)"
            )
        targets = datum.loss_fn_inputs.get("target_tokens")
        advantages = datum.loss_fn_inputs.get("advantages")
        for key, value in (("target_tokens", targets), ("advantages", advantages)):
            if value is None or len(value.data) != len(datum.tokens):
                raise InvalidTrainingRequest(
                    f"{where}.loss_fn_inputs[{key!r}]: stable_reinforce needs one value per "
                    f"input position ({len(datum.tokens)})"
                )
        assert targets is not None and advantages is not None
        _match_spans(datum.model_input_spans, datum.tokens, recorded, f"{where}.model_input")
        sampler = array("f", bytes(4 * len(datum.tokens)))
        mask = array("f", bytes(4 * len(datum.tokens)))
        # Targets at prompt positions carry no loss (their advantages are 0): the cookbook
        # pads them with 0, so only the sampled ones must be the recorded tokens.
        for pos, seq, k in _match_spans(
            datum.loss_fn_input_spans,
            targets.data,
            recorded,
            f"{where}.loss_fn_inputs",
            prompt_tokens=False,
        ):
            sampler[pos], mask[pos] = seq.logprobs[k], 1.0
        for pos, (a, m) in enumerate(zip(advantages.data, mask, strict=True)):
            if a != 0 and m == 0:
                raise InvalidTrainingRequest(
                    f"{where}.loss_fn_inputs['advantages'][{pos}] is {a}: stable_reinforce "
                    "takes nonzero advantages on sampled tokens only"
                )
        inputs = {
            **datum.loss_fn_inputs,
            "logprobs": TensorValue(sampler, (len(sampler),)),
            "sampled_mask": TensorValue(mask, (len(mask),)),
        }
        out.append(Datum(datum.tokens, inputs, datum.model_input_spans, datum.loss_fn_input_spans))
    return out


def _match_spans(
    spans: Spans,
    tokens: Sequence[int],
    recorded: Callable[[str], RecordedSequence],
    where: str,
    *,
    prompt_tokens: bool = True,
) -> list[tuple[int, RecordedSequence, int]]:
    """Check that ``spans`` tile ``tokens`` and name recorded tokens equal to them (at
    prompt spans too when ``prompt_tokens``); the (position, sequence, index in its
    sampled tokens) of each sampled position."""
    total = sum(span.length for span in spans)
    if total != len(tokens):
        raise InvalidTrainingRequest(
            f"{where}: provenance spans cover {total} positions, the field has {len(tokens)}"
        )
    pos, sampled = 0, []
    for j, span in enumerate(spans):
        if span.offset < 0 or span.length < 0:
            raise InvalidTrainingRequest(f"{where} span {j}: offset and length must be >= 0")
        seq = recorded(span.sequence_id)
        source = seq.tokens if span.sampled else seq.prompt
        kind = "sampled tokens" if span.sampled else "prompt"
        if span.offset + span.length > len(source):
            raise InvalidTrainingRequest(
                f"{where} span {j}: positions {span.offset}..{span.offset + span.length} are "
                f"beyond sequence {span.sequence_id!r}'s {kind} ({len(source)} tokens)"
            )
        for k in range(span.offset, span.offset + span.length):
            if (span.sampled or prompt_tokens) and tokens[pos] != source[k]:
                raise InvalidTrainingRequest(
                    f"{where}[{pos}]: token {tokens[pos]} is not token {k} of sequence "
                    f"{span.sequence_id!r}'s {kind} ({source[k]})"
                )
            if span.sampled:
                sampled.append((pos, seq, k))
            pos += 1
    return sampled


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


# --- ports ------------------------------------------------------------------------------

T = TypeVar("T")
# Work in pieces: each ``next()`` runs one piece; the value comes with StopIteration.
Steps = Generator[None, None, T]


def run_steps(steps: "Steps[T]") -> T:
    """Run every piece of ``steps`` now; its value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def one_step(fn: Callable[[], T]) -> "Steps[T]":
    """``fn()`` as work of a single piece."""
    yield from ()
    return fn()


class TrainingBackend(Protocol):
    """Holds trainable adapters by model id and runs their training steps.

    Calls for one model arrive one at a time in ``seq_id`` order (the TrainingController
    guarantees it), from a worker thread. Implementations: the numpy ToyBackend and the
    LoRA backend on our torch models. A forward/backward can run in pieces
    (:meth:`forward_backward_steps`) so that other models' work takes turns with a long one;
    an implementation that subclasses this protocol gets :meth:`forward_backward` (all the
    pieces at once) from it.
    """

    @property
    def base_models(self) -> Sequence[BaseModelInfo]: ...

    def create(self, model_id: str, base_model: str, lora: LoraSpec) -> None:
        """A fresh adapter (deterministic for a given ``lora.seed``)."""
        ...

    def forward_backward(
        self, model_id: str, batch: ForwardBackwardInput, *, backward: bool
    ) -> ForwardBackwardResult:
        """Loss and per-token target logprobs; with ``backward`` also adds the loss's
        gradients to the adapter's accumulated gradients."""
        return run_steps(self.forward_backward_steps(model_id, batch, backward=backward))

    def forward_backward_steps(
        self, model_id: str, batch: ForwardBackwardInput, *, backward: bool
    ) -> Steps[ForwardBackwardResult]:
        """:meth:`forward_backward` in pieces (micro-batches): between two pieces the caller
        may run other models' calls (never this model's), from any one thread at a time."""
        ...

    def optim_step(self, model_id: str, params: AdamParams | DimuonParams) -> dict[str, float]:
        """One AdamW or Dimuon step (by ``params``' type) on the accumulated gradients,
        which it then clears. ``params`` are checked (:func:`check_adam`,
        :func:`check_dimuon`) by the caller, who keeps one family per run; a model whose
        optimizer state is of the other family raises ``InvalidTrainingRequest``."""
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
        """Forget the model and give its memory back (adapter, gradients, optimizer
        state). Unknown ids are ignored."""
        ...


class SamplingBackend(Protocol):
    """Samples from a base model with optional adapter weights applied per request."""

    async def sample(
        self, source: WeightsSource, request: SampleRequest, *, tenant: str = ""
    ) -> TinkerSampleResult:
        """``request``'s sequences from ``source``'s weights. ``tenant``: who asks (an API
        key's owner id), so backends that share capacity can let tenants take turns."""
        ...


class ServingAdapters(Protocol):
    """The LoRA adapters the serving engine's runner can apply, by adapter id (what a
    request's ``adapter_id`` names). Loading and the tensors stay in the adapter; the
    Tinker sampler only names folders, training runs and ids."""

    def __contains__(self, adapter_id: object) -> bool: ...

    def weights_file(self, folder: Path) -> Path:
        """The file in a checkpoint ``folder`` whose identity (path, mtime, size) tells
        one save of the checkpoint from another."""
        ...

    def load_folder(self, adapter_id: str, folder: Path) -> None:
        """Load the checkpoint in ``folder`` under ``adapter_id`` (kept until evicted)."""
        ...

    def add_live(self, adapter_id: str, model_id: str) -> None:
        """Add a copy of training run ``model_id``'s current weights under ``adapter_id``
        (``InvalidTrainingRequest`` where live weights are not available)."""
        ...

    def remove(self, adapter_id: str) -> None: ...

    def pinned(self, adapter_id: str) -> AbstractContextManager[None]:
        """Keep ``adapter_id`` loaded (not evicted) while requests use it."""
        ...


class CheckpointStorage(Protocol):
    """Durable runs and checkpoints (a folder per checkpoint), surviving restarts.

    Checkpoints are written into a scratch folder from :meth:`scratch` and published by
    :meth:`commit` in one atomic step, so a crash never leaves half a checkpoint listed,
    and an overwrite never leaves neither the old nor the new one listed.
    """

    def load_all(self) -> tuple[list[RunRecord], list[CheckpointRecord]]: ...

    def load(self, run_id: str, kind: CheckpointKind, name: str) -> CheckpointRecord | None:
        """One checkpoint's record as stored now (None: none), e.g. one another process
        sharing the storage saved."""
        ...

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

    def secret(self) -> bytes:
        """A random key kept with the checkpoints (created once, readable by the owner
        only), for signing download links that stay valid across restarts."""
        ...
