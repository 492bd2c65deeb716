"""Composition root: which adapters implement which ports, wired from one
:class:`~entrypoints.config.ServerConfig` by ``create_container(config)``.

What changes with what runs the model comes in two sub-containers, each chosen once
(:mod:`entrypoints.backends`, where their shapes are listed): ``backend`` from
``config.model.runner`` (:class:`TorchBackend` loads the model, :class:`FakeBackend`
loads nothing) and ``training`` from ``config.tinker.training_backend``
(:class:`LoraTraining`, :class:`ToyTraining`). Everything else is the same for every
backend and is declared here; what each provider calls is an adapter's factory
(``adapters/*/factory.py``) or a constructor.

Tests hand ``create_container`` a backend of their own (``backend=FakeBackend(runner=...)``,
``tests/fakes.fake_container``) or override a provider (``container.observer`` for a step
observer). Nothing is built until asked for: ``container.http_app()`` builds the server,
``container.async_engine()`` the engine alone, ``container.backend.model()`` the model.
"""

from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dependency_injector import containers, providers

from adapters.hf_tokenizer.factory import choose_tool_parser
from adapters.http import HttpServices, HttpSettings, create_app
from adapters.http.ownership import Draining
from adapters.observability.factory import (
    build_kv_events,
    build_metrics,
    build_timeline,
    build_tracing,
    metrics_render,
    on_rate_limited,
    pending_futures_gauge,
    shutdown_hooks,
    step_observer,
    training_observer,
    usage_gauges,
)
from adapters.observability.fleet_metrics import merge_expositions
from adapters.observability.http import ObservedApp
from adapters.observability.metrics import Metrics
from adapters.observability.settings import ObservabilitySettings
from adapters.observability.tracing import Tracing
from adapters.storage.factory import (
    build_adapter_book,
    build_audit,
    build_idempotency,
    build_response_store,
    build_rollout_book,
    build_tenant_admin,
    build_usage_recorder,
    checkpoint_storage,
)
from adapters.storage.rate_limits import LimitsCounters
from adapters.weights import ResolvedModel
from adapters.weights.generation_config import generation_defaults
from application.access.access import Access
from application.access.audit import Audit
from application.engine.async_engine import AsyncEngine
from application.engine.remote_engine import RemoteEngine
from application.serving.reasoning import parser_for
from application.serving.served_models import ServedModels
from application.tinker.service import tinker_service
from domain.breaker import CLOSED, Transition
from domain.scheduler import TenantShares, make_scheduler
from entrypoints.backends import BACKENDS, TRAININGS
from entrypoints.config import ServerConfig
from entrypoints.config.access import AccessSettings
from entrypoints.config.generation import GenerationSettings

if TYPE_CHECKING:
    from adapters.ray.ingress import FleetView

Hook = Callable[[], None]
Exposition = Callable[[], tuple[bytes, str]]


def build_http_app(
    engine: AsyncEngine,
    names: list[str],
    services: HttpServices,
    settings: HttpSettings,
    observability: ObservabilitySettings,
    metrics: Metrics | None,
    tracing: Tracing | None,
) -> ObservedApp:
    """The Litestar app inside the observing middleware (request ids, server spans,
    request metrics, the canonical log line)."""
    app = create_app(engine, names[0], services, settings)
    return ObservedApp(
        app, tracing=tracing, metrics=metrics, log_requests=observability.log_requests
    )


def _first(*values: object) -> object:
    return next((value for value in values if value is not None), None)


def fleet_exposition(own: Exposition | None, fleet: "FleetView | None") -> Exposition | None:
    """``/metrics``' body: this process's exposition, and with a fleet every replica's,
    each sample labelled by ``replica`` (None: metrics off)."""
    if own is None or fleet is None:
        return own
    render = own

    def merged() -> tuple[bytes, str]:
        body, content_type = render()
        text = merge_expositions([("ingress", body.decode()), *fleet.expositions()])
        return text.encode(), content_type

    return merged


