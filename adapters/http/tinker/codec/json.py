"""The Tinker API's JSON: request bodies (msgspec structs, unknown fields ignored: newer SDKs
add fields) decoded and turned into domain values, and results as the SDK's JSON. Features
we do not have are refused with ``UnsupportedFeatureError`` naming the field."""

import math
from array import array
from collections.abc import Mapping, Sequence
from itertools import pairwise
from typing import Any, TypeVar

import msgspec

from adapters.http.tinker.codec.spans import checked_spans, span_pair
from domain.tinker.batch import ForwardBackwardResult
from domain.tinker.errors import InvalidTrainingRequest, UnsupportedFeatureError
from domain.tinker.values import (
    OPTIMIZERS,
    AdamParams,
    Datum,
    DimuonParams,
    LoraSpec,
    OptimizerFamily,
    PromptTable,
    Spans,
    TensorValue,
    TinkerSampleResult,
    TinkerSamplingParams,
)


class _In(msgspec.Struct, kw_only=True):
    """Base of request bodies: unknown fields are accepted and ignored."""


class CreateSessionIn(_In):
    tags: list[str] = []
    user_metadata: dict[str, Any] | None = None
    sdk_version: str | None = None
    display_name: str | None = None


class SessionIdIn(_In):
    session_id: str


class CreateSamplingSessionIn(_In):
    session_id: str
    sampling_session_seq_id: int
    base_model: str | None = None
    model_path: str | None = None


class LoraConfigIn(_In):
    rank: int
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerConfigIn(_In):
    type: str = "adamw"
    version: int | None = None  # Dimuon's (1)


class CreateModelIn(_In):
    session_id: str
    model_seq_id: int
    base_model: str
    user_metadata: dict[str, Any] | None = None
    lora_config: LoraConfigIn | None = None
    optimizer_config: OptimizerConfigIn | None = None


class ModelIdIn(_In):
    model_id: str


class OptimStepIn(_In):
    model_id: str
    seq_id: int | None = None
    # Decoded as the domain value itself: its fields and defaults are Tinker's AdamParams.
    adam_params: AdamParams | None = None
    # Either family, by ``type`` (the SDK sends DimuonParams as optimizer_params).
    optim_params: dict[str, Any] | None = None
    optimizer_params: dict[str, Any] | None = None


class SaveWeightsIn(_In):
    model_id: str
    path: str | None = None
    seq_id: int | None = None
    ttl_seconds: int | None = None
    overwrite: bool = False
    user_metadata: dict[str, Any] | None = None


class SaveForSamplerIn(_In):
    model_id: str
    path: str | None = None
    sampling_session_seq_id: int | None = None
    kind: str = "snapshot"
    seq_id: int | None = None
    ttl_seconds: int | None = None
    user_metadata: dict[str, Any] | None = None


class SaveExternalIn(_In):
    model_id: str
    path: str
    seq_id: int | None = None
    ttl_seconds: int | None = None
    age_encryption_recipients: list[str] | None = None


class LoadWeightsIn(_In):
    path: str
    model_id: str | None = None
    seq_id: int | None = None
    session_id: str | None = None
    model_seq_id: int | None = None
    base_model: str | None = None
    user_metadata: dict[str, Any] | None = None
    optimizer: bool = False
    optimizer_config: OptimizerConfigIn | None = None
    weights_access_token: str | None = None


class ModelInputIn(_In):
    chunks: list[dict[str, Any]]


class SamplingParamsIn(_In):
    max_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str | int] | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0


class SampleTensorIn(_In):
    """A sample request's ``TensorData`` (``target_prompt_logprobs``): dense, or sparse CSR."""

    data: list[int | float]
    dtype: str
    shape: list[int] | None = None
    sparse_crow_indices: list[int] | None = None
    sparse_col_indices: list[int] | None = None


class SampleIn(_In):
    prompt: ModelInputIn
    sampling_params: SamplingParamsIn
    num_samples: int = 1
    base_model: str | None = None
    model_path: str | None = None
    sampling_session_id: str | None = None
    seq_id: int | None = None
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: SampleTensorIn | None = None
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = None
    record_stability_info: bool | None = None


class RetrieveFutureIn(_In):
    request_id: str
    allow_metadata_only: bool = False


class WeightsInfoIn(_In):
    tinker_path: str


class TtlIn(_In):
    ttl_seconds: int | None = None


class TensorIn(_In):
    data: list[int | float]
    dtype: str = "float32"
    shape: list[int] | None = None


class DatumIn(_In):
    model_input: ModelInputIn
    loss_fn_inputs: dict[str, TensorIn] = {}
    model_input_spans: list[dict[str, Any]] | None = None
    loss_fn_input_spans: list[dict[str, Any]] | None = None


