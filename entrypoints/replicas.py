"""``infer serve --replicas N``: N engine replicas on Ray Serve behind this process's port.

The replicas (:mod:`adapters.ray.deployment`) each build their container here
(:func:`replica_container`: the one :class:`ServerConfig`, carried as JSON, as one
process's); the ingress (this process, a Ray driver) is the same app as one process's,
built by ``create_container(config)`` on the fleet's backend (:mod:`entrypoints.fleet_backend`)
and served by the same uvicorn. :func:`serve_replicas` starts Ray, joins the fleet's
ingresses (attaching to a fleet the cluster runs, else deploying it), serves until
SIGINT/SIGTERM and stops what it started, each step bounded (:mod:`adapters.ray.launch`).
"""

import os
import sys
from dataclasses import replace
from typing import Any

from adapters.http.replica_header import ReplicaHeader
from adapters.observability.logging import configure_logging
from adapters.ray import launch
from adapters.ray.deployment import EngineDeployment, engine_app, replica_gpus
from adapters.ray.dispatch import HandleForward
from adapters.ray.forward import TinkerForwarder
from adapters.torch.cpu.threads import set_threads
from adapters.torch.factory import default_device
from adapters.torch.lora.peft import ADAPTER_WEIGHTS
from application.engine.remote_engine import ReplicaAdapters
from application.serving.served_models import check_lora_module
from entrypoints.config import ServerConfig, from_json, to_json
from entrypoints.config.access import sighup_reloader
from entrypoints.container import Container, create_container
from entrypoints.server import serve_configured


def replica_container(config_json: bytes, replica_id: str, rank: int | None = None) -> Any:
    """An engine replica's container (:class:`~adapters.ray.replica.EngineReplica` calls
    it in its own process): the one :class:`ServerConfig` from JSON as one process's, with
    the replica's id (Tinker puts it in its ids) and rank (its KV events' port and
    ``data_parallel_rank``), without a usage ledger (the ingress records usage and holds
    the rollouts) or an embedding model (``/v1/embeddings`` is the ingress's)."""
    config = from_json(config_json)
    fleet = replace(config.fleet, replicas=0, standby_replicas=0, replica_id=replica_id)
    config = replace(
        config,
        fleet=replace(fleet, replica_rank=rank),
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


def engine_deployment(config: ServerConfig, gpus: float) -> EngineDeployment:
    """The engine deployment ``config`` asks for, each replica reserving ``gpus`` GPUs."""
    fleet, engine = config.fleet, config.engine
    return EngineDeployment(
        replicas=fleet.replicas + fleet.standby_replicas,
        cpus=fleet.replica_cpus or float(config.model.threads or 1),
        gpus=gpus,
        routing=fleet.routing,
        max_num_seqs=engine.max_num_seqs,
        max_waiting_requests=engine.max_waiting_requests,
        drain_timeout=config.http.drain_timeout,
    )


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
    launch.on_stop_signals()
    launch.start_ray(fleet.ray_address, fleet.replica_start_timeout)
    launch.on_stop_signals()
    member: launch.Membership | None = None
    try:
        launch.start_serve()
        member = launch.Membership(config.http.port)
        what = (config.model, config.engine, fleet.replicas, fleet.standby_replicas, fleet.routing)
        if member.join(what):
            _note(f"attaching to the fleet of {fleet.replicas} replicas the cluster runs")
        else:
            deploy(config)
        keys_file = config.access.api_keys_file
        ingress = create_container(
            config, on_startup=[lambda: sighup_reloader(ingress.access(), keys_file)()]
        )
        http = config.http
        url = f"{'https' if http.tls else 'http'}://{http.host}:{http.port}"
        _note(f"serving {fleet.replicas} replicas at {url}")
        serve_configured(ingress_app(ingress), config, ingress.draining())
        return 0
    except KeyboardInterrupt:
        _note("stopped during the start")
        return 130
    finally:
        last = member is None or member.leave()
        _note("stopping the replicas" if last else "leaving the replicas to the other ingresses")
        launch.stop_ray(last)


def deploy(config: ServerConfig) -> None:
    """The engine replicas, started within ``--replica-start-timeout``."""
    fleet = config.fleet
    gpus = replica_gpus(fleet.replica_gpus, config.model.device, default_device())
    gpus_note = f", {gpus:g} GPU each" if gpus else ""
    if fleet.standby_replicas:
        gpus_note += f"; {fleet.standby_replicas} more as warm standbys"
    _note(
        f"starting {fleet.replicas} engine replicas on Ray Serve "
        f"(routing: {fleet.routing}{gpus_note})"
    )
    app = engine_app(engine_deployment(config, gpus), to_json(config), replica_container)
    handle = launch.run_bounded(app, fleet.replica_start_timeout)
    if launch.STOPPED:
        raise KeyboardInterrupt
    handle.shutdown()  # its router's thread and long poll: the calls use their own


def _note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
