"""The Prometheus metrics adapter: hand-built step statistics and request records in,
the parsed exposition out, every number checked."""

from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from adapters.observability.metrics import Metrics
from application.serving.request_record import RequestRecord
from domain.observer import (
    RequestStart,
    RequestStats,
    SchedulerStats,
    StepRow,
    StepStats,
)
from domain.request import RequestContext
from domain.sampling import SamplingParams

PARAMS = SamplingParams()
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(metrics: Metrics) -> Samples:
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    samples: Samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def value(samples: Samples, name: str, model: str = "m", **labels: str) -> float:
    return samples[(name, frozenset({"model_name": model, **labels}.items()))]


def assert_histogram(
    samples: Samples,
    name: str,
    *,
    count: float,
    total: object = None,
    buckets: dict[str, float] | None = None,
    **labels: str,
) -> None:
    """``name``'s ``_count``, its ``_sum`` (where ``total`` is given) and the ``le`` buckets
    named in ``buckets``."""
    assert value(samples, f"{name}_count", **labels) == count
    if total is not None:
        assert value(samples, f"{name}_sum", **labels) == total
    for le, observed in (buckets or {}).items():
        assert value(samples, f"{name}_bucket", le=le, **labels) == observed


def labelled(samples: Samples, name: str, label: str) -> dict[str, float]:
    """``name``'s samples keyed by one label's value."""
    return {dict(key)[label]: v for (sample, key), v in samples.items() if sample == name}


def ended(
    request_id: str,
    *,
    times: tuple[float, float | None, float | None, float],
    reason: str,
    tokens: tuple[int, int],
    tenant: str | None = None,
) -> RequestStats:
    """``times``: (arrival, scheduled, first token, finished); ``tokens``: (prompt,
    completion)."""
    arrival, scheduled, first, finished = times
    prompt, completion = tokens
    return RequestStats(
        request_id,
        arrival,
        scheduled,
        first,
        finished,
        reason,
        prompt,
        completion,
        context=RequestContext(tenant_id=tenant),
    )


def one_request_life(metrics: Metrics) -> None:
    """a (tenant t1, 10 prompt tokens) is prefilled in two chunks and decodes to its length
    limit; b (tenant t2, 7 prompt tokens) waits all along and is aborted."""
    t1, t2 = RequestContext(tenant_id="t1"), RequestContext(tenant_id="t2")

    def step(
        start_s: float, time_s: float, load: SchedulerStats, row: StepRow, **more: Any
    ) -> None:
        """A step from ``start_s`` to ``time_s`` that ran ``row`` (``more``: other fields)."""
        metrics.on_step(StepStats(True, time_s, load, start_s=start_s, rows=(row,), **more))

    step(
        0.9,
        1.0,
        SchedulerStats(running=1, waiting=1, prefill_tokens=6, decode_tokens=0, kv_usage=0.25),
        StepRow("a", 6, 0),
        started=(RequestStart("a", 0.0, 10, PARAMS, t1), RequestStart("b", 0.5, 7, PARAMS, t2)),
    )
    prefilled, decoding = StepRow("a", 4, 0), StepRow("a", 0, 1)
    step(
        1.0, 2.0, SchedulerStats(1, 1, 4, 0, 0.25), prefilled, sampled_tokens=1, first_tokens=("a",)
    )
    b = ended("b", times=(0.5, None, None, 2.5), reason="abort", tokens=(7, 0), tenant="t2")
    step(2.0, 2.5, SchedulerStats(1, 0, 0, 1, 0.25), decoding, sampled_tokens=1, finished=(b,))
    a = ended("a", times=(0.0, 0.9, 2.0, 3.25), reason="length", tokens=(10, 3), tenant="t1")
    step(2.5, 3.25, SchedulerStats(0, 0, 0, 1, 0.0), decoding, sampled_tokens=1, finished=(a,))


