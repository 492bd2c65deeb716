"""``infer serve --replicas N``: N engine replicas on Ray Serve behind this process's port.

- **engine** (:class:`~adapters.ray.replica.EngineReplica`, a Ray Serve deployment of N
  replicas): each builds its container here (:func:`replica_container`, from the one
  :class:`ServerConfig` carried as JSON) and runs its engine on the replica's own event
  loop; its load goes to the registry (:mod:`adapters.ray.registry`) and the router.
- **ingress** (this process, a Ray driver): the same Litestar app as one process (auth,
  limits, parsing, chat rendering, tokenizing), served by the same uvicorn with every HTTP
  flag (Ray Serve's proxy is off), built by ``create_container(config)`` as one process's
  is: ``--replicas`` chooses the fleet's backend (:mod:`entrypoints.fleet_backend`: the
  tokenizer, not the model; a :class:`RemoteEngine` whose calls go through the engine
  deployment's handle, routed by :class:`FleetRequestRouter` (``--routing``) on the
  server's event loop; the fleet's registry for ``/admin/replicas`` and ``/metrics``).

``serve_replicas`` starts Ray (a local cluster, or ``--ray-address``'s), the replicas, then
serves until SIGINT/SIGTERM (drained as one process is), then stops what it started. A
cluster that cannot be reached, or replicas that do not start within
``--replica-start-timeout``, is an error naming the flag, and nothing is left running.
"""

import contextlib
import os
import signal
import sys
import threading
import time
from dataclasses import replace
from typing import Any

import ray
import structlog
from ray import serve
from ray._private import auto_init_hook
from ray.serve.config import ProxyLocation, RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from adapters.http.replica_header import ReplicaHeader
from adapters.observability.logging import configure_logging
from adapters.ray.dispatch import HandleForward
from adapters.ray.forward import TinkerForwarder
from adapters.ray.ingress import APP_NAME, ENGINE
from adapters.ray.registry import REGISTRY_NAME, FleetRegistry
from adapters.ray.replica import EngineReplica
from adapters.ray.router import FleetRequestRouter
from adapters.torch.cpu.threads import set_threads
from adapters.torch.factory import default_device
from adapters.torch.lora.peft import ADAPTER_WEIGHTS
from application.engine.remote_engine import ReplicaAdapters
from application.serving.served_models import check_lora_module
from domain.errors import InvalidParameterError
from domain.routing import imbalance_for
from entrypoints.config import ServerConfig, from_json, to_json
from entrypoints.config.access import sighup_reloader
from entrypoints.container import Container, create_container
from entrypoints.server import serve_configured

log = structlog.get_logger(__name__)

ROUTING_STATS_PERIOD_S = 1.0
# An engine replica runs its engine on the replica's own event loop, not on a thread of its
# own (one thread hop fewer each way per call; Ray's health checks and routing-stats calls
# are answered between engine steps).
REPLICA_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}


def replica_container(config_json: bytes, replica_id: str) -> Any:
    """An engine replica's container (:class:`~adapters.ray.replica.EngineReplica` calls
    it in its own process): the one :class:`ServerConfig` from JSON as one process's, with
    the replica's id (Tinker puts it in its ids), without a usage ledger (the ingress
    records usage and holds the rollouts) or an embedding model (``/v1/embeddings`` is the
    ingress's); its logging and threads set."""
    config = from_json(config_json)
    config = replace(
        config,
        fleet=replace(config.fleet, replicas=0, standby_replicas=0, replica_id=replica_id),
        access=replace(config.access, usage_db=None),
        embeddings=replace(config.embeddings, embedding_model=None),
    )
    configure_logging(config.observability.log_level, config.observability.log_format)
    set_threads(config.model.threads)
    return create_container(config)


def ingress_app(container: Container) -> Any:
    """The ingress's ASGI app: the server's own (on the fleet's backend), with the replica
    header and, with Tinker, its calls forwarded to the replica their ids name."""
    app: Any = ReplicaHeader(container.http_app())
    if container.config().tinker.enabled:
        app = TinkerForwarder(app, HandleForward(container.backend.handles()))
    return app


def replica_gpus(config: ServerConfig, device: str) -> float:
    """GPUs per replica: ``--replica-gpus``, else one where the model runs on CUDA
    (``--device``, else ``device``: this machine's default) and none on a CPU."""
    if config.fleet.replica_gpus is not None:
        return config.fleet.replica_gpus
    return 1.0 if (config.model.device or device).startswith("cuda") else 0.0


