"""What the observability adapters do, as ``infer serve``'s flags set it."""

from dataclasses import dataclass, field

from adapters.observability.tracing import TracingSettings


@dataclass(frozen=True, slots=True)
class ObservabilitySettings:
    """``metrics``: serve ``/metrics``; ``tracing``: where spans go (off unless an
    endpoint or the console is set); ``log_requests``: one canonical log line per API
    request; ``max_tenant_labels``: distinct tenant label values in metrics (later tenants
    are counted as ``other``)."""

    metrics: bool = True
    tracing: TracingSettings = field(default_factory=TracingSettings)
    log_requests: bool = True
    max_tenant_labels: int = 100
