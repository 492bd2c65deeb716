"""``create_app(engine, model_name, services, settings) -> Litestar``: the HTTP faces of an
engine client.

The adapter knows no container: entrypoints build the engine (and the Tinker service) and
pass them in; the app builds the completion service over the engine's input processor.
Faces, one router each: the native token stream (``generate_routes``), the OpenAI
endpoints (``openai/``), the Tinker API (``tinker/``), and the probes (``probes``).
"""

from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import structlog
from litestar import Litestar
from litestar.config.cors import CORSConfig
from litestar.exceptions import HTTPException
from litestar.middleware import DefineMiddleware

from adapters.http.admin import (
    admin_router,
    audit_router,
    lora_router,
    rollout_router,
    tenant_router,
)
from adapters.http.anthropic import anthropic_router
from adapters.http.console import Timeline, console_routers, engine_info
from adapters.http.console.data import console_data_router
from adapters.http.errors import HTTPError, error_response, framework_error_response
from adapters.http.generate_routes import generate_router
from adapters.http.idempotency import IdempotencyMiddleware
from adapters.http.openai import openai_router
from adapters.http.ownership import Draining, owning_middleware
from adapters.http.probes import probe_router
from adapters.http.responses import responses_router
from adapters.http.served_models import ModelNames
from adapters.http.streaming import DEFAULT_HEARTBEAT_S, heartbeat_middleware
from adapters.http.tinker import tinker_guard, tinker_router
from adapters.http.usage.middleware import usage_middleware
from adapters.http.usage.routes import usage_router
from application.access.access import Access
from application.access.audit import Audit
from application.access.idempotency import DEFAULT_TTL_S
from application.access.tenant_admin import TenantAdmin
from application.access.usage_ledger import MemoryUsageLedger, UsageRecorder
from application.engine.engine_client import EngineClient
from application.lifecycle import Lifecycle
from application.serving.chat_prompts import ChatPrompts
from application.serving.completions import CompletionService
from application.serving.embeddings import EmbeddingService
from application.serving.generation import GenerationDefaults
from application.serving.lora_adapters import AdapterBook
from application.serving.responses import MemoryResponseStore
from application.serving.rollouts import RolloutBook
from application.serving.served_models import ServedModels
from application.serving.tool_parsers import FORMATS
from application.tinker.service import TinkerService
from domain.idempotency import IdempotencyStore
from domain.responses import ResponseStore

log = structlog.get_logger(__name__)

# The endpoints that generate: a retried POST with an Idempotency-Key runs once.
IDEMPOTENT_PATHS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/generate",
    "/v1/messages",  # anthropic
    "/v1/responses",
)
# What a browser page on an allowed origin may send, and read, cross-origin.
CORS_ALLOW_HEADERS = [
    "Authorization",
    "Content-Type",
    "X-API-Key",
    "anthropic-version",
    "anthropic-beta",
    "X-Request-Id",
    "Idempotency-Key",
]
CORS_EXPOSE_HEADERS = [
    "X-Request-Id",
    "x-infer-model",  # the model a rollout's name ran on
    *(
        f"x-ratelimit-{f}-{u}"
        for f in ("limit", "remaining", "reset")
        for u in ("requests", "tokens")
    ),
]


@dataclass(frozen=True)
class HttpSettings:
    """The app's plain settings, named as ``infer serve``'s flags: ``allowed_origins``:
    browser origins allowed cross-origin (none: no CORS headers); ``sse_heartbeat_interval``:
    a ping in event streams silent that long (0: none); ``request_timeout``: the deadline
    of the OpenAI and ``/v1/generate`` requests (0: none); ``idempotency_ttl``: how long
    replies to ``Idempotency-Key`` requests are kept; ``tool_call_parser``: the format the
    model writes tool calls in (``hermes``, ``llama3_json``, ``pythonic``: resolved, not
    ``auto``); ``reasoning_parser``: how chats' thinking is told from their answer
    (``think`` or ``none``: resolved, not ``auto``); ``tinker_api_keys``: the keys the
    Tinker API accepts (None: any ``tml-`` key); ``ui``: serve the web console at ``/``
    and ``/ui`` (``--no-ui``: off); ``generation``: the default sampling parameters and
    the output cap (``--generation-config``, ``--max-output-tokens``)."""

    allowed_origins: tuple[str, ...] = ()
    sse_heartbeat_interval: float = DEFAULT_HEARTBEAT_S
    request_timeout: float = 0.0
    idempotency_ttl: float = DEFAULT_TTL_S
    tool_call_parser: str = "hermes"
    reasoning_parser: str = "none"
    tinker_api_keys: frozenset[str] | None = None
    ui: bool = True
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)