def test_gauges_follow_the_latest_step() -> None:
    metrics = Metrics("m", max_num_seqs=4, kv_cache_bytes=1000)
    metrics.on_step(StepStats(True, 1.0, SchedulerStats(3, 2, 5, 2, 0.375), start_s=0.5))
    s = scrape(metrics)
    assert value(s, "infer:num_requests_running") == 3
    assert value(s, "infer:num_requests_waiting") == 2
    assert value(s, "infer:kv_cache_usage_perc") == 0.375
    assert value(s, "infer:kv_cache_bytes") == 375.0
    # vLLM's names for the same, as llm-d's endpoint picker and vLLM routers read them
    assert value(s, "vllm:num_requests_running") == 3
    assert value(s, "vllm:num_requests_waiting") == 2
    assert value(s, "vllm:kv_cache_usage_perc") == 0.375
    metrics.on_step(StepStats(False, 2.0, SchedulerStats(0, 1, 0, 0, 0.0)))
    s = scrape(metrics)
    assert value(s, "infer:num_requests_running") == 0
    assert value(s, "infer:num_requests_waiting") == 1
    assert value(s, "infer:kv_cache_bytes") == 0.0


def test_prefix_cache_lookups_and_hits_are_counted() -> None:
    metrics = Metrics("m", max_num_seqs=4)
    metrics.on_step(StepStats(True, 1.0, SchedulerStats(1, 0, 40, 0, 0.1, 40, 0)))
    metrics.on_step(StepStats(True, 2.0, SchedulerStats(2, 0, 8, 1, 0.2, 40, 32)))
    metrics.on_step(StepStats(True, 3.0, SchedulerStats(2, 0, 0, 2, 0.2)))
    s = scrape(metrics)
    assert value(s, "infer:prefix_cache_queries_total") == 80
    assert value(s, "infer:prefix_cache_hits_total") == 32


def test_a_request_life_adds_up() -> None:
    metrics = Metrics("m", max_num_seqs=4, kv_cache_bytes=1000)
    one_request_life(metrics)
    s = scrape(metrics)

    assert value(s, "infer:prompt_tokens_total") == 10
    assert value(s, "infer:generation_tokens_total") == 3
    assert value(s, "infer:num_preemptions_total") == 0
    assert labelled(s, "infer:request_success_total", "finished_reason") == {
        "eos": 0,
        "stop": 0,
        "length": 1,
        "abort": 1,
        "error": 0,
    }
    assert value(s, "infer:num_requests_running") == 0
    assert value(s, "infer:kv_cache_usage_perc") == 0.0

    # TTFT: a only (b never got a first token): 2.0 - 0.0.
    assert_histogram(
        s, "infer:time_to_first_token_seconds", count=1, total=2.0, buckets={"1.0": 0, "2.5": 1}
    )
    # ITL: a decoded in steps 3 and 4: 2.5 - 2.0 and 3.25 - 2.5.
    assert_histogram(
        s, "infer:inter_token_latency_seconds", count=2, total=1.25, buckets={"0.5": 1, "0.75": 2}
    )
    # e2e: both requests (3.25 and 2.0); queue / prefill / decode: a only.
    assert_histogram(s, "infer:e2e_request_latency_seconds", count=2, total=5.25)
    assert_histogram(s, "infer:request_queue_time_seconds", count=1, total=pytest.approx(0.9))
    assert_histogram(s, "infer:request_prefill_time_seconds", count=1, total=pytest.approx(1.1))
    assert_histogram(s, "infer:request_decode_time_seconds", count=1, total=1.25)
    assert_histogram(
        s, "infer:request_prompt_tokens", count=2, total=17, buckets={"5.0": 0, "10.0": 2}
    )
    assert_histogram(s, "infer:request_generation_tokens", count=2, total=3, buckets={"1.0": 1})

    # Per step: tokens 6, 4, 1, 1; prefill rows 1, 1, 0, 0; decode rows 0, 0, 1, 1.
    assert_histogram(
        s, "infer:iteration_tokens_total", count=4, total=12, buckets={"1.0": 2, "8.0": 4}
    )
    for name in ("infer:batch_size_prefill", "infer:batch_size_decode"):
        assert_histogram(s, name, count=4, total=2, buckets={"0.0": 2, "1.0": 4})
    assert set(labelled(s, "infer:batch_size_decode_bucket", "le")) == {
        "0.0",
        "1.0",
        "2.0",
        "4.0",
        "+Inf",
    }

    # Tenants, counted at the end.
    assert labelled(s, "infer:tenant_requests_total", "tenant") == {"t1": 1, "t2": 1}
    assert labelled(s, "infer:tenant_prompt_tokens_total", "tenant") == {"t1": 10, "t2": 7}
    assert labelled(s, "infer:tenant_generation_tokens_total", "tenant") == {"t1": 3, "t2": 0}


