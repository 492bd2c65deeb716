"""StableReinforce's server side: recorded sequences and provenance resolved against them."""

import json

import pytest

from application.tinker.stability import SequenceRecords
from domain.tinker.errors import InvalidTrainingRequest
from domain.tinker.provenance import resolve_provenance
from domain.tinker.values import (
    Datum,
    ProvenanceSpan,
    RecordedSequence,
    SampledSequence,
    TensorValue,
    TinkerSampleResult,
)

PROMPT = [5, 6, 7, 8]
SAMPLED = [20, 21, 22]
LOGPROBS = [-0.5, -1.25, -2.0]


def _result(*sequences: list[int]) -> TinkerSampleResult:
    return TinkerSampleResult(
        [SampledSequence(list(s), [-1.0 - i for i in range(len(s))], "stop") for s in sequences]
    )


def _recorded(sequence_id: str) -> RecordedSequence:
    if sequence_id != "s1":
        raise InvalidTrainingRequest(f"unknown {sequence_id}")
    return RecordedSequence(PROMPT, SAMPLED, LOGPROBS)


def _datum(**overrides: object) -> Datum:
    """The cookbook's rl_loop datum: input = prompt + sampled[:-1], targets shifted by one."""
    n = len(PROMPT) + len(SAMPLED) - 1
    fields: dict[str, object] = {
        "tokens": PROMPT + SAMPLED[:-1],
        "targets": PROMPT[1:] + SAMPLED,
        "advantages": [0.0] * (len(PROMPT) - 1) + [1.5] * len(SAMPLED),
        "client_logprobs": [9.0] * n,  # what the client claims: replaced by the record
        "input_spans": (
            ProvenanceSpan("s1", 0, len(PROMPT), sampled=False),
            ProvenanceSpan("s1", 0, len(SAMPLED) - 1, sampled=True),
        ),
        "target_spans": (
            ProvenanceSpan("s1", 1, len(PROMPT) - 1, sampled=False),
            ProvenanceSpan("s1", 0, len(SAMPLED), sampled=True),
        ),
    }
    fields.update(overrides)
    inputs = {
        "target_tokens": TensorValue.ints(fields["targets"]),  # type: ignore[arg-type]
        "advantages": TensorValue.floats(fields["advantages"]),  # type: ignore[arg-type]
        "logprobs": TensorValue.floats(fields["client_logprobs"]),  # type: ignore[arg-type]
    }
    return Datum(fields["tokens"], inputs, fields["input_spans"], fields["target_spans"])  # type: ignore[arg-type]


def test_recorded_logprobs_and_the_sampled_mask_replace_the_clients() -> None:
    (out,) = resolve_provenance([_datum()], _recorded)
    prompt_targets = len(PROMPT) - 1
    assert list(out.loss_fn_inputs["logprobs"].data) == [0.0] * prompt_targets + LOGPROBS
    assert list(out.loss_fn_inputs["sampled_mask"].data) == [0.0] * prompt_targets + [1.0] * 3


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"input_spans": None, "target_spans": None}, "needs provenance"),
        ({"targets": [*PROMPT[1:], 20, 99, 22]}, "token 99 is not token 1 of sequence 's1'"),
        ({"tokens": [1, *PROMPT[1:], *SAMPLED[:-1]]}, "token 1 is not token 0 of sequence"),
        (
            {"input_spans": (ProvenanceSpan("s1", 0, 5, sampled=False),)},
            "cover 5 positions, the field has 6",
        ),
        (
            {"target_spans": (ProvenanceSpan("s1", 1, 6, sampled=False),)},
            "beyond sequence 's1''s prompt",
        ),
        (
            {
                "target_spans": (
                    ProvenanceSpan("s1", 1, 3, sampled=False),
                    ProvenanceSpan("other", 0, 3, sampled=True),
                )
            },
            "unknown other",
        ),
        ({"advantages": [0.5] + [0.0] * 2 + [1.5] * 3}, "nonzero advantages on sampled tokens"),
        ({"advantages": [0.0] * 3}, "one value per input position"),
    ],
)
def test_bad_provenance_is_refused_naming_the_problem(overrides, message) -> None:
    with pytest.raises(InvalidTrainingRequest, match=message.replace("(", r"\(")):
        resolve_provenance([_datum(**overrides)], _recorded)