def deployments(config: ServerConfig, gpus: float = 0.0) -> Any:
    """The application: ``replicas`` engine replicas (no HTTP: the ingress is ours), each
    reserving ``gpus`` GPUs."""
    fleet = config.fleet
    cpus = fleet.replica_cpus or float(config.model.threads or 1)
    config_json = to_json(config)
    router: dict[str, Any] = {
        "request_router_class": FleetRequestRouter,
        "request_router_kwargs": {
            "policy": fleet.routing,
            "imbalance": imbalance_for(config.engine.max_num_seqs),
            "capacity": config.engine.max_num_seqs,
        },
        "request_routing_stats_period_s": ROUTING_STATS_PERIOD_S,
        "request_routing_stats_timeout_s": 5,
    }
    engine = serve.deployment(
        EngineReplica,
        name=ENGINE,
        num_replicas=fleet.replicas + fleet.standby_replicas,
        ray_actor_options={
            "num_cpus": cpus,
            "num_gpus": gpus,
            "runtime_env": {"env_vars": REPLICA_ENV},
        },
        max_ongoing_requests=config.engine.max_num_seqs + config.engine.max_waiting_requests,
        health_check_period_s=2,
        health_check_timeout_s=10,
        graceful_shutdown_timeout_s=config.http.drain_timeout,
        request_router_config=RequestRouterConfig(**router),
    )
    return engine.bind(config_json, replica_container)  # type: ignore[attr-defined]


def serve_replicas(config: ServerConfig) -> int:
    """Run the fleet until SIGINT/SIGTERM (see the module)."""
    fleet = config.fleet
    if config.model.lora_modules:  # a bad folder fails the start before any replica starts
        for module in config.model.lora_modules:
            check_lora_module(module, ReplicaAdapters(ADAPTER_WEIGHTS))
    if config.model.threads is None and fleet.ray_address is None:
        # One machine: its cores shared between the replicas.
        threads = max(1, (os.cpu_count() or 1) // fleet.replicas)
        config = replace(config, model=replace(config.model, threads=threads))
    _on_stop_signals()
    _start_ray(fleet.ray_address, fleet.replica_start_timeout)
    _on_stop_signals()
    try:
        registry = FleetRegistry.options(name=REGISTRY_NAME).remote()  # type: ignore[attr-defined]
        serve.start(proxy_location=ProxyLocation.Disabled)  # the HTTP port is ours
        gpus = replica_gpus(config, default_device())
        gpus_note = f", {gpus:g} GPU each" if gpus else ""
        if fleet.standby_replicas:
            gpus_note += f"; {fleet.standby_replicas} more as warm standbys"
        _note(
            f"starting {fleet.replicas} engine replicas on Ray Serve "
            f"(routing: {fleet.routing}{gpus_note})"
        )
        handle = _run_bounded(deployments(config, gpus), fleet.replica_start_timeout)
        if _STOPPED:
            raise KeyboardInterrupt
        handle.shutdown()  # its router's thread and long poll: the calls use their own
        keys_file = config.access.api_keys_file
        ingress = create_container(
            config, on_startup=[lambda: sighup_reloader(ingress.access(), keys_file)()]
        )
        http = config.http
        url = f"{'https' if http.tls else 'http'}://{http.host}:{http.port}"
        _note(f"serving {fleet.replicas} replicas at {url}")
        serve_configured(ingress_app(ingress), config, ingress.draining())
        _note("stopping the replicas")
        del registry
        return 0
    except KeyboardInterrupt:
        _note("stopped during the start")
        return 130
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        # A handle's long poll answered during the shutdown must not start Ray again: that
        # waits on the lock ray.shutdown holds while it waits for that callback (a hang).
        auto_init_hook.enable_auto_connect = False
        ray.shutdown()


def _start_ray(address: str | None, timeout_s: float) -> None:
    try:
        if address is None:
            ray.init(include_dashboard=False, log_to_driver=True, configure_logging=False)
        else:
            _within(timeout_s, "ray_address", lambda: ray.init(address=address))
    except ConnectionError as e:
        raise InvalidParameterError("ray_address", f"no Ray cluster reached: {e}") from e


def _run_bounded(app: Any, timeout_s: float) -> DeploymentHandle:
    handles: list[DeploymentHandle] = []
    _within(
        timeout_s,
        "replica_start_timeout",
        lambda: handles.append(serve.run(app, name=APP_NAME, route_prefix=None, blocking=False)),
        what="the replicas did not start (a cluster short of CPUs for --replicas?)",
    )
    return handles[0]


def _within(timeout_s: float, flag: str, work: Any, what: str = "no answer") -> None:
    """Run ``work`` on a thread; past ``timeout_s`` it is an error naming ``flag``."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as e:  # reported on the caller's thread
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True, name=f"ray-{flag}")
    thread.start()
    deadline = time.monotonic() + timeout_s
    while thread.is_alive() and time.monotonic() < deadline and not _STOPPED:
        thread.join(0.2)
    if _STOPPED:
        raise KeyboardInterrupt  # stopped during the start: clean up what started
    if thread.is_alive():
        raise InvalidParameterError(flag, f"{what} within {timeout_s:g} s")
    if errors:
        raise errors[0]


_STOPPED: list[int] = []  # signals received (a flag: a handler must take no lock)


def _on_stop_signals() -> None:
    """SIGINT/SIGTERM set the flag from now on (again after ray.init, which sets its own)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _: _STOPPED.append(signum))


def _note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