def _path_of(resolved: ResolvedModel | None) -> Path | None:
    return resolved.path if resolved is not None else None


def fleet_replicas(
    fleet: "FleetView | None", engine: object
) -> Callable[[], Awaitable[list[dict[str, Any]]]] | None:
    """``/admin/replicas``' list: the registry's, each with its circuit breaker's state."""
    if fleet is None:
        return None
    breakers = getattr(engine, "breakers", None)
    avoided = getattr(engine, "avoided", None)
    view = fleet

    async def listed() -> list[dict[str, Any]]:
        rows = await view.replicas()
        states = breakers.states() if breakers is not None else {}
        # The warm standbys: left out of routing, and not for an open breaker.
        idle = avoided() - breakers.avoided() if avoided and breakers else frozenset()
        return [
            {
                **row,
                "breaker": states.get(row["id"], CLOSED),
                "role": "standby" if row["id"] in idle else "serving",
            }
            for row in rows
        ]

    return listed


def breaker_listener(audit: Audit, metrics: Metrics | None) -> Callable[[Transition], None]:
    """A replica's circuit breaker opened or closed: an audit line, and the gauge."""

    def told(transition: Transition) -> None:
        audit.record(
            f"replica circuit breaker {transition.state}",
            actor="automatic",
            subject=f"replica:{transition.replica_id}",
            warning=transition.state != CLOSED,
            reason=transition.reason,
        )
        if metrics is not None:
            metrics.breaker(transition.replica_id, transition.state)

    return told


def startup_hooks(given: tuple[Hook, ...], fleet: "FleetView | None") -> tuple[Hook, ...]:
    """The caller's hooks (the CLI's SIGHUP handler), and a fleet's poll of its replicas."""
    return given if fleet is None else (*given, fleet.start)


def _is_none(value: object) -> bool:
    return value is None


