"""Fine-tuning and sampling of LoRA adapters (the Tinker face): the values.

Pure standard library. Tensors travel as ``array.array`` (``'f'`` float32, ``'q'`` int64)
with a shape, so adapters convert to numpy or torch without copying (buffer protocol)
and the domain stays free of both."""

from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from domain.tinker.errors import InvalidTrainingRequest

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


# The longest run id this server issues is well under this (``session-<replica id>-<12 hex>
# :train:<n>``), and a checkpoint name is at most 128 characters (``check_checkpoint_name``).
MAX_RUN_ID_CHARS = 200
MAX_CHECKPOINT_NAME_CHARS = 128
_SHOWN_CHARS = 120  # of a path quoted in an error


def _shown(path: str) -> str:
    """``path`` quoted for an error message, cut short when it is long."""
    if len(path) <= _SHOWN_CHARS:
        return repr(path)
    return f"{path[:_SHOWN_CHARS]!r}... ({len(path)} characters)"


@dataclass(frozen=True, slots=True)
class CheckpointRef:
    run_id: str
    kind: CheckpointKind
    name: str

    @staticmethod
    def parse(path: str) -> "CheckpointRef":
        """``tinker://<run>/weights/<name>`` (or ``sampler_weights``, ``external_weights``):
        a run id and a name no longer than the server issues and accepts
        (:data:`MAX_RUN_ID_CHARS`, :data:`MAX_CHECKPOINT_NAME_CHARS`), so that no lookup of
        a longer one reaches the storage."""
        shown = _shown(path)
        if not path.startswith("tinker://"):
            raise InvalidTrainingRequest(f"not a tinker:// checkpoint path: {shown}")
        parts = path[len("tinker://") :].split("/")
        if len(parts) != 3 or parts[1] not in _KIND or not parts[0] or not parts[2]:
            raise InvalidTrainingRequest(
                f"checkpoint path {shown} is not tinker://<run>/weights/<name> "
                "(or sampler_weights/<name>, external_weights/<name>)"
            )
        run_id, name = parts[0], parts[2]
        if len(run_id) > MAX_RUN_ID_CHARS or len(name) > MAX_CHECKPOINT_NAME_CHARS:
            raise InvalidTrainingRequest(
                f"checkpoint path {shown}: a run id is at most {MAX_RUN_ID_CHARS} characters "
                f"and a checkpoint name at most {MAX_CHECKPOINT_NAME_CHARS}"
            )
        return CheckpointRef(run_id, _KIND[parts[1]], name)

    @staticmethod
    def from_id(run_id: str, checkpoint_id: str) -> "CheckpointRef":
        """From a run and a checkpoint id such as ``weights/step-1``."""
        return CheckpointRef.parse(f"tinker://{run_id}/{checkpoint_id}")
