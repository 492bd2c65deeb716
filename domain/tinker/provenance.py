"""``stable_reinforce``'s provenance: a datum's spans matched to the sequences the server
recorded when it sampled them, the recorded logprobs and sampled mask filled in."""

from array import array
from collections.abc import Callable, Sequence

from domain.tinker.errors import InvalidTrainingRequest
from domain.tinker.values import Datum, RecordedSequence, Spans, TensorValue


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
