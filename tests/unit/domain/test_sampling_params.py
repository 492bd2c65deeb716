"""SamplingParams validates its ranges and names the offending field."""

import pytest

from domain.errors import InvalidParameterError
from domain.sampling import SamplingParams


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("temperature", -0.1),
        ("top_k", -2),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", 1.1),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("seed", -(2**63) - 1),
        ("seed", 2**63),
        ("stop", ("",)),
        ("stop_token_ids", (-1,)),
        ("logprobs", 21),
    ],
)
def test_out_of_range_values_are_rejected_by_name(field: str, value: object) -> None:
    with pytest.raises(InvalidParameterError) as error:
        SamplingParams(**{field: value})  # type: ignore[arg-type]
    assert error.value.param == field
    assert field in str(error.value)


@pytest.mark.parametrize("seed", [-1, -(2**63), 2**63 - 1])
def test_any_64_bit_signed_seed_is_accepted_as_openai_and_vllm_do(seed: int) -> None:
    assert SamplingParams(seed=seed).seed == seed


def test_defaults_are_valid_and_sample_without_penalties() -> None:
    params = SamplingParams()
    assert not params.greedy
    assert not params.has_penalties


def test_temperature_zero_is_greedy_and_penalties_are_detected() -> None:
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(presence_penalty=0.5).has_penalties
    assert SamplingParams(repetition_penalty=1.2).has_penalties


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("logit_bias", ((5, 100.5),)),
        ("logit_bias", ((5, float("nan")),)),
        ("logit_bias", ((-1, 1.0),)),
        ("logit_bias", ((5, 1.0), (5, 2.0))),
        ("allowed_token_ids", ()),
        ("allowed_token_ids", (3, -2)),
    ],
)
def test_logits_processing_params_are_validated(field: str, value: object) -> None:
    with pytest.raises(InvalidParameterError) as error:
        SamplingParams(**{field: value})  # type: ignore[arg-type]
    assert error.value.param == field


def test_logits_processing_is_off_by_default() -> None:
    assert not SamplingParams().processes_logits
    assert SamplingParams(logit_bias=((1, -100.0),)).processes_logits
    assert SamplingParams(allowed_token_ids=(1,)).processes_logits