def test_every_sample_has_the_prefix_and_the_model_label() -> None:
    """``infer:``, but the three vLLM-named aliases routers read."""
    metrics = Metrics("llama-3", max_num_seqs=2)
    metrics.on_step(StepStats(True, 1.0, SchedulerStats(1, 0, 3, 0, 0.5), start_s=0.0))
    s = scrape(metrics)
    assert s
    vllm = {
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:lora_requests_info",
    }
    assert vllm <= {name for name, _ in s}
    for name, labels in s:
        assert name.startswith("infer:") or name in vllm
        assert dict(labels)["model_name"] == "llama-3"
    assert value(s, "infer:kv_cache_bytes", model="llama-3") == 0.0  # no cache size given


def test_inter_token_latency_skips_the_first_step_after_idle() -> None:
    metrics = Metrics("m", max_num_seqs=4)
    decoding = (StepRow("a", 0, 1), StepRow("b", 0, 1), StepRow("c", 5, 0))

    def step(ran: bool, time_s: float, running: int = 3) -> None:
        metrics.on_step(
            StepStats(
                ran,
                time_s,
                SchedulerStats(running, 0, 5 if ran else 0, 2 if ran else 0, 0.5),
                sampled_tokens=3 if ran else 0,
                start_s=time_s - 0.1 if ran else None,
                rows=decoding if ran else (),
                preempted=("c",) if time_s == 1.5 else (),
            )
        )

    step(True, 1.0)  # nothing before it: skipped
    step(True, 1.5)  # 2 decode rows, 0.5 each
    step(False, 2.0)  # idle
    step(True, 4.0)  # first after idle: skipped
    step(True, 4.25, running=0)  # 2 rows, 0.25 each; nothing left running
    step(True, 9.0)  # the engine went idle in between: skipped
    step(True, 9.5)  # 2 rows, 0.5 each
    s = scrape(metrics)
    assert_histogram(s, "infer:inter_token_latency_seconds", count=6, total=2.5, buckets={"0.3": 2})
    assert value(s, "infer:num_preemptions_total") == 1
    # Steps that ran: 6 (the idle one observes nothing); 1 prefill row and 2 decode rows each.
    assert value(s, "infer:batch_size_prefill_count") == 6
    assert value(s, "infer:batch_size_prefill_sum") == 6
    assert value(s, "infer:batch_size_decode_sum") == 12
    assert value(s, "infer:batch_size_decode_bucket", le="1.0") == 0
    assert value(s, "infer:batch_size_decode_bucket", le="2.0") == 6


def test_a_failed_step_observes_no_inter_token_latency() -> None:
    metrics = Metrics("m", max_num_seqs=2)
    rows = (StepRow("a", 0, 1),)
    metrics.on_step(StepStats(True, 1.0, SchedulerStats(1, 0, 0, 1, 0.5), 1, rows=rows))
    failed = ended("a", times=(0.0, 0.1, 0.5, 2.0), reason="error", tokens=(4, 2))
    metrics.on_step(
        StepStats(True, 2.0, SchedulerStats(0, 0, 0, 1, 0.0), 0, rows=rows, finished=(failed,))
    )
    s = scrape(metrics)
    assert value(s, "infer:inter_token_latency_seconds_count") == 0
    assert value(s, "infer:request_success_total", finished_reason="error") == 1
    assert labelled(s, "infer:tenant_requests_total", "tenant") == {"none": 1}


