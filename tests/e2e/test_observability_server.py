"""A real `infer serve` exporting traces over OTLP/HTTP to a receiver this test runs on
127.0.0.1 (decoded with opentelemetry-proto), scraped at /metrics after real traffic from
the openai SDK: the client's trace id and parentage arrive, steps link to requests, and
the metric counts add up."""

from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.server import infer_serve
from tests.support.otlp_receiver import Receiver, find_spans, running_receiver

pytestmark = pytest.mark.slow
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    with running_receiver() as server:
        yield server


def test_traces_reach_an_otlp_receiver_and_metrics_add_up(receiver: Receiver) -> None:
    endpoint = f"http://127.0.0.1:{receiver.server_address[1]}"
    with infer_serve("--no-tinker", "--otlp-traces-endpoint", endpoint) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        traceparent = f"00-{TRACE_ID}-{PARENT_ID}-01"
        completion = client.completions.create(
            model=MODEL,
            prompt="The capital of France is",
            max_tokens=8,
            temperature=0,
            extra_headers={"traceparent": traceparent},
        )
        usage = [completion.usage]
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
        usage += [chunk.usage for chunk in stream if chunk.usage is not None]
        metrics = httpx.get(f"{url}/metrics", timeout=10)

        [server_span] = [
            s for s in find_spans(receiver, "POST /v1/completions") if s.trace_id.hex() == TRACE_ID
        ]
        assert server_span.parent_span_id.hex() == PARENT_ID
        requests = find_spans(receiver, "engine.request", 2)
        [traced] = [s for s in requests if s.trace_id.hex() == TRACE_ID]
        assert traced.parent_span_id == server_span.span_id
        attributes = {a.key: a.value for a in traced.attributes}
        assert attributes["gen_ai.usage.output_tokens"].int_value == usage[0].completion_tokens
        steps = find_spans(receiver, "engine.step", usage[0].completion_tokens)
        linked = [s for s in steps if any(link.span_id == traced.span_id for link in s.links)]
        assert len(linked) == usage[0].completion_tokens  # one token a step
        assert all(p == "/v1/traces" for p in receiver.paths)

    assert metrics.status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(metrics.text)}

    def total(name: str, **labels: str) -> float:
        return sum(
            s.value
            for s in families[name].samples
            if s.name.endswith("_total") and labels.items() <= s.labels.items()
        )

    assert total("infer:generation_tokens") == sum(u.completion_tokens for u in usage)
    assert total("infer:prompt_tokens") == sum(u.prompt_tokens for u in usage)
    assert total("infer:request_success") == 2
    assert total("infer:requests", route="/v1/completions", code="200") == 1
    assert total("infer:requests", route="/v1/chat/completions", code="200") == 1