@dataclass(frozen=True)
class HttpServices:
    """What the app serves besides the engine client, each optional. ``models``: the
    models served by name (default: the model name alone), with the Tinker API the
    callers' checkpoints too; ``tinker``: also serve the Tinker fine-tuning API under
    ``/api/v1``; ``access``: API keys (tenants, scopes) and per-tenant limits (None or
    open: anyone may call); ``idempotency``: where replies to ``Idempotency-Key`` requests
    are kept (None: the header is ignored); ``embeddings``: also serve ``/v1/embeddings``;
    ``metrics``: serve ``GET /metrics`` with what it returns (the exposition and its
    content type); ``draining``: the server's drain state (``adapters.http.uvicorn_server``
    begins it on SIGTERM); ``replicas``: a fleet's replicas, listed at ``/admin/replicas`` (None:
    one process); ``responses``: where ``/v1/responses`` keeps finished responses
    (default: in this process's memory; None: none are kept); ``timeline``: the engine's
    recent seconds, which the console's engine view streams (None: none seen here);
    ``usage``: the usage ledger every ``/v1/`` request is recorded in, which the usage API
    and the console read (None: one in this process's memory); ``seed_quotas``: count the
    last 24 hours of the ledger into the tenants' daily quotas at start-up (their counters
    are in memory); ``tenant_admin``: tenants and keys managed at ``/admin/tenants`` (the
    keys file, watched for other processes' changes; None: 409s); ``rollouts``: the
    rollouts of ``models`` and where they are stored (None: in memory only); ``lora``: the
    LoRA adapters loaded at run time into ``models`` and where they are stored (None: in
    memory only); ``audit``:
    where admins' changes are kept for ``/admin/audit`` (None: memory);
    ``on_startup``: called on
    the event loop before the engine starts
    (signal handlers); ``on_shutdown``: called after the engine stopped (flushing
    traces)."""

    models: ServedModels | None = None
    tinker: TinkerService | None = None
    access: Access | None = None
    idempotency: IdempotencyStore | None = None
    embeddings: EmbeddingService | None = None
    metrics: Callable[[], tuple[bytes, str]] | None = None
    draining: Draining | None = None
    replicas: Callable[[], Awaitable[list[dict[str, Any]]]] | None = None
    # A fleet's fault hook (tests: INFER_FAULT_INJECTION=1): a replica made to fail calls.
    faults: Callable[[str, bool], Awaitable[str]] | None = None
    # Where /v1/responses keeps finished responses (None: none are kept).
    responses: ResponseStore | None = field(default_factory=MemoryResponseStore)
    timeline: Timeline | None = None
    usage: UsageRecorder | None = None
    seed_quotas: bool = False
    tenant_admin: TenantAdmin | None = None
    rollouts: RolloutBook | None = None
    lora: AdapterBook | None = None
    audit: Audit | None = None
    on_startup: Sequence[Callable[[], None]] = ()
    on_shutdown: Sequence[Callable[[], None]] = ()


