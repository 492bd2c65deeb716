"""The Tinker API's protobuf: ``forward_backward`` bodies to domain values, and
forward/backward and sample results as the SDK's protobuf messages."""

import math
from array import array
from collections.abc import Sequence
from typing import Any

from adapters.http.tinker import pb
from adapters.http.tinker.codec.spans import checked_spans, span_pair
from domain.tinker.batch import ForwardBackwardResult
from domain.tinker.errors import InvalidTrainingRequest, UnsupportedFeatureError
from domain.tinker.values import (
    Datum,
    PromptTable,
    Spans,
    TensorValue,
    TinkerSampleResult,
    TopK,
)

_TYPECODE = {pb.DTYPE_FLOAT32: ("f", "f"), pb.DTYPE_INT64: ("q", "q"), pb.DTYPE_INT32: ("i", "q")}


def _frombytes(typecode: str, raw: bytes, what: str) -> array:
    values = array(typecode)
    if len(raw) % values.itemsize:
        raise InvalidTrainingRequest(
            f"{what}: {len(raw)} bytes is not a whole number of {values.itemsize}-byte values"
        )
    values.frombytes(raw)
    return values


def forward_backward_proto(
    body: bytes,
) -> tuple[str, int | None, list[Datum], str, dict[str, float | str], bool]:
    """(model_id, seq_id, data, loss_fn, loss_fn_config, forward_only) of a protobuf body."""
    try:
        msg = pb.ForwardBackwardRequest.FromString(body)
    except Exception as e:
        raise InvalidTrainingRequest(f"forward_backward body is not a valid protobuf: {e}") from e
    config: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for key, value in msg.loss_fn_config_v2.items():  # v2 wins; text: a custom loss's loss_id
        is_text = value.WhichOneof("value") == "text"
        config[key] = value.text if is_text else float(value.number)
    data = []
    for i, d in enumerate(msg.data):
        tokens = array("i")
        for j, chunk in enumerate(d.model_input):
            kind = chunk.WhichOneof("chunk")
            if kind != "encoded_text":
                raise UnsupportedFeatureError(
                    f"data[{i}].model_input.chunks[{j}]: {kind!r} chunks are not supported"
                )
            where = f"data[{i}].model_input.chunks[{j}].tokens"
            tokens.extend(_frombytes("i", chunk.encoded_text.tokens, where))
        inputs = {
            name: _tensor(t, f"data[{i}].loss_fn_inputs[{name!r}]")
            for name, t in d.loss_fn_inputs.items()
        }
        spans = (
            _spans_proto(d.model_input_spans, f"data[{i}].model_input_spans"),
            _spans_proto(d.loss_fn_input_spans, f"data[{i}].loss_fn_input_spans"),
        )
        data.append(Datum(tokens, inputs, *span_pair(spans, f"data[{i}]")))
    seq_id = msg.seq_id or None
    return msg.model_id, seq_id, data, msg.loss_fn, config, msg.forward_only


def _spans_proto(spans: Sequence[Any], what: str) -> Spans | None:
    """A datum field's provenance (``ProvenanceSpan`` messages); none given: None."""
    if not spans:
        return None
    pairs = []
    for span in spans:
        kind = span.WhichOneof("span")
        pairs.append((kind, getattr(span, kind)) if kind else ("unset", None))
    return checked_spans(pairs, what)


def _tensor(t: Any, what: str) -> TensorValue:
    if t.WhichOneof("encoding") != "dense":
        raise UnsupportedFeatureError(f"{what}: sparse tensors are not supported")
    codes = _TYPECODE.get(t.dtype)
    if codes is None:
        raise InvalidTrainingRequest(f"{what}: unsupported dtype {t.dtype}")
    raw = _frombytes(codes[0], t.dense, what)
    data = raw if codes[0] == codes[1] else array(codes[1], raw)
    shape = tuple(t.shape) or (len(data),)
    if math.prod(shape) != len(data):
        raise InvalidTrainingRequest(f"{what}: shape {list(shape)} holds {len(data)} values")
    return TensorValue(data, shape)


