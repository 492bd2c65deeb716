"""``infer serve --replicas N``: N engine replicas on Ray Serve behind this process's port.

- **engine** (:class:`~adapters.ray.replica.EngineReplica`, a Ray Serve deployment of N
  replicas): each builds its container here (:func:`replica_container`, from the one
  :class:`ServerConfig` carried as JSON) and runs its engine on the replica's own event
  loop; its load goes to the registry (:mod:`adapters.ray.registry`) and the router.
- **ingress** (:class:`FleetIngress`, this process, a Ray driver): the same Litestar app
  as one process (auth, limits, parsing, chat rendering, tokenizing), served by the same
  uvicorn with every HTTP flag (Ray Serve's proxy is off), built by the same container
  with the engine replaced by a :class:`RemoteEngine` whose calls go through the engine
  deployment's handle, routed by :class:`FleetRequestRouter` (``--routing``) on the
  server's event loop. It loads the tokenizer, not the model (:class:`RemoteBackend`).

``serve_replicas`` starts Ray (a local cluster, or ``--ray-address``'s), the replicas, then
serves until SIGINT/SIGTERM (drained as one process is), then stops what it started. A
cluster that cannot be reached, or replicas that do not start within
``--replica-start-timeout``, is an error naming the flag, and nothing is left running.
"""

import asyncio
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import ray
import structlog
from dependency_injector import providers
from ray import serve
from ray._private import auto_init_hook
from ray.serve.config import ProxyLocation, RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from adapters.http.replica_header import ReplicaHeader
from adapters.observability.fleet_metrics import merge_expositions
from adapters.observability.logging import configure_logging
from adapters.ray.dispatch import HandleDispatch, HandleForward, loop_handle
from adapters.ray.forward import (
    TinkerForwarder,
)
from adapters.ray.registry import REGISTRY_NAME, REPORT_EVERY_S, FleetRegistry
from adapters.ray.replica import EngineReplica
from adapters.ray.router import FleetRequestRouter
from adapters.storage.factory import checkpoint_storage
from adapters.torch.cpu.threads import set_threads
from adapters.torch.lora.peft import ADAPTER_WEIGHTS
from application.engine.remote_engine import RemoteEngine, ReplicaAdapters
from application.serving.served_models import SharedCheckpoints, check_lora_module
from application.tinker.checkpoints import CheckpointStore
from domain.errors import InvalidParameterError
from domain.routing import imbalance_for
from entrypoints.backends import RemoteBackend
from entrypoints.config import ServerConfig, from_json, to_json
from entrypoints.config.access import sighup_reloader
from entrypoints.container import create_container
from entrypoints.server import serve_configured

log = structlog.get_logger(__name__)

APP_NAME = "infer"
ROUTING_STATS_PERIOD_S = 1.0
# An engine replica runs its engine on the replica's own event loop, not on a thread of its
# own (one thread hop fewer each way per call; Ray's health checks and routing-stats calls
# are answered between engine steps).
REPLICA_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}


def replica_container(config_json: bytes, replica_id: str) -> Any:
    """An engine replica's container (:class:`~adapters.ray.replica.EngineReplica` calls
    it in its own process): the one :class:`ServerConfig` from JSON, without a usage
    ledger (the ingress records usage and holds the rollouts), its logging and threads
    set; Tinker's ids carry ``replica_id``; no embedding model (``/v1/embeddings`` is the
    ingress's)."""
    config = from_json(config_json)
    config = replace(config, access=replace(config.access, usage_db=None))
    configure_logging(config.observability.log_level, config.observability.log_format)
    set_threads(config.model.threads)
    container = create_container(config)
    container.tinker_id_tag.override(providers.Object(replica_id))
    container.backend.embeddings.override(providers.Object(None))
    return container