def test_tenants_past_the_cap_share_the_other_label() -> None:
    metrics = Metrics("m", max_num_seqs=4, max_tenants=2)
    tenants = ["a", "b", "c", "d", None, "a", "c", "b"]
    finished = tuple(
        ended(
            f"r{i}",
            times=(0.0, 0.0, 0.5, 1.0),
            reason="stop",
            tokens=(10 * (i + 1), i),
            tenant=tenant,
        )
        for i, tenant in enumerate(tenants)
    )
    metrics.on_step(StepStats(False, 1.0, SchedulerStats(0, 0, 0, 0, 0.0), finished=finished))
    metrics.rate_limited("a", "requests")
    metrics.rate_limited("zzz", "tokens")
    metrics.rate_limited(None, "tokens")
    s = scrape(metrics)
    assert labelled(s, "infer:tenant_requests_total", "tenant") == {
        "a": 2,
        "b": 2,
        "other": 3,
        "none": 1,
    }
    # prompt tokens: a = 10 + 60, b = 20 + 80, other (c, d, c) = 30 + 40 + 70, none = 50.
    assert labelled(s, "infer:tenant_prompt_tokens_total", "tenant") == {
        "a": 70,
        "b": 100,
        "other": 140,
        "none": 50,
    }
    assert labelled(s, "infer:tenant_generation_tokens_total", "tenant") == {
        "a": 5,
        "b": 8,
        "other": 11,
        "none": 4,
    }
    assert value(s, "infer:request_success_total", finished_reason="stop") == 8
    # Ended without running a step: no TTFT (no RequestStart was seen), e2e for all.
    assert value(s, "infer:time_to_first_token_seconds_count") == 0
    assert value(s, "infer:e2e_request_latency_seconds_count") == 8
    assert value(s, "infer:request_decode_time_seconds_sum") == 4.0
    assert labelled(s, "infer:rate_limit_dropped_total", "limit") == {"requests": 1, "tokens": 2}
    assert labelled(s, "infer:tenant_rate_limited_total", "tenant") == {
        "a": 1,
        "other": 1,
        "none": 1,
    }


class FakeClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_http_requests_streams_and_errors() -> None:
    clock = FakeClock(100.0)
    metrics = Metrics("m", max_num_seqs=4, clock=clock)
    streamed = RequestRecord(method="POST", route="/v1/completions", started_s=99.0)
    plain = RequestRecord(method="GET", route="/v1/models", started_s=99.5)
    refused = RequestRecord(method="POST", route="/v1/completions", started_s=100.0)
    crashed = RequestRecord(method="POST", route="/v1/chat/completions", started_s=98.0)
    for record in (streamed, plain, refused, crashed):
        metrics.request_started(record)
    metrics.stream_started(streamed)
    metrics.stream_started(streamed)  # once per record
    s = scrape(metrics)
    assert value(s, "infer:active_requests") == 4
    assert value(s, "infer:active_streams") == 1

    streamed.status, streamed.stream = 200, True
    streamed.prompt_tokens, streamed.completion_tokens = 5, 7
    metrics.request_finished(streamed)
    plain.status = 200
    metrics.request_finished(plain)
    s = scrape(metrics)
    assert value(s, "infer:active_requests") == 2
    assert value(s, "infer:active_streams") == 0

    refused.status = 429
    refused.prompt_tokens = 3
    metrics.request_finished(refused)
    metrics.request_finished(crashed)  # no status: counted as 500
    s = scrape(metrics)
    assert value(s, "infer:active_requests") == 0
    assert value(s, "infer:active_streams") == 0
    assert labelled(s, "infer:requests_total", "code") == {"200": 1, "429": 1, "500": 1}
    requests = {
        (dict(k)["route"], dict(k)["method"], dict(k)["code"]): v
        for (name, k), v in s.items()
        if name == "infer:requests_total"
    }
    assert requests == {
        ("/v1/completions", "POST", "200"): 1,
        ("/v1/models", "GET", "200"): 1,
        ("/v1/completions", "POST", "429"): 1,
        ("/v1/chat/completions", "POST", "500"): 1,
    }
    assert labelled(s, "infer:errors_total", "code") == {"429": 1, "500": 1}
    duration = "infer:request_duration_seconds"
    assert value(s, f"{duration}_count", route="/v1/completions") == 2
    assert value(s, f"{duration}_sum", route="/v1/completions") == 1.0  # 1.0 + 0.0
    assert value(s, f"{duration}_sum", route="/v1/models") == 0.5
    assert value(s, f"{duration}_sum", route="/v1/chat/completions") == 2.0
    assert value(s, "infer:tokens_input_total") == 8
    assert value(s, "infer:tokens_output_total") == 7


def test_route_and_method_labels_are_bounded() -> None:
    metrics = Metrics("m", max_num_seqs=4, clock=FakeClock(0.0))
    for i in range(70):
        metrics.request_finished(RequestRecord(method="GET", route=f"/r{i}", status=404))
    metrics.request_finished(RequestRecord(method="BREW", route="/r0", status=405))
    s = scrape(metrics)
    routes = labelled(s, "infer:request_duration_seconds_count", "route")
    assert len(routes) == 65
    assert routes["other"] == 6
    assert routes["/r0"] == 2
    assert value(s, "infer:requests_total", route="/r0", method="other", code="405") == 1
    assert value(s, "infer:errors_total", code="404") == 70