class ForwardBackwardInputIn(_In):
    data: list[DatumIn]
    loss_fn: str
    loss_fn_config: dict[str, float | str] | None = None  # text: a custom loss's loss_id


class ForwardBackwardIn(_In):
    model_id: str
    forward_backward_input: ForwardBackwardInputIn
    seq_id: int | None = None


T = TypeVar("T")


def decode(body: bytes, schema: type[T]) -> T:
    try:
        return msgspec.json.decode(body or b"{}", type=schema)
    except msgspec.ValidationError as e:
        raise InvalidTrainingRequest(f"invalid request body: {e}") from e
    except (msgspec.DecodeError, RecursionError) as e:
        raise InvalidTrainingRequest(f"request body is not valid JSON: {e}") from e
    except UnicodeDecodeError as e:
        raise InvalidTrainingRequest(
            f"request body is not valid UTF-8 (byte {e.start} of a string)"
        ) from e


def lora_spec(config: LoraConfigIn | None) -> LoraSpec:
    if config is None:
        raise InvalidTrainingRequest("create_model needs lora_config (only LoRA is trained here)")
    return LoraSpec(
        config.rank, config.seed, config.train_mlp, config.train_attn, config.train_unembed
    )


def check_optimizer(config: OptimizerConfigIn | None) -> OptimizerFamily | None:
    """The optimizer ``optimizer_config`` names (None: not given): AdamW, or Dimuon
    version 1."""
    if config is None:
        return None
    if config.type == "adamw":
        return "adamw"
    if config.type == "dimuon":
        if config.version not in (None, 1):
            raise UnsupportedFeatureError(
                f"optimizer_config.version {config.version!r} of 'dimuon' is not supported "
                "(only version 1)"
            )
        return "dimuon"
    supported = ", ".join(repr(name) for name in OPTIMIZERS)
    raise UnsupportedFeatureError(
        f"optimizer_config.type {config.type!r} is not supported (supported: {supported})"
    )


def optimizer_config_json(family: OptimizerFamily) -> dict[str, Any]:
    """The SDK's ``OptimizerConfig`` of a run or checkpoint (get_info, weights_info)."""
    return {"type": "dimuon", "version": 1} if family == "dimuon" else {"type": "adamw"}


_DIMUON_FIELDS = ("learning_rate", "grad_clip_norm", "beta1")


def optim_params(body: OptimStepIn) -> AdamParams | DimuonParams:
    """The step's hyperparameters: ``adam_params``, or ``optim_params`` /
    ``optimizer_params`` of either family by ``type`` (none: AdamW's defaults)."""
    if body.adam_params is not None:
        return body.adam_params
    given = body.optim_params if body.optim_params is not None else body.optimizer_params
    if given is None:
        return AdamParams()
    what = "optim_params" if body.optim_params is not None else "optimizer_params"
    kind = given.get("type", "adamw")
    fields = {k: v for k, v in given.items() if k != "type"}
    if kind == "adamw":
        return _convert(fields, AdamParams, what)
    if kind != "dimuon":
        supported = ", ".join(repr(name) for name in OPTIMIZERS)
        raise UnsupportedFeatureError(
            f"{what}.type {kind!r} is not supported (supported: {supported})"
        )
    unknown = sorted(set(fields) - set(_DIMUON_FIELDS))
    if unknown:
        raise UnsupportedFeatureError(
            f"{what}.{unknown[0]} is not supported (Dimuon version 1 takes "
            f"{', '.join(_DIMUON_FIELDS)})"
        )
    if "learning_rate" not in fields:
        raise InvalidTrainingRequest(f"{what}.learning_rate is required for Dimuon")
    return _convert(fields, DimuonParams, what)


def _convert(fields: dict[str, Any], schema: type[T], what: str) -> T:
    try:
        return msgspec.convert(fields, schema)
    except msgspec.ValidationError as e:
        raise InvalidTrainingRequest(f"{what}: {e}") from e


def prompt_tokens(model_input: ModelInputIn, what: str = "prompt") -> list[int]:
    tokens: list[int] = []
    for i, chunk in enumerate(model_input.chunks):
        kind = chunk.get("type", "encoded_text")
        if kind != "encoded_text":
            raise UnsupportedFeatureError(
                f"{what}.chunks[{i}]: {kind!r} chunks are not supported (text models only)"
            )
        ids = chunk.get("tokens")
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids
        ):
            raise InvalidTrainingRequest(f"{what}.chunks[{i}].tokens must be a list of ints")
        if not all(0 <= t <= _INT32_MAX for t in ids):
            raise InvalidTrainingRequest(
                f"{what}.chunks[{i}].tokens: token ids must be in 0..{_INT32_MAX}"
            )
        tokens.extend(ids)
    return tokens


