"""Provenance spans as both wire formats give them: checked (count, order, sizes) the same
way."""

from collections.abc import Sequence
from typing import Any

from domain.tinker.errors import InvalidTrainingRequest
from domain.tinker.values import (
    ProvenanceSpan,
    Spans,
)

MAX_SPANS = 1 << 16  # provenance spans per field of one datum


def checked_spans(pairs: Sequence[tuple[str, Any]], what: str) -> Spans:
    if len(pairs) > MAX_SPANS:
        raise InvalidTrainingRequest(f"{what}: {len(pairs)} spans, at most {MAX_SPANS}")
    out = []
    for j, (kind, span) in enumerate(pairs):
        if kind not in ("prompt_tokens", "sampled_tokens"):
            raise InvalidTrainingRequest(
                f"{what}[{j}]: a span is prompt_tokens or sampled_tokens (Tinker's "
                "PromptProvenanceSpan / SampledProvenanceSpan)"
            )
        fields = (
            span
            if isinstance(span, dict)
            else {"sequence_id": span.sequence_id, "offset": span.offset, "length": span.length}
        )
        sequence_id = fields.get("sequence_id")
        offset, length = fields.get("offset", 0), fields.get("length")
        if not isinstance(sequence_id, str) or not sequence_id:
            raise InvalidTrainingRequest(f"{what}[{j}].sequence_id must be a non-empty string")
        for name, value in (("offset", offset), ("length", length)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidTrainingRequest(f"{what}[{j}].{name} must be an integer >= 0")
        out.append(
            ProvenanceSpan(sequence_id, int(offset), int(length or 0), kind == "sampled_tokens")
        )
    return tuple(out)


def span_pair(spans: tuple[Spans | None, Spans | None], what: str) -> tuple[Spans | None, ...]:
    if (spans[0] is None) != (spans[1] is None):
        raise InvalidTrainingRequest(
            f"{what}: provenance comes as a pair (model_input_spans and loss_fn_input_spans)"
        )
    return spans