def test_tinker_operations_and_pending_futures() -> None:
    metrics = Metrics("m", max_num_seqs=4)
    metrics.training_op("forward_backward", 120, 0.5, True)
    metrics.training_op("forward_backward", 80, 1.5, False)
    metrics.training_op("optim_step", 0, 0.02, True)
    pending = [3]
    metrics.track_pending_futures(lambda: pending[0])
    s = scrape(metrics)
    assert value(s, "infer:tinker_operations_total", op="forward_backward", status="ok") == 1
    assert value(s, "infer:tinker_operations_total", op="forward_backward", status="error") == 1
    assert value(s, "infer:tinker_operations_total", op="optim_step", status="ok") == 1
    assert labelled(s, "infer:tinker_tokens_total", "op") == {"forward_backward": 200}
    assert value(s, "infer:tinker_operation_seconds_count", op="forward_backward") == 2
    assert value(s, "infer:tinker_operation_seconds_sum", op="forward_backward") == 2.0
    assert value(s, "infer:tinker_operation_seconds_bucket", op="optim_step", le="0.05") == 1
    assert value(s, "infer:tinker_pending_futures") == 3
    pending[0] = 0
    assert value(scrape(metrics), "infer:tinker_pending_futures") == 0


def test_instances_do_not_share_state() -> None:
    first = Metrics("m", max_num_seqs=4, max_tenants=1)
    second = Metrics("m", max_num_seqs=4, max_tenants=1)
    one_request_life(first)
    first.request_started(RequestRecord())
    first.rate_limited("x", "queue")
    s1, s2 = scrape(first), scrape(second)
    assert value(s1, "infer:prompt_tokens_total") == 10
    assert value(s2, "infer:prompt_tokens_total") == 0
    assert value(s1, "infer:e2e_request_latency_seconds_count") == 2
    assert value(s2, "infer:e2e_request_latency_seconds_count") == 0
    assert value(s1, "infer:active_requests") == 1
    assert value(s2, "infer:active_requests") == 0
    # b (t2) ended first and took the one tenant label; a (t1) came after the cap.
    assert labelled(s1, "infer:tenant_requests_total", "tenant") == {"t2": 1, "other": 1}
    assert labelled(s2, "infer:tenant_requests_total", "tenant") == {}
    assert labelled(s2, "infer:rate_limit_dropped_total", "limit") == {}
    # The second instance's tenant cap is its own: its first tenant gets its label.
    second.rate_limited("y", "queue")
    assert labelled(scrape(second), "infer:tenant_rate_limited_total", "tenant") == {"y": 1}


def test_speculative_decoding_counts_drafts_and_accepted_tokens() -> None:
    metrics = Metrics("m", max_num_seqs=4)
    for drafts, drafted, accepted in ((2, 8, 5), (1, 4, 0), (0, 0, 0)):
        metrics.on_step(
            StepStats(
                True,
                1.0,
                SchedulerStats(2, 0, 0, 2, 0.1),
                drafts=drafts,
                drafted_tokens=drafted,
                accepted_tokens=accepted,
            )
        )
    s = scrape(metrics)
    assert value(s, "infer:spec_decode_num_drafts_total") == 3
    assert value(s, "infer:spec_decode_num_draft_tokens_total") == 12
    assert value(s, "infer:spec_decode_num_accepted_tokens_total") == 5


def test_the_lora_gauge_names_the_running_and_waiting_adapters_as_vllm_does() -> None:
    """One sample (the current state), its labels the adapters, as llm-d's picker reads."""
    metrics = Metrics("m", max_num_seqs=4, max_loras=8)
    stats = SchedulerStats(2, 1, 0, 2, 0.1, running_adapters=("a", "b"), waiting_adapters=("c",))
    metrics.on_step(StepStats(True, 1.0, stats, start_s=0.5))
    body = metrics.render()[0].decode()
    infos = [line for line in body.splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert len(infos) == 1
    assert 'max_lora="8"' in infos[0] and 'running_lora_adapters="a,b"' in infos[0]
    assert 'waiting_lora_adapters="c"' in infos[0]
    metrics.on_step(StepStats(True, 2.0, SchedulerStats(0, 0, 0, 0, 0.0), start_s=1.5))
    body = metrics.render()[0].decode()
    infos = [line for line in body.splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert len(infos) == 1 and 'running_lora_adapters=""' in infos[0]  # none now