def test_records_belong_to_their_session_and_owner() -> None:
    records = SequenceRecords()
    ids = records.new_ids(2)
    assert len(set(ids)) == 2
    records.record("alice", "sess-1", ids, PROMPT, _result(SAMPLED, [30, 31]))
    found = records.lookup("alice", "sess-1")(ids[1])
    assert (list(found.prompt), list(found.tokens)) == (PROMPT, [30, 31])
    for owner, session in (("bob", "sess-1"), ("alice", "sess-2")):
        with pytest.raises(InvalidTrainingRequest, match="not recorded for this session"):
            records.lookup(owner, session)(ids[0])
    records.end_session("sess-1")
    assert len(records) == 0 and records.tokens == 0


def test_records_expire_a_day_after_their_last_use() -> None:
    now = [0.0]
    records = SequenceRecords(ttl_s=100.0, clock=lambda: now[0])
    used, unused = records.new_ids(2)
    records.record("a", "s", [used, unused], PROMPT, _result(SAMPLED, SAMPLED))
    now[0] = 90.0
    records.lookup("a", "s")(used)  # restarts its lifetime
    now[0] = 150.0
    find = records.lookup("a", "s")
    assert list(find(used).tokens) == SAMPLED
    with pytest.raises(InvalidTrainingRequest):
        find(unused)


def test_beyond_the_token_budget_the_least_recently_used_go() -> None:
    each = len(PROMPT) + len(SAMPLED)
    records = SequenceRecords(max_tokens=2 * each)
    first, second, third = records.new_ids(3)
    records.record("a", "s", [first], PROMPT, _result(SAMPLED))
    records.record("a", "s", [second], PROMPT, _result(SAMPLED))
    records.lookup("a", "s")(first)  # now the most recently used
    records.record("a", "s", [third], PROMPT, _result(SAMPLED))
    find = records.lookup("a", "s")
    assert find(first) and find(third)
    with pytest.raises(InvalidTrainingRequest):
        find(second)
    assert records.tokens == 2 * each


def test_sequence_ids_differ_between_server_processes() -> None:
    assert SequenceRecords().new_ids(1) != SequenceRecords().new_ids(1)


# --- the wire: provenance spans in JSON and protobuf ------------------------------------


def test_json_spans_in_both_forms_and_bad_ones_refused() -> None:
    from adapters.http.tinker.codec import json as codec

    def body(spans: list[object]) -> bytes:
        datum = {
            "model_input": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
            "loss_fn_inputs": {"target_tokens": {"data": [2, 3], "dtype": "int64"}},
            "model_input_spans": spans,
            "loss_fn_input_spans": spans,
        }
        return json.dumps(
            {"model_id": "m", "forward_backward_input": {"data": [datum], "loss_fn": "x"}}
        ).encode()

    forms = [
        {"prompt_tokens": {"sequence_id": "s", "length": 1}},
        {"type": "sampled", "sequence_id": "s", "offset": 2, "length": 1},
    ]
    (datum,) = codec.forward_backward_json(codec.decode(body(forms), codec.ForwardBackwardIn))
    assert datum.model_input_spans == (
        ProvenanceSpan("s", 0, 1, sampled=False),
        ProvenanceSpan("s", 2, 1, sampled=True),
    )
    for bad, message in [
        ([{"sequence_id": "s", "length": 1}], "prompt_tokens or sampled_tokens"),
        ([{"type": "prompt", "sequence_id": "", "length": 1}], "non-empty string"),
        ([{"type": "prompt", "sequence_id": "s", "length": -1}], "integer >= 0"),
        ([{"type": "prompt", "sequence_id": "s", "length": True}], "integer >= 0"),
        (["span"], "Expected `object`"),
    ]:
        with pytest.raises(InvalidTrainingRequest, match=message):
            codec.forward_backward_json(codec.decode(body(bad), codec.ForwardBackwardIn))


def test_protobuf_spans_come_as_a_pair() -> None:
    from tinker import types
    from tinker.proto.request_conv import forward_backward_request_to_proto

    from adapters.http.tinker.codec import proto as codec

    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2]),
        loss_fn_inputs={"target_tokens": [2, 3]},
    ).with_provenance(
        model_input=[types.SampledProvenanceSpan(sequence_id="s", offset=1, length=2)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id="s", length=2)],
    )
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn="x"),
        model_id="m",
        seq_id=1,
    )
    msg = forward_backward_request_to_proto(request)
    data = codec.forward_backward_proto(msg.SerializeToString())[2]
    assert data[0].model_input_spans == (ProvenanceSpan("s", 1, 2, sampled=True),)
    assert data[0].loss_fn_input_spans == (ProvenanceSpan("s", 0, 2, sampled=False),)
    del msg.data[0].loss_fn_input_spans[:]
    with pytest.raises(InvalidTrainingRequest, match="provenance comes as a pair"):
        codec.forward_backward_proto(msg.SerializeToString())
