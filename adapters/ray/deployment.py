"""The Ray Serve application of ``infer serve --replicas N``: one deployment of engine
replicas (:class:`~adapters.ray.replica.EngineReplica`, no HTTP: the ingress is the
server's own), routed by :class:`~adapters.ray.router.FleetRequestRouter`, each replica
reserving its CPUs and GPUs; what it is made of comes from the entrypoint
(:class:`EngineDeployment`), with the server's configuration as JSON and the entrypoint's
composition root that builds a replica's container from it."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from adapters.ray.ingress import ENGINE
from adapters.ray.replica import EngineReplica
from adapters.ray.router import FleetRequestRouter
from domain.routing import imbalance_for

ROUTING_STATS_PERIOD_S = 1.0
# An engine replica runs its engine on the replica's own event loop, not on a thread of its
# own (one thread hop fewer each way per call; Ray's health checks and routing-stats calls
# are answered between engine steps).
REPLICA_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}


@dataclass(frozen=True)
class EngineDeployment:
    """The engine deployment: ``replicas`` (the serving ones and the warm standbys), the
    ``cpus`` and ``gpus`` Ray reserves for each, the routing policy (``--routing``), each
    engine's ``max_num_seqs`` and ``max_waiting_requests`` (the calls a replica takes at
    once) and ``drain_timeout`` (a replica's graceful shutdown, seconds)."""

    replicas: int
    cpus: float
    gpus: float
    routing: str
    max_num_seqs: int
    max_waiting_requests: int
    drain_timeout: float


def replica_gpus(requested: float | None, device: str | None, default: str) -> float:
    """GPUs per replica: ``requested`` (``--replica-gpus``), else one where the model runs
    on CUDA (``device``: ``--device``, else ``default``: this machine's) and none on a CPU."""
    if requested is not None:
        return requested
    return 1.0 if (device or default).startswith("cuda") else 0.0


def engine_app(
    spec: EngineDeployment, config_json: bytes, build: Callable[[bytes, str, int | None], Any]
) -> Any:
    """The application: ``spec``'s engine replicas, each building its container with
    ``build(config_json, its replica id, its rank)``."""
    router: dict[str, Any] = {
        "request_router_class": FleetRequestRouter,
        "request_router_kwargs": {
            "policy": spec.routing,
            "imbalance": imbalance_for(spec.max_num_seqs),
            "capacity": spec.max_num_seqs,
        },
        "request_routing_stats_period_s": ROUTING_STATS_PERIOD_S,
        "request_routing_stats_timeout_s": 5,
    }
    engine = serve.deployment(
        EngineReplica,
        name=ENGINE,
        num_replicas=spec.replicas,
        ray_actor_options={
            "num_cpus": spec.cpus,
            "num_gpus": spec.gpus,
            "runtime_env": {"env_vars": REPLICA_ENV},
        },
        max_ongoing_requests=spec.max_num_seqs + spec.max_waiting_requests,
        health_check_period_s=2,
        health_check_timeout_s=10,
        graceful_shutdown_timeout_s=spec.drain_timeout,
        request_router_config=RequestRouterConfig(**router),
    )
    return engine.bind(config_json, build)  # type: ignore[attr-defined]
