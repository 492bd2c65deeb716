"""What the observability adapters do, as ``infer serve``'s flags set it."""

from dataclasses import dataclass, field

from adapters.observability.tracing import TracingSettings


@dataclass(frozen=True, slots=True)
class ObservabilitySettings:
    """``metrics``: serve ``/metrics``; ``tracing``: where spans go (off unless an
    endpoint or the console is set); ``log_requests``: one canonical log line per API
    request; ``max_tenant_labels``: distinct tenant label values in metrics (later tenants
    are counted as ``other``); ``log_level``, ``log_format``: the process's log lines
    (:func:`adapters.observability.logging.configure_logging`); ``uvicorn_access_log``:
    uvicorn's line per request too."""

    metrics: bool = True
    tracing: TracingSettings = field(default_factory=TracingSettings)
    log_requests: bool = True
    max_tenant_labels: int = 100
    log_level: str = "info"
    log_format: str = "auto"
    uvicorn_access_log: bool = True
