"""What the composition root builds from the observability adapters: the metrics and the
traces (each None when its flag turns it off), and what the rest of the server takes from
them (the step observer, the training observer, hooks), so that no other builder asks
whether they are on."""

from collections.abc import Callable, Sequence
from typing import Any

from adapters.observability.kv_events import ZmqKVEventPublisher
from adapters.observability.metrics import Metrics
from adapters.observability.settings import ObservabilitySettings
from adapters.observability.timeline import EngineTimeline
from adapters.observability.tracing import Tracing, build_tracer_provider
from application.engine.observers import ObserverGroup, TrainingObserverGroup
from domain.config import EngineConfig
from domain.kv_events import KVEventsConfig
from domain.observer import NullObserver, StepObserver, TrainingObserver


def build_metrics(
    settings: ObservabilitySettings,
    names: Sequence[str],
    engine: EngineConfig,
    kv_cache_bytes: int,
    max_loras: int = 16,
) -> Metrics | None:
    """Prometheus metrics labelled with the served name (None: ``--disable-metrics``);
    ``max_loras``: ``--max-loras``, for vLLM's LoRA gauge."""
    if not settings.metrics:
        return None
    return Metrics(
        names[0],
        max_num_seqs=engine.max_num_seqs,
        kv_cache_bytes=kv_cache_bytes,
        max_tenants=settings.max_tenant_labels,
        max_loras=max_loras,
    )


def build_tracing(settings: ObservabilitySettings, names: Sequence[str]) -> Tracing | None:
    """OpenTelemetry spans (None: no endpoint and no console)."""
    if not settings.tracing.enabled:
        return None
    return Tracing(build_tracer_provider(settings.tracing), names[0])


def build_timeline(console: bool) -> EngineTimeline | None:
    """The engine's last minutes, per second, for the web console (None: ``--no-ui``)."""
    return EngineTimeline() if console else None


def step_observer(
    metrics: Metrics | None,
    tracing: Tracing | None,
    timeline: EngineTimeline | None = None,
    kv_events: ZmqKVEventPublisher | None = None,
) -> StepObserver:
    """Every engine step's statistics to the metrics, the traces, the console's timeline
    and the KV events' publisher that are on."""
    found = (metrics, tracing, timeline, kv_events)
    observers: list[StepObserver] = [o for o in found if o is not None]
    if not observers:
        return NullObserver()
    return observers[0] if len(observers) == 1 else ObserverGroup(observers)


def training_observer(metrics: Metrics | None, tracing: Tracing | None) -> TrainingObserver | None:
    """Every Tinker operation to the metrics and the traces that are on (None: neither)."""
    observers: list[TrainingObserver] = [o for o in (metrics, tracing) if o is not None]
    return TrainingObserverGroup(observers) if observers else None


def metrics_render(metrics: Metrics | None) -> Callable[[], tuple[bytes, str]] | None:
    """``GET /metrics``' body (None: no such route)."""
    return metrics.render if metrics is not None else None


def on_rate_limited(metrics: Metrics | None) -> Callable[[str | None, str], None] | None:
    """What counts a request the quotas refused."""
    return metrics.rate_limited if metrics is not None else None


def pending_futures_gauge(
    metrics: Metrics | None,
) -> Callable[[Callable[[], int]], None] | None:
    """What reports Tinker's pending futures at every scrape."""
    return metrics.track_pending_futures if metrics is not None else None


def usage_gauges(metrics: Metrics | None) -> Callable[[Any], None] | None:
    """What reports the usage recorder's queue, drops and failed writes at every scrape."""
    return metrics.track_usage if metrics is not None else None


def shutdown_hooks(
    tracing: Tracing | None, kv_events: ZmqKVEventPublisher | None = None
) -> tuple[Callable[[], None], ...]:
    """Run as the app stops: the last spans flushed, the KV events' socket closed."""
    hooks = [tracing.shutdown] if tracing is not None else []
    if kv_events is not None:
        hooks.append(kv_events.close)
    return tuple(hooks)


def build_kv_events(
    config: KVEventsConfig | None, rank: int | None = None
) -> ZmqKVEventPublisher | None:
    """The KV events' publisher of ``--kv-events-config`` (None: off, or recorded for no
    one: publisher ``null``); ``rank``: a fleet's replica's (its port, its batches' rank)."""
    if config is None or not config.recording or config.publisher != "zmq":
        return None
    return ZmqKVEventPublisher(config, rank=rank)
