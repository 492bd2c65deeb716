"""One /metrics for a fleet: expositions merged by family, every sample labelled with its
source; the result parses as Prometheus text (prometheus_client's own parser)."""

from prometheus_client.parser import text_string_to_metric_families

from adapters.observability.fleet_metrics import merge_expositions

REPLICA = """# HELP infer_tokens_total Tokens generated.
# TYPE infer_tokens_total counter
infer_tokens_total{model="m"} 12.0
# HELP infer_kv_usage KV pool use.
# TYPE infer_kv_usage gauge
infer_kv_usage 0.25
# HELP infer_ttft_seconds TTFT.
# TYPE infer_ttft_seconds histogram
infer_ttft_seconds_bucket{le="0.1"} 1.0
infer_ttft_seconds_bucket{le="+Inf"} 2.0
infer_ttft_seconds_count 2.0
infer_ttft_seconds_sum 0.3
"""


def test_every_sample_is_labelled_and_each_family_declared_once() -> None:
    merged = merge_expositions([("ingress", REPLICA), ("r1", REPLICA), ("r2", REPLICA)])
    assert merged.count("# TYPE infer_tokens_total counter") == 1
    assert 'infer_tokens_total{replica="r2",model="m"} 12.0' in merged
    assert 'infer_kv_usage{replica="r1"} 0.25' in merged
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    tokens = families["infer_tokens"].samples
    assert sorted(s.labels["replica"] for s in tokens) == ["ingress", "r1", "r2"]
    ttft = families["infer_ttft_seconds"].samples
    assert {s.labels["replica"] for s in ttft} == {"ingress", "r1", "r2"}
    assert len(ttft) == 3 * 4


def test_a_label_value_is_escaped() -> None:
    merged = merge_expositions([('we"ird', "x 1\n")])
    assert merged == 'x{replica="we\\"ird"} 1\n'
