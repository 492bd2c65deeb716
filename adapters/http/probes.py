"""The probes: ``/health`` (the engine loop runs), ``/ready`` (and the server is not
draining: a load balancer sends traffic), ``/health/generate`` (a short greedy generation
runs: prefill and decode, on the base model or one served model, timed) and, when served,
``/metrics`` (Prometheus). Open, like every probe: no key."""

import json
from collections.abc import Callable
from typing import Any

from litestar import Controller, Request, Response, Router, get
from litestar.di import NamedDependency

from adapters.http.ownership import Draining
from adapters.http.request_state import provide
from application.engine.engine_client import EngineClient
from application.engine.generation_probe import GenerationProbe
from application.serving.served_models import ServedModels
from domain.errors import ModelNotFoundError

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


class GenerationProbeRoutes(Controller):
    @get("/health/generate")
    async def generate(
        self,
        request: Request[Any, Any, Any],
        probe: NamedDependency[GenerationProbe],
        models: NamedDependency[ServedModels],
    ) -> Response[bytes]:
        """200 with the probe's times, 503 with why it failed, 404 for an unknown model or
        a rollout's name (probe its targets, each a model)."""
        name = request.query_params.get("model")
        try:
            entry = models.resolve(name)
        except ModelNotFoundError as e:
            return _json(json.dumps({"status": "unknown model", "error": str(e)}).encode(), 404)
        if entry.rollout is not None:
            error = f"{name!r} is a rollout: probe each of its models by name"
            return _json(json.dumps({"status": "unknown model", "error": error}).encode(), 404)
        with models.use(entry):
            result = await probe.run(entry.adapter_id)
        body = {
            "status": "ok" if result.ok else "failed",
            "model": entry.id,
            "tokens": result.tokens,
            "ttft_ms": result.ttft_ms,
            "tpot_ms": result.tpot_ms,
        }
        if result.error is not None:
            body["error"] = result.error
        return _json(json.dumps(body).encode(), 200 if result.ok else 503)


class MetricsRoutes(Controller):
    @get("/metrics", include_in_schema=False)
    async def metrics(self, metrics: Metrics) -> Response[bytes]:
        body, content_type = metrics()
        return Response(body, media_type=content_type)


def probe_router(
    engine: EngineClient,
    draining: Draining,
    metrics: Callable[[], tuple[bytes, str]] | None = None,
    *,
    models: ServedModels | None = None,
) -> Router:
    """``metrics``: what ``/metrics`` answers, the exposition and its content type (None:
    no ``/metrics``); ``models``: the served models ``/health/generate`` may probe (None:
    no generation probe)."""
    handlers: list[type[Controller]] = [ProbeRoutes]
    if models is not None:
        handlers.append(GenerationProbeRoutes)
    if metrics is not None:
        handlers.append(MetricsRoutes)
    return Router(
        path="/",
        route_handlers=handlers,
        dependencies=provide(
            {
                "healthy": lambda: engine.healthy,
                "draining": draining,
                "metrics": metrics,
                "models": models,
                "probe": GenerationProbe(engine),
            }
        ),
    )


def _json(body: bytes, status: int) -> Response[bytes]:
    return Response(body, status_code=status, media_type="application/json")