def sample_params(p: SamplingParamsIn, max_tokens: int) -> TinkerSamplingParams:
    stop_strings: tuple[str, ...] | None = None
    stop_ids: tuple[int, ...] | None = None
    if isinstance(p.stop, str):
        stop_strings = (p.stop,)
    elif p.stop is not None:
        if all(isinstance(s, str) for s in p.stop):
            stop_strings = tuple(str(s) for s in p.stop)
        elif all(isinstance(s, int) for s in p.stop):
            stop_ids = tuple(int(s) for s in p.stop)
        else:
            raise InvalidTrainingRequest("sampling_params.stop mixes strings and token ids")
        if not p.stop:  # [] = never stop early
            stop_strings, stop_ids = None, ()
    return TinkerSamplingParams(
        max_tokens=p.max_tokens if p.max_tokens is not None else max_tokens,
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        seed=p.seed,
        stop_strings=stop_strings,
        stop_token_ids=stop_ids,
    )


def prompt_targets(t: SampleTensorIn | None) -> PromptTable | None:
    """``target_prompt_logprobs`` as a table: int64 token ids or -1, a 2-D shape, dense
    values filling it or a well-formed CSR. Its fit to the prompt (rows, K, at least one
    id) is the sampling controller's to check, the vocabulary the backend's."""
    if t is None:
        return None
    what = "target_prompt_logprobs"
    if t.dtype != "int64":
        raise InvalidTrainingRequest(f"{what}: dtype must be int64 (token ids), got {t.dtype!r}")
    if t.shape is None or len(t.shape) != 2 or min(t.shape) < 0:
        raise InvalidTrainingRequest(
            f"{what}: shape must be 2-D, [len(prompt) - 1, K], got {t.shape}"
        )
    rows, width = t.shape
    ids = []
    for v in t.data:
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if not isinstance(v, int) or not -1 <= v <= _INT32_MAX:
            raise InvalidTrainingRequest(f"{what}: {v!r} is neither a token id nor -1")
        ids.append(v)
    crow, cols = t.sparse_crow_indices, t.sparse_col_indices
    if crow is None and cols is None:
        if len(ids) != rows * width:
            raise InvalidTrainingRequest(
                f"{what}: shape {t.shape} holds {rows * width} values, got {len(ids)}"
            )
        return PromptTable((rows, width), ids)
    if crow is None or cols is None:
        raise InvalidTrainingRequest(
            f"{what}: sparse_crow_indices and sparse_col_indices come together"
        )
    _check_csr(crow, cols, (rows, width), len(ids), what)
    return PromptTable((rows, width), ids, tuple(crow), tuple(cols))


def _check_csr(
    crow: Sequence[int], cols: Sequence[int], shape: tuple[int, int], nnz: int, what: str
) -> None:
    """A CSR layout torch would accept: ``rows + 1`` row pointers from 0 to ``nnz``,
    non-decreasing; ``nnz`` column indices, within the width and increasing in each row."""
    rows, width = shape
    if len(crow) != rows + 1 or crow[0] != 0 or crow[-1] != nnz or len(cols) != nnz:
        raise InvalidTrainingRequest(
            f"{what}: sparse CSR needs {rows + 1} row pointers from 0 to the {nnz} values, "
            f"and {nnz} column indices (got {len(crow)} pointers, {len(cols)} columns)"
        )
    for r in range(rows):
        if crow[r] > crow[r + 1]:
            raise InvalidTrainingRequest(f"{what}: sparse_crow_indices must not decrease")
        row = cols[crow[r] : crow[r + 1]]
        if any(not 0 <= c < width for c in row) or any(a >= b for a, b in pairwise(row)):
            raise InvalidTrainingRequest(
                f"{what}: row {r}'s sparse_col_indices must increase within 0..{width - 1}"
            )


_INT32_MAX = 2**31 - 1


_INT64 = (-(2**63), 2**63 - 1)


_FLOAT32_MAX = 3.4028234663852886e38


def _spans_json(spans: list[dict[str, Any]] | None, what: str) -> Spans | None:
    """The same from JSON: ``{"prompt_tokens"|"sampled_tokens": {sequence_id, offset,
    length}}`` (protobuf's JSON form) or ``{"type": "prompt"|"sampled", sequence_id, ...}``."""
    if spans is None:
        return None
    pairs = []
    for span in spans:  # objects: the body's schema says so
        kind = span.get("type")
        if kind in ("prompt", "sampled"):
            pairs.append((f"{kind}_tokens", span))
        elif len(span) == 1 and next(iter(span)) in ("prompt_tokens", "sampled_tokens"):
            pairs.append(next(iter(span.items())))
        else:
            pairs.append(("unset", span))
    return checked_spans(pairs, what)


