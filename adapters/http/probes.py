"""The probes: ``/health`` (the engine loop runs), ``/ready`` (and the server is not
draining: a load balancer sends traffic) and, when served, ``/metrics`` (Prometheus)."""

from collections.abc import Callable

from litestar import Controller, Response, Router, get
from litestar.di import NamedDependency

from adapters.http.ownership import Draining
from adapters.http.request_state import provide
from application.engine_client import EngineClient

# Whether the engine loop runs (a protocol is no dependency type: Litestar checks values).
Healthy = NamedDependency[Callable[[], bool]]
Metrics = NamedDependency[Callable[[], tuple[bytes, str]]]


class ProbeRoutes(Controller):
    @get("/health")
    async def health(self, healthy: Healthy) -> Response[bytes]:
        if healthy():
            return _json(b'{"status":"ok"}', 200)
        return _json(b'{"status":"engine loop down"}', 503)

    @get("/ready")
    async def ready(self, healthy: Healthy, draining: NamedDependency[Draining]) -> Response[bytes]:
        if healthy() and not draining.active:
            return _json(b'{"ready":true}', 200)
        return _json(b'{"ready":false}', 503)


class MetricsRoutes(Controller):
    @get("/metrics", include_in_schema=False)
    async def metrics(self, metrics: Metrics) -> Response[bytes]:
        body, content_type = metrics()
        return Response(body, media_type=content_type)


def probe_router(
    engine: EngineClient,
    draining: Draining,
    metrics: Callable[[], tuple[bytes, str]] | None = None,
) -> Router:
    """``metrics``: what ``/metrics`` answers, the exposition and its content type (None:
    no ``/metrics``)."""
    return Router(
        path="/",
        route_handlers=[ProbeRoutes, *([] if metrics is None else [MetricsRoutes])],
        dependencies=provide(
            {"healthy": lambda: engine.healthy, "draining": draining, "metrics": metrics}
        ),
    )


def _json(body: bytes, status: int) -> Response[bytes]:
    return Response(body, status_code=status, media_type="application/json")