def forward_backward_output_proto(result: ForwardBackwardResult) -> bytes:
    msg = pb.ForwardBackwardOutput()
    msg.loss_fn_output_type = "ArrayRecord"
    for key, value in result.metrics.items():
        msg.metrics[key] = float(value)
    if result.outputs:
        record = msg.loss_fn_outputs.add()
        record.num_datums = len(result.outputs)
        for name in result.outputs[0]:
            tensors = [out[name] for out in result.outputs]
            batched = record.fields[name]
            int_valued = tensors[0].dtype == "int64"
            batched.dtype = pb.DTYPE_INT64 if int_valued else pb.DTYPE_FLOAT32
            batched.trailing_shape.extend(tensors[0].shape[1:])
            offsets = array("q", [0])
            chunks = []
            for t in tensors:
                raw = t.data.tobytes()
                chunks.append(raw)
                offsets.append(offsets[-1] + len(raw))
            batched.data = b"".join(chunks)
            batched.offsets = offsets.tobytes()
    return msg.SerializeToString()


def sample_response_proto(result: TinkerSampleResult) -> bytes:
    msg = pb.SampleResponse()
    for seq in result.sequences:
        s = msg.sequences.add()
        s.stop_reason = pb.STOP_REASON_STOP if seq.stop_reason == "stop" else pb.STOP_REASON_LENGTH
        s.tokens = array("i", seq.tokens).tobytes()
        s.logprobs = array("f", seq.logprobs).tobytes()
        if seq.topk is not None:
            _topk_proto(s.topk_sampled_logprobs, seq.topk)
    if result.prompt_logprobs is not None:
        msg.prompt_logprobs = _nan_for_none(result.prompt_logprobs).tobytes()
    if result.topk_prompt is not None:
        _topk_proto(msg.topk_prompt_logprobs, result.topk_prompt)
    if result.target_prompt_logprobs is not None:
        _table_proto(msg.target_prompt_logprobs, result.target_prompt_logprobs)
    if result.prompt_alt_tokens is not None:
        alt = result.prompt_alt_tokens
        shape = [len(alt.tokens), alt.k]
        tokens = array("q", [t for row in alt.tokens for t in row])
        logprobs = array("f", [v for row in alt.logprobs for v in row])
        _dense_proto(msg.prompt_alt_tokens.tokens, tokens, pb.DTYPE_INT64, shape)
        _dense_proto(msg.prompt_alt_tokens.logprobs, logprobs, pb.DTYPE_FLOAT32, shape)
    return msg.SerializeToString()


def _table_proto(msg: Any, table: PromptTable) -> None:
    """A float32 table as a ``Tensor``: dense, or sparse CSR as the request's was."""
    values = array("f", table.values)
    if table.crow_indices is None or table.col_indices is None:
        _dense_proto(msg, values, pb.DTYPE_FLOAT32, list(table.shape))
        return
    msg.sparse_csr.values = values.tobytes()
    msg.sparse_csr.crow_indices = array("q", table.crow_indices).tobytes()
    msg.sparse_csr.col_indices = array("q", table.col_indices).tobytes()
    msg.dtype = pb.DTYPE_FLOAT32
    msg.shape.extend(table.shape)


def _dense_proto(msg: Any, values: array, dtype: int, shape: list[int]) -> None:
    msg.dense = values.tobytes()
    msg.dtype = dtype
    msg.shape.extend(shape)


# The SDK's filler for a position without alternatives (tinker.types.topk_logprobs).
MASK_LOGPROB = -99999.0


def _topk_proto(msg: Any, rows: Sequence[TopK | None]) -> None:
    """Rows of (id, logprob) pairs as the dense ``[length, k]`` matrices of TopkLogprobs;
    missing rows and short rows are filled with (0, MASK_LOGPROB)."""
    k = max((len(r) for r in rows if r), default=0)
    ids, values = array("i"), array("f")
    for row in rows:
        pairs = list(row or ())
        pairs += [(0, MASK_LOGPROB)] * (k - len(pairs))
        ids.extend(i for i, _ in pairs)
        values.extend(v for _, v in pairs)
    msg.token_ids, msg.logprobs = ids.tobytes(), values.tobytes()
    msg.k, msg.length = k, len(rows)


def _nan_for_none(values: Sequence[float | None]) -> array:
    return array("f", [math.nan if v is None else v for v in values])