def forward_backward_json(body: ForwardBackwardIn) -> list[Datum]:
    data = []
    for i, d in enumerate(body.forward_backward_input.data):
        tokens = array("i", prompt_tokens(d.model_input, f"data[{i}].model_input"))
        inputs = {}
        for name, t in d.loss_fn_inputs.items():
            values = _json_values(t, f"data[{i}].loss_fn_inputs[{name!r}]")
            shape = tuple(t.shape) if t.shape else (len(values),)
            if any(n < 0 for n in shape) or math.prod(shape) != len(values):
                raise InvalidTrainingRequest(
                    f"data[{i}].loss_fn_inputs[{name!r}]: shape {list(shape)} holds "
                    f"{len(values)} values"
                )
            inputs[name] = TensorValue(values, shape)
        spans = (
            _spans_json(d.model_input_spans, f"data[{i}].model_input_spans"),
            _spans_json(d.loss_fn_input_spans, f"data[{i}].loss_fn_input_spans"),
        )
        data.append(Datum(tokens, inputs, *span_pair(spans, f"data[{i}]")))
    return data


def _json_values(t: TensorIn, what: str) -> array:
    """A JSON tensor's values in its dtype: int64 data must be integers in range (1.7 is
    refused, not truncated), float32 data finite once in float32 (1e39 is refused)."""
    if t.dtype in ("int64", "int32"):
        low, high = _INT64 if t.dtype == "int64" else (-(2**31), _INT32_MAX)
        ints = []
        for v in t.data:
            if isinstance(v, float):
                if not v.is_integer():
                    raise InvalidTrainingRequest(f"{what}: {v!r} is not an integer ({t.dtype})")
                v = int(v)
            if not low <= v <= high:
                raise InvalidTrainingRequest(f"{what}: {v} is out of range for {t.dtype}")
            ints.append(v)
        return array("q", ints)
    if t.dtype != "float32":
        raise InvalidTrainingRequest(f"{what}: dtype {t.dtype!r} (int64, int32 or float32)")
    for v in t.data:
        if not (math.isfinite(v) and abs(v) <= _FLOAT32_MAX):
            raise InvalidTrainingRequest(f"{what}: {v!r} is not a finite float32")
    return array("f", t.data)


def forward_backward_output_json(result: ForwardBackwardResult) -> dict[str, Any]:
    return {
        "loss_fn_output_type": "ArrayRecord",
        "metrics": result.metrics,
        "loss_fn_outputs": [
            {
                name: {"data": t.data.tolist(), "dtype": t.dtype, "shape": list(t.shape)}
                for name, t in out.items()
            }
            for out in result.outputs
        ],
    }


def sample_response_json(result: TinkerSampleResult) -> dict[str, Any]:
    return {
        "type": "sample",
        "sequences": [
            {
                "stop_reason": s.stop_reason,
                "tokens": s.tokens,
                "logprobs": s.logprobs,
                "topk_logprobs": s.topk,
            }
            for s in result.sequences
        ],
        "prompt_logprobs": result.prompt_logprobs,
        "topk_prompt_logprobs": result.topk_prompt,
        **_sample_extras_json(result),
    }


def _sample_extras_json(result: TinkerSampleResult) -> dict[str, Any]:
    """``target_prompt_logprobs`` and ``prompt_alt_tokens`` as ``TensorData`` JSON, when
    asked."""
    extras: dict[str, Any] = {}
    table = result.target_prompt_logprobs
    if table is not None:
        extras["target_prompt_logprobs"] = {
            "data": list(table.values),
            "dtype": "float32",
            "shape": list(table.shape),
        }
        if table.crow_indices is not None:
            extras["target_prompt_logprobs"]["sparse_crow_indices"] = list(table.crow_indices)
            extras["target_prompt_logprobs"]["sparse_col_indices"] = list(table.col_indices or ())
    alt = result.prompt_alt_tokens
    if alt is not None:
        shape = [len(alt.tokens), alt.k]
        extras["prompt_alt_tokens"] = {
            "tokens": {
                "data": [t for r in alt.tokens for t in r],
                "dtype": "int64",
                "shape": shape,
            },
            "logprobs": {
                "data": [v for r in alt.logprobs for v in r],
                "dtype": "float32",
                "shape": shape,
            },
        }
    return extras


def metrics(values: Mapping[str, float]) -> dict[str, float]:
    return {k: float(v) for k, v in values.items()}