def create_app(
    engine: EngineClient,
    model_name: str,
    services: HttpServices | None = None,
    settings: HttpSettings | None = None,
) -> Litestar:
    """The faces over ``engine`` serving ``model_name``, with ``services`` (see
    :class:`HttpServices`) and ``settings`` (see :class:`HttpSettings`)."""
    services = services or HttpServices()
    settings = settings or HttpSettings()
    tinker, access = services.tinker, services.access
    draining = services.draining or Draining()
    api_keys = settings.tinker_api_keys
    models = services.models or ServedModels([model_name], model_name)
    # The caller's Tinker tenant, where Tinker checkpoints are served (by path, as models).
    serves_checkpoints = tinker is not None or models.tinker is not None
    owner = tinker_guard(api_keys, access).tenant if serves_checkpoints else None
    audit = services.audit or Audit()
    rollouts = services.rollouts or RolloutBook(models, audit=audit)
    lora = services.lora or AdapterBook(models, audit=audit)
    names = ModelNames(models, owner, rollouts)
    inputs = engine.inputs
    chats = ChatPrompts(FORMATS[settings.tool_call_parser], inputs)
    completions = CompletionService(inputs, chats, settings.reasoning_parser, settings.generation)
    idempotent = []
    if services.idempotency is not None:
        idempotent.append(
            DefineMiddleware(
                IdempotencyMiddleware,  # type: ignore[arg-type]
                store=services.idempotency,
                paths=IDEMPOTENT_PATHS,
                ttl_s=settings.idempotency_ttl,
            )
        )
    interval = settings.sse_heartbeat_interval
    heartbeat = [heartbeat_middleware(interval)] if interval > 0 else []
    usage = services.usage or UsageRecorder(MemoryUsageLedger())
    console_data = [
        console_data_router(usage, models, access=access, tinker=tinker, tinker_api_keys=api_keys)
    ]
    routers = [] if tinker is None else [tinker_router(tinker, api_keys=api_keys, access=access)]
    routers += [
        usage_router(usage, access),
        rollout_router(rollouts, access),
        lora_router(lora, access),
        tenant_router(services.tenant_admin, access),
        audit_router(audit, access),
    ]
    if services.replicas is not None:
        routers.append(admin_router(services.replicas, access, services.faults))
    if settings.ui:
        info = engine_info(inputs.config, model_name)
        routers += console_routers(
            access, draining, info, timeline=services.timeline, replicas=services.replicas
        )
    return Litestar(
        route_handlers=[
            generate_router(completions, names, access),
            responses_router(completions, names, store=services.responses, access=access),
            probe_router(engine, draining, services.metrics, models=models),
            openai_router(completions, names, access=access, embeddings=services.embeddings),
            anthropic_router(completions, names, access=access),
            *routers,
            *(console_data if settings.ui else []),
        ],
        lifespan=[_lifespan(engine, services, usage, [rollouts, lora])],
        logging_config=None,  # logs go through the process's configuration (configure_logging)
        middleware=[
            *idempotent,
            owning_middleware(engine, draining, settings.request_timeout),
            usage_middleware(usage),
            *heartbeat,
        ],
        cors_config=_cors(settings.allowed_origins),
        exception_handlers={
            HTTPError: error_response,
            HTTPException: framework_error_response,
            Exception: framework_error_response,
        },
    )


def _lifespan(
    engine: EngineClient,
    services: HttpServices,
    usage: UsageRecorder,
    books: Sequence[RolloutBook | AdapterBook],
) -> Callable[[Litestar], AbstractAsyncContextManager[None]]:
    """Start-up hooks (on the event loop: signal handlers), the usage ledger's writer, then
    the engine and the Tinker service; at shutdown, the services, the engine, the ledger's
    last records, then the shutdown hooks."""

    watches: list[Callable[[], Coroutine[Any, Any, None]]] = []
    if services.tenant_admin is not None:
        watches.append(services.tenant_admin.watch)
    watches += [book.watch for book in books if book.store is not None]
    lifecycle = Lifecycle(
        engine,
        usage,
        quotas=services.access if services.seed_quotas else None,
        tinker=services.tinker,
        embeddings=services.embeddings,
        watches=watches,
    )

    @asynccontextmanager
    async def lifespan(_: Litestar) -> AsyncIterator[None]:
        for hook in services.on_startup:
            hook()
        await lifecycle.start()
        try:
            yield
        finally:
            await lifecycle.stop()
            for hook in services.on_shutdown:
                hook()

    return lifespan


def _cors(origins: Sequence[str]) -> CORSConfig | None:
    if not origins:
        return None
    return CORSConfig(
        allow_origins=list(origins),
        allow_methods=["GET", "POST", "PUT", "DELETE"],
        allow_headers=CORS_ALLOW_HEADERS,
        expose_headers=CORS_EXPOSE_HEADERS,
    )