class FleetIngress:
    """The HTTP face of the fleet, in the ``infer serve`` process (see the module)."""

    def __init__(self, config: ServerConfig, engine: DeploymentHandle) -> None:
        described = engine.describe.remote().result(timeout_s=config.fleet.replica_start_timeout)
        engine.shutdown()  # its router's thread and long poll: the calls use their own
        # The calls' handle routes on the server's event loop (made there, at the first call).
        handles = loop_handle("engine", APP_NAME)
        self.handles = handles
        # Tinker runs on the replicas (calls forwarded there): the ingress loads no model.
        self.tinker = config.tinker.enabled
        self.config = replace(config, tinker=replace(config.tinker, enabled=False))
        self.registry = ray.get_actor(REGISTRY_NAME)
        self._expositions: list[tuple[str, str]] = []
        self.container = ingress_container(
            self.config, described, on_startup=[self._started], tinker=self.tinker
        )
        self.remote = RemoteEngine(
            described["engine_config"],
            self.container.backend.tokenizer(),
            HandleDispatch(handles),
            replicas=config.fleet.replicas,
            vocab_size=described["vocab_size"],
            grammar=self.container.backend.grammar(),
            adapters=self.container.backend.lora_serving(),
        )
        self.container.async_engine.override(providers.Object(self.remote))
        self.container.replicas.override(providers.Object(self.replicas))
        self._own = self.container.metrics()
        if self._own is not None:  # /metrics: the ingress's and every replica's, labelled
            own = self._own
            self.container.metrics_exposition.override(
                providers.Object(lambda: self._fleet_metrics(own.render()))
            )

    def _started(self) -> None:
        """On the server's event loop, at start: SIGHUP reloads the keys file; poll the
        replicas' expositions."""
        sighup_reloader(self.container.access(), self.config.access.api_keys_file)()
        if self._own is not None:
            self._poller = asyncio.get_running_loop().create_task(self._poll_metrics())

    async def _poll_metrics(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                self._expositions = await self.registry.expositions.remote()
            await asyncio.sleep(REPORT_EVERY_S)

    def _fleet_metrics(self, own: tuple[bytes, str]) -> tuple[bytes, str]:
        merged = merge_expositions([("ingress", own[0].decode()), *self._expositions])
        return merged.encode(), own[1]

    async def replicas(self) -> list[dict[str, Any]]:
        return list(await self.registry.snapshot.remote())

    def app(self) -> Any:
        """The ASGI app: the server's own, with the replica header and, with Tinker, its
        calls forwarded to the replica their ids name."""
        app: Any = ReplicaHeader(self.container.http_app())
        if self.tinker:
            app = TinkerForwarder(app, HandleForward(self.handles))
        return app


def ingress_container(
    config: ServerConfig,
    described: dict[str, Any],
    on_startup: Sequence[Callable[[], None]] = (),
    *,
    tinker: bool = False,
) -> Any:
    """The server's container on a :class:`RemoteBackend` (no model: what a replica
    measured, ``described``, stands in for it). ``tinker``: the replicas run the Tinker API
    (its checkpoints served by path here too, from the shared ``--checkpoint-dir``)."""
    backend = RemoteBackend(described=providers.Object(described))
    container = create_container(config, backend=backend, on_startup=on_startup)
    if tinker:
        store = CheckpointStore(checkpoint_storage(config.tinker.checkpoint_dir))
        container.tinker_checkpoints.override(providers.Object(SharedCheckpoints(store)))
    return container


def deployments(config: ServerConfig) -> Any:
    """The application: ``replicas`` engine replicas (no HTTP: the ingress is ours)."""
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
        name="engine",
        num_replicas=fleet.replicas,
        ray_actor_options={"num_cpus": cpus, "runtime_env": {"env_vars": REPLICA_ENV}},
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
        _note(f"starting {fleet.replicas} engine replicas on Ray Serve (routing: {fleet.routing})")
        handle = _run_bounded(deployments(config), fleet.replica_start_timeout)
        if _STOPPED:
            raise KeyboardInterrupt
        ingress = FleetIngress(config, handle)
        http = config.http
        url = f"{'https' if http.tls else 'http'}://{http.host}:{http.port}"
        _note(f"serving {fleet.replicas} replicas at {url}")
        serve_configured(ingress.app(), config, ingress.container.draining())
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
