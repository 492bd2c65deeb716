"""/metrics after real traffic through the composition root (fake runner): the Prometheus
exposition parses, and the request, token and latency counts add up."""

from litestar.testing import TestClient
from prometheus_client.parser import text_string_to_metric_families

from adapters.fake import ByteTokenizer
from adapters.fake.runner import FakeModelRunner, reply_script
from adapters.observability.settings import ObservabilitySettings
from tests.fakes import fake_container

REPLY = "Paris is the capital."


def _samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _sum(samples: dict, name: str, **labels: str) -> float:
    return sum(
        value
        for (sample, sample_labels), value in samples.items()
        if sample == name and set(labels.items()) <= sample_labels
    )


def test_metrics_add_up_after_real_traffic(tmp_path) -> None:
    runner = FakeModelRunner(script=reply_script(ByteTokenizer(), REPLY))
    container = fake_container(runner, cache_dir=str(tmp_path))
    with TestClient(app=container.http_app()) as client:  # type: ignore[arg-type]
        usages = []
        response = client.post(
            "/v1/completions", json={"model": "fake", "prompt": ["a", "bb"], "max_tokens": 5}
        )
        usages.append(response.json()["usage"])
        with client.stream(
            "POST",
            "/v1/chat/completions",
            json={
                "model": "fake",
                "messages": [{"role": "user", "content": "Hi"}],
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        ) as stream:
            body = "".join(stream.iter_text())
        assert '"usage"' in body
        assert client.post("/v1/completions", json={"model": "x", "prompt": "a"}).status_code == 404
        text = client.get("/metrics").text
    samples = _samples(text)

    assert _sum(samples, "infer:requests_total", route="/v1/completions", code="200") == 1
    assert _sum(samples, "infer:requests_total", route="/v1/chat/completions", code="200") == 1
    assert _sum(samples, "infer:requests_total", code="404") == 1
    assert _sum(samples, "infer:errors_total", code="404") == 1
    # Three engine requests: two prompts of one completion, one chat.
    assert _sum(samples, "infer:request_success_total") == 3
    assert _sum(samples, "infer:request_success_total", finished_reason="length") == 2
    assert _sum(samples, "infer:time_to_first_token_seconds_count") == 3
    assert _sum(samples, "infer:e2e_request_latency_seconds_count") == 3
    completion_tokens = usages[0]["completion_tokens"]
    assert completion_tokens == 10
    generated = _sum(samples, "infer:generation_tokens_total")
    assert generated == completion_tokens + len(REPLY) + 1  # the chat: the reply, then EOS
    assert _sum(samples, "infer:tokens_output_total") == generated
    assert _sum(samples, "infer:prompt_tokens_total") == _sum(samples, "infer:tokens_input_total")
    assert _sum(samples, "infer:active_streams") == 0
    assert _sum(samples, "infer:num_requests_running") == 0
    assert _sum(samples, "infer:request_duration_seconds_count", route="/v1/completions") == 2


def test_metrics_can_be_turned_off(tmp_path) -> None:
    container = fake_container(
        cache_dir=str(tmp_path), observability=ObservabilitySettings(metrics=False)
    )
    with TestClient(app=container.http_app()) as client:  # type: ignore[arg-type]
        assert client.get("/metrics").status_code == 404
        assert client.get("/ready").json() == {"ready": True}
