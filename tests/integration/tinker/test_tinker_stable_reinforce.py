"""StableReinforce with the stock SDK: sampling with ``record_stability_info=True``, data
that name the recorded sequences with provenance spans (as the cookbook's rl_loop builds
them), trained on the server's recorded sampler logprobs."""

import numpy as np
import pytest
import tinker
from tinker import types

from application.tinker.service import TinkerService
from tests.integration.tinker import test_tinker_sdk as sdk
from tests.support.tinker_server import API_KEY, BASE_MODEL

# The SDK tests' fixtures: a server on each backend (toy, LoRA) and a client of it.
make_app, app_and_service = sdk.make_app, sdk.app_and_service
service, url, client = sdk.service, sdk.url, sdk.client
SEQ = sdk.SEQ
PROMPT = SEQ[:5]


def rl_datum(sequence: types.SampledSequence, advantage: float, **replace: int) -> types.Datum:
    """The cookbook rl_loop's datum for one sampled sequence (``with_sampled_provenance``);
    ``replace``: position -> token, to tamper with the targets."""
    tokens = list(sequence.tokens)
    ob_len = len(PROMPT) - 1
    targets = [0] * ob_len + tokens
    for position, token in replace.items():
        targets[int(position.removeprefix("at"))] = token
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(PROMPT + tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": targets,
            "logprobs": [0.0] * ob_len + list(sequence.logprobs or []),
            "advantages": [0.0] * ob_len + [advantage] * len(tokens),
        },
    )
    sid = sequence.sequence_id
    return datum.with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id=sid, length=len(PROMPT)),
            types.SampledProvenanceSpan(sequence_id=sid, length=len(tokens) - 1),
        ],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=len(PROMPT) - 1),
            types.SampledProvenanceSpan(sequence_id=sid, length=len(tokens)),
        ],
    )


def sample(sampler: tinker.SamplingClient, n: int, seed: int) -> list[types.SampledSequence]:
    params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=seed, stop=[])
    return (
        sampler.sample(types.ModelInput.from_ints(PROMPT), num_samples=n, sampling_params=params)
        .result()
        .sequences
    )


def test_stable_reinforce_trains_on_the_recorded_sequences(
    client: tinker.ServiceClient, service: TinkerService
) -> None:
    tc = client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=7).result()
    sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    sequences = sample(sampler, 2, seed=3)
    assert len({s.sequence_id for s in sequences}) == 2
    assert len(service.records) == 2
    data = [rl_datum(s, a) for s, a in zip(sequences, (1.0, -1.0), strict=True)]

    out = tc.forward_backward(data, "stable_reinforce").result()
    # On policy, every ratio is about 1: the loss is about -sum(advantages) = -(4 - 4) = 0,
    # and the learner's logprobs of the sampled tokens are the sampler's.
    assert out.metrics["loss:sum"] == pytest.approx(0.0, abs=0.05)
    for o, s in zip(out.loss_fn_outputs, sequences, strict=True):
        np.testing.assert_allclose(o["logprobs"].tolist()[-4:], s.logprobs, atol=0.02)

    # A KL penalty on top: on policy it is about 0 too, and the step runs.
    kl = tc.forward_backward(data, "stable_reinforce", loss_fn_config={"kl_coeff": 0.5})
    assert kl.result().metrics["loss:sum"] == pytest.approx(0.0, abs=0.05)
    # A small step, so that it goes where the gradient points: at 0.05 the tiny Llama's
    # first step overshot (the first sequence down, or the second up) for some seeds and
    # dtypes; at 5e-3 never, and the logprobs still move by nats (the toy's by ~0.1).
    tc.optim_step(types.AdamParams(learning_rate=5e-3)).result()
    # After the step the learner moved toward the first sequence, away from the second.
    after = tc.forward(data, "cross_entropy").result().loss_fn_outputs
    up = sum(after[0]["logprobs"].tolist()[-4:]) - sum(sequences[0].logprobs or [])
    down = sum(after[1]["logprobs"].tolist()[-4:]) - sum(sequences[1].logprobs or [])
    assert up > 0 > down


def test_data_that_do_not_match_a_recorded_sequence_are_refused(
    client: tinker.ServiceClient, url: str
) -> None:
    tc = client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=8).result()
    recording = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    recorded = sample(recording, 1, seed=4)[0]
    unrecorded = sample(tc.save_weights_and_get_sampling_client().result(), 1, seed=4)[0]
    wrong = (recorded.tokens[1] + 1) % 256
    plain = types.Datum(
        model_input=types.ModelInput.from_ints(SEQ[:-1]),
        loss_fn_inputs={"target_tokens": SEQ[1:], "advantages": [0.0] * (len(SEQ) - 1)},
    )
    cases = [
        (rl_datum(unrecorded, 1.0), "not recorded for this session"),
        (rl_datum(recorded, 1.0, at5=wrong), f"token {wrong} is not token 1 of sequence"),
        (plain, "needs provenance"),
    ]
    for bad, message in cases:
        with pytest.raises(tinker.BadRequestError, match=message):
            tc.forward_backward([bad], "stable_reinforce").result()
    with pytest.raises(tinker.BadRequestError, match="not a parameter of stable_reinforce"):
        config = {"clip_low_threshold": 0.5}
        tc.forward_backward([rl_datum(recorded, 1.0)], "stable_reinforce", config).result()
    # Another session (same key) may not train on this session's recorded sequences.
    other = tinker.ServiceClient(base_url=url, api_key=API_KEY)
    try:
        theirs = other.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
        with pytest.raises(tinker.BadRequestError, match="not recorded for this session"):
            theirs.forward_backward([rl_datum(recorded, 1.0)], "stable_reinforce").result()
    finally:
        other.close("success").result()