class Container(containers.DeclarativeContainer):
    """The server's providers; :func:`create_container` builds one."""

    config = providers.Object(ServerConfig())
    # Hooks run on the server's event loop at start (not configuration: code).
    on_startup = providers.Object(())
    # What runs the model, and what trains for Tinker (entrypoints/backends.py).
    backend = providers.DependenciesContainer()
    training = providers.DependenciesContainer()

    # Metrics and traces (None when off); every step's statistics go to the observer
    # (both of them, or a test's override).
    metrics = providers.Singleton(
        build_metrics,
        config.provided.observability,
        backend.served_names,
        backend.engine_config,
        backend.kv_cache_bytes,
        config.provided.model.max_loras,
    )
    tracing = providers.Singleton(
        build_tracing, config.provided.observability, backend.served_names
    )
    # The web console's per-second view of the steps (None: --no-ui).
    timeline = providers.Singleton(build_timeline, config.provided.http.ui)
    # vLLM's KV cache events on ZeroMQ (--kv-events-config; None: off), published where the
    # engine steps: one process, or each of a fleet's replicas (its rank: its port), never
    # a fleet's ingress.
    kv_events = providers.Selector(
        backend.engine_kind,
        local=providers.Singleton(
            build_kv_events,
            backend.engine_config.provided.kv_events_config,
            config.provided.fleet.replica_rank,
        ),
        fleet=providers.Object(None),
    )
    observer = providers.Singleton(step_observer, metrics, tracing, timeline, kv_events)

    # The engine, on the backend's runner and tokenizer. Its scheduler queues tenants by
    # the weights that access sets from the keyring (the tenants' shares).
    tenant_shares = providers.Singleton(TenantShares)
    scheduler = providers.Singleton(
        make_scheduler,
        backend.engine_config,
        backend.tokenizer.provided.eos_token_ids,
        shares=tenant_shares,
    )
    # API keys -> tenants (None: an open server), read from the keys file once; the
    # quotas' counters in Redis with --redis-url, else in memory.
    keyring = providers.Singleton(AccessSettings.keyring, config.provided.access)
    access = providers.Singleton(
        Access.for_keyring,
        keyring,
        providers.Factory(LimitsCounters, config.provided.access.redis_url).provider,
        on_refused=providers.Callable(on_rate_limited, metrics),
        on_tenants=tenant_shares.provided.set_tenants,
    )
    # What admins changed (and a fleet's breakers), kept in the usage database (None:
    # memory) and logged.
    audit = providers.Singleton(build_audit, config.provided.access.usage_db, access)

    # A fleet's ingress (backend.engine_kind "fleet") has a remote engine over the
    # backend's dispatch to the replicas, with their circuit breakers.
    async_engine = providers.Selector(
        backend.engine_kind,
        local=providers.Singleton(
            AsyncEngine,
            backend.engine_config,
            backend.runner,
            backend.tokenizer,
            vocab_size=backend.vocab_size,
            observer=observer,
            grammar=backend.grammar,
            scheduler=scheduler,
            draft=backend.draft_runner,
            step_costs=backend.step_costs,
        ),
        fleet=providers.Singleton(
            RemoteEngine,
            backend.engine_config,
            backend.tokenizer,
            backend.dispatch,
            replicas=config.provided.fleet.replicas,
            vocab_size=backend.vocab_size,
            grammar=backend.grammar,
            adapters=backend.lora_serving,
            breakers=backend.breakers,
            on_breaker=providers.Callable(breaker_listener, audit, metrics),
            joined=backend.joined,
        ),
    )
    engine = async_engine.provided.engine
    sink = async_engine.provided.sink

    # The Tinker API (None unless enabled, and on a fleet's ingress: its replicas run it):
    # the training sub-container trains and samples. A fleet's replica puts its id in the
    # ids of its sessions and futures.
    tinker = providers.Singleton(
        tinker_service,
        backend.tinker_enabled,
        config.provided.tinker.limits,
        training.backend.provider,
        training.sampler.provider,
        providers.Factory(checkpoint_storage, config.provided.tinker.checkpoint_dir).provider,
        providers.Singleton(training_observer, metrics, tracing),
        providers.Callable(pending_futures_gauge, metrics),
        config.provided.fleet.replica_id,
    )
    idempotency = providers.Singleton(
        build_idempotency,
        config.provided.access.idempotency_ttl,
        config.provided.access.redis_url,
        config.provided.access.idempotency_max_keys,
    )
    # Finished /v1/responses responses (None: --responses-ttl 0), in Redis or memory.
    response_store = providers.Singleton(
        build_response_store,
        config.provided.access.responses_ttl,
        config.provided.access.redis_url,
        config.provided.access.responses_max_stored,
    )
    # Tenants and keys changed by the admin API in the keys file (None: no keys file), the
    # file watched so that every process serving it applies a change.
    tenant_admin = providers.Singleton(
        build_tenant_admin, config.provided.access.api_keys_file, access, audit
    )
    # Every API request's usage (--usage-db: SQLite, PostgreSQL; None: memory).
    usage = providers.Singleton(
        build_usage_recorder,
        config.provided.access.usage_db,
        config.provided.access.usage_retention_days,
        providers.Callable(usage_gauges, metrics),
    )
    # Where the Tinker checkpoints served by path (as models) are found: the Tinker
    # service, or a fleet ingress's view of the replicas' shared folder.
    tinker_checkpoints = providers.Callable(_first, backend.shared_checkpoints, tinker)
    served_models = providers.Singleton(
        ServedModels.from_settings,
        backend.served_names,
        backend.model_name,
        config.provided.model,
        backend.lora_serving,
        tinker_checkpoints,
    )
    # The rollouts, kept in the usage ledger's database (None: memory only).
    rollouts = providers.Singleton(
        build_rollout_book, served_models, config.provided.access.usage_db, audit
    )
    # The LoRA adapters loaded at run time, kept there too.
    lora = providers.Singleton(
        build_adapter_book, served_models, config.provided.access.usage_db, audit
    )
    tool_parser = providers.Singleton(
        choose_tool_parser,
        config.provided.model.tool_call_parser,
        backend.tokenizer.provided.chat_template,
    )
    reasoning_parser = providers.Singleton(
        parser_for,
        backend.tokenizer.provided.chat_template,
        config.provided.model.reasoning_parser,
    )
    # Requests' default sampling parameters (the model's generation config, the overrides)
    # and the cap on one request's output tokens.
    generation = providers.Singleton(
        generation_defaults,
        providers.Callable(_path_of, backend.resolved_model),
        config.provided.generation.generation_config,
        providers.Callable(GenerationSettings.overrides, config.provided.generation),
        config.provided.generation.cap,
    )
    # What /metrics answers (a fleet's ingress gives every replica's too).
    metrics_exposition = providers.Callable(
        fleet_exposition, providers.Callable(metrics_render, metrics), backend.fleet
    )
    # The server begins the drain (SIGTERM); the app refuses new work while it lasts.
    draining = providers.Singleton(Draining)
    # A fleet's replicas as /admin/replicas lists them (an async callable; None: one
    # process).
    replicas = providers.Callable(fleet_replicas, backend.fleet, async_engine)

    # The HTTP app: the faces over the engine and these services, in the observing
    # middleware.
    http_services = providers.Singleton(
        HttpServices,
        models=served_models,
        tinker=tinker,
        access=access,
        idempotency=idempotency,
        responses=response_store,
        embeddings=backend.embeddings,
        metrics=metrics_exposition,
        draining=draining,
        replicas=replicas,
        faults=backend.faults,
        timeline=timeline,
        usage=usage,
        tenant_admin=tenant_admin,
        rollouts=rollouts,
        lora=lora,
        audit=audit,
        # Daily quotas counted in memory start from the ledger's last 24 hours.
        seed_quotas=providers.Callable(_is_none, config.provided.access.redis_url),
        on_startup=providers.Callable(startup_hooks, on_startup, backend.fleet),
        on_shutdown=providers.Callable(shutdown_hooks, tracing, kv_events),
    )
    http_settings = providers.Singleton(
        HttpSettings,
        allowed_origins=config.provided.http.allowed_origins,
        sse_heartbeat_interval=config.provided.http.sse_heartbeat_interval,
        request_timeout=config.provided.http.request_timeout,
        idempotency_ttl=config.provided.access.idempotency_ttl,
        tool_call_parser=tool_parser,
        reasoning_parser=reasoning_parser,
        tinker_api_keys=config.provided.tinker.tinker_api_keys,
        ui=config.provided.http.ui,
        generation=generation,
    )
    http_app = providers.Singleton(
        build_http_app,
        async_engine,
        backend.served_names,
        http_services,
        http_settings,
        config.provided.observability,
        metrics,
        tracing,
    )


def create_container(
    config: ServerConfig | None = None,
    *,
    backend: containers.Container | None = None,
    training: containers.Container | None = None,
    on_startup: Sequence[Callable[[], None]] = (),
) -> Container:
    """The composition root for ``config`` (None: :class:`ServerConfig`'s defaults: the
    embedded model on the torch runner, no Tinker, no embeddings). ``backend`` and
    ``training``: sub-containers instead of the config's (:mod:`entrypoints.backends`;
    given the config here); ``on_startup``: hooks run on the server's event loop at start
    (the CLI's SIGHUP handler). Nothing is built until asked for."""
    config = config or ServerConfig()
    if backend is None and config.fleet.replicas:
        from entrypoints.fleet_backend import RemoteBackend  # Ray only when asked for

        backend = RemoteBackend()
    if backend is None:
        backend = BACKENDS[config.model.runner]()
    if training is None:
        training = TRAININGS[config.tinker.training_backend]()
    container = Container(
        config=providers.Object(config),
        on_startup=providers.Object(tuple(on_startup)),
        backend=backend,
        training=training,
    )
    backend.config.override(container.config)
    training.override_providers(
        config=container.config, model=backend, engine=container.async_engine
    )
    return container
