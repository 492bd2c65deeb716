"""Request lifecycle and StepOutput (the request state machine's tests)."""

import pytest

from domain.config import EngineConfig
from domain.errors import InvalidParameterError
from domain.request import Request, RequestState, StepOutput
from domain.sampling import SamplingParams


def make_request(request_id: str = "r", prompt: list[int] | None = None) -> Request:
    return Request(request_id, prompt or [1, 2, 3], SamplingParams(max_tokens=4), 0.0)


def test_a_new_request_waits_with_nothing_generated() -> None:
    request = make_request()
    assert request.state is RequestState.WAITING
    assert request.generated_token_ids == []
    assert request.num_computed_tokens == 0
    assert (request.finish_reason, request.scheduled_s, request.first_token_s) == (None,) * 3
    assert not request.is_done


def test_token_ids_span_prompt_and_output() -> None:
    request = make_request(prompt=[10, 11, 12])
    request.generated_token_ids += [20, 21]
    assert request.num_tokens == 5
    assert request.token_ids_from(0, 3) == [10, 11, 12]
    assert request.token_ids_from(2, 2) == [12, 20]
    assert request.token_ids_from(4, 1) == [21]


def test_finish_and_fail_end_the_request() -> None:
    done, failed = make_request("a"), make_request("b")
    done.finish("length")
    failed.fail()
    assert (done.state, done.finish_reason, done.is_done) == (RequestState.FINISHED, "length", True)
    assert (failed.state, failed.finish_reason, failed.is_done) == (
        RequestState.FAILED,
        "error",
        True,
    )


def test_step_output_carries_a_token_or_an_error() -> None:
    token = StepOutput("r", 42, "hi", finished=False, prompt_tokens=3, completion_tokens=1)
    error = StepOutput("r", None, "", finished=True, error="boom")
    assert (token.token_id, token.error, token.finish_reason) == (42, None, None)
    assert (error.finished, error.error) == (True, "boom")


def test_engine_config_defaults_to_continuous_batching() -> None:
    assert EngineConfig().batching_mode == "continuous"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("batching_mode", "dynamic"),
        ("max_num_seqs", 0),
        ("batch_wait_timeout", -1.0),
        ("max_num_batched_tokens", 1),
    ],
)
def test_engine_config_rejects_unsupported_values(field: str, value: object) -> None:
    with pytest.raises(InvalidParameterError) as error:
        EngineConfig(**{field: value})  # type: ignore[arg-type]
    assert error.value.param == field
