"""Composition root: which adapters implement which ports, chosen from one
:class:`~entrypoints.config.ServerConfig` (``create_container(config)``).

Two selectors pick the implementations: ``config.model.runner`` (``torch``: the model's
weights and tokenizer; ``fake``: :class:`FakeModelRunner` and :class:`ByteTokenizer`,
nothing loaded) and ``config.tinker.training_backend`` (``lora``: LoRA on the model;
``toy``: the numpy :class:`ToyBackend`, which also samples). Providers read the config's
groups (``config.provided.model.dtype``). Tests and embedders override providers
(``container.fake_runner.override(FakeModelRunner(script=...))``, ``container.observer``
for a step observer).
"""

from collections.abc import Callable, Sequence
from pathlib import Path

import structlog
import torch
from dependency_injector import containers, providers

from adapters.fake.embedder import FakeEmbedder
from adapters.fake.runner import FakeModelRunner
from adapters.fake.tokenizer import BYTE_OFFSET, ByteTokenizer
from adapters.fake.toy_backend import ToyBackend
from adapters.grammar import LLGuidanceCompiler, RequestMatchers
from adapters.hf_tokenizer.tokenizer import HFTokenizer
from adapters.http import HttpServices, HttpSettings, create_app
from adapters.http.ownership import Draining
from adapters.observability.http import ObservedApp
from adapters.observability.metrics import Metrics
from adapters.observability.settings import ObservabilitySettings
from adapters.observability.tracing import Tracing, build_tracer_provider
from adapters.storage.checkpoints import FileCheckpointStorage
from adapters.storage.idempotency import RedisIdempotencyStore
from adapters.storage.rate_limits import LimitsCounters
from adapters.torch.cpu.tuning import linear_shapes, tuned
from adapters.torch.embedder import TorchEmbedder
from adapters.torch.kv_sizing import (
    AUTO,
    CPU_AUTO_CAP,
    CPU_AUTO_FRACTION,
    CUDA_AUTO_FRACTION,
    MIB,
    KVCacheMemory,
    human_size,
    size_kv_cache,
)
from adapters.torch.loader import load_model
from adapters.torch.lora.serving import LoraServing
from adapters.torch.lora.training import BaseModelEntry, LoraTrainingBackend
from adapters.torch.models.config import ModelConfig
from adapters.torch.models.transformer import Transformer
from adapters.torch.quant import QuantLinear, has_gguf_blocks
from adapters.torch.runtime.runner import TorchModelRunner
from adapters.torch.runtime.sampler import TokenSampler
from adapters.weights import ResolvedModel, resolve_model
from adapters.weights.embedding import resolve_embedding_model
from adapters.weights.packaged import SMOLLM2_NAME
from application.access import Access
from application.async_engine import AsyncEngine
from application.embeddings import EmbeddingService
from application.idempotency import IdempotencyStore, MemoryIdempotencyStore
from application.keys import Keyring
from application.observers import ObserverGroup, TrainingObserverGroup
from application.quotas import Quotas
from application.served_models import ServedModels
from application.tinker.engine_sampler import EngineSampler
from application.tinker.service import TinkerService
from application.tool_parsers import detect_format
from domain.config import EngineConfig
from domain.observer import NullObserver, StepObserver, TrainingObserver
from domain.ports import Tokenizer
from domain.scheduler import ContinuousScheduler
from domain.tenancy import Tenant
from domain.training import TrainingBackend
from entrypoints.access_flags import AccessSettings
from entrypoints.config import ServerConfig
from entrypoints.embedding_flags import EmbeddingSettings
from entrypoints.engine_flags import EngineSettings
from entrypoints.model_flags import ModelSettings
from entrypoints.tinker_flags import TinkerSettings

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
FAKE_MODEL_NAME = "fake"
log = structlog.get_logger(__name__)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def choose_dtype(flag: str, resolved: ResolvedModel, device: str | None) -> str:
    """``--dtype``: a dtype, or ``auto``: bfloat16 on CUDA; on a CPU the faster of bfloat16
    and float32 for this model's linears on this CPU, measured once and cached
    (:mod:`adapters.torch.cpu.tuning`)."""
    if flag != "auto":
        return flag
    if torch.device(device or default_device()).type != "cpu":
        return "bfloat16"
    tuning = tuned(linear_shapes(ModelConfig.from_folder(resolved.path)))
    log.info("dtype auto", dtype=tuning.dtype, cpu=tuning.cpu, reason=tuning.reason)
    return tuning.dtype


def build_model(
    resolved: ResolvedModel, dtype: str, device: str | None, quantization: str | None = None
) -> Transformer:
    device = device or default_device()
    method = choose_quantization(quantization, resolved, device)
    model = load_model(
        resolved.path,
        dtype=DTYPES[dtype],
        device=device,
        random_weights=resolved.random_weights,
        quantization=method,
    )
    if method is not None:
        linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
        switch = _quantized_switch(model, linears, dtype)
        log.info(
            "quantized weights",
            method=method,
            linears=len(linears),
            weights_mib=round(sum(m.weight_q.nbytes for m in linears) / MIB, 1),
            dense_from_rows=switch,
            # an 8-bit LM head's dequantized copy for many rows (keep_dense_head)
            dense_copy_mib=round(sum(m.dense.nbytes for m in linears if m.dense is not None) / MIB),
        )
    return model


def _quantized_switch(
    model: Transformer, linears: list[QuantLinear], dtype: str
) -> dict[int, int] | None:
    """Give each quantized linear this CPU's measured switch from integer dot products to
    dequantized tiles for its weight format and the model's dtype (see
    :mod:`adapters.torch.cpu.tuning`): bits -> rows, None without the kernel."""
    if not linears or linears[0].kernel is None:
        return None
    tuning = tuned(linear_shapes(model.config))
    chosen: dict[int, int] = {}
    for linear in linears:
        switch = tuning.switch(linear.bits, dtype)
        if switch is not None:
            linear.dense_from_rows = chosen[linear.bits] = switch
    return chosen or None


def choose_quantization(
    flag: str | None, resolved: ResolvedModel, device: str = "cpu"
) -> str | None:
    """``--quantization``: a method, ``none`` (None, the default), or ``auto``: on a CPU,
    ``gguf`` for a GGUF model (served from its own quantized blocks, as llama.cpp serves
    it), else none; on a GPU none (the quantized kernels are CPU ones: a GPU would
    dequantize every linear on every call)."""
    if flag is None or flag == "none":
        return None
    if flag == "auto":
        on_cpu = str(device).startswith("cpu")
        return "gguf" if on_cpu and has_gguf_blocks(resolved.path) else None
    return flag


def build_engine_config(
    settings: EngineConfig, model: Transformer, memory: KVCacheMemory | str | None
) -> EngineConfig:
    """The torch runner's engine configuration: ``settings`` with as many KV blocks as
    ``memory`` (a budget, or ``auto``) holds on the model's device in its dtype (None:
    ``settings``' blocks); logs the pool and the concurrency once."""
    weight = model.embed_tokens.weight
    sizing = size_kv_cache(settings, model.config, weight.dtype, memory, weight.device)
    config = sizing.config
    if memory == AUTO:
        on_cuda = weight.device.type == "cuda"
        sized_by = (
            f"auto ({CUDA_AUTO_FRACTION:g} of the device's memory, the weights included)"
            if on_cuda
            else f"auto ({CPU_AUTO_FRACTION:g} of the memory available, at most "
            f"{human_size(CPU_AUTO_CAP)})"
        )
    else:
        sized_by = str(memory) if memory is not None else "max_num_seqs"
    log.info(
        "KV cache",
        blocks=sizing.num_blocks,
        block_size=config.kv_block_size,
        tokens=sizing.num_blocks * config.kv_block_size,
        memory_mib=round(sizing.memory_bytes / MIB, 1),
        max_num_seqs=config.max_batch_size,
        tokens_per_request=config.max_seq_len,
        max_concurrency=sizing.max_concurrency,
        sized_by=sized_by,
    )
    return config


def build_tokenizer(resolved: ResolvedModel) -> Tokenizer:
    # Dummy-weight models have no tokenizer: bytes work with any real vocabulary size.
    return HFTokenizer.from_folder(resolved.path) if resolved.has_tokenizer else ByteTokenizer()


def choose_tool_parser(flag: str | None, tokenizer: Tokenizer) -> str:
    """``--tool-call-parser``: a format's name, or ``auto``: the one the chat template's
    model family writes (ChatML and templates without tools: ``hermes``)."""
    if flag and flag != "auto":
        return flag
    template = tokenizer.chat_template if isinstance(tokenizer, HFTokenizer) else None
    return detect_format(template)


def build_grammar(
    resolved: ResolvedModel, vocab_size: int, tokenizer: Tokenizer
) -> LLGuidanceCompiler:
    """Structured outputs over the model's tokenizer (bytes for dummy-weight models)."""
    if resolved.has_tokenizer:
        path = resolved.path / "tokenizer.json"
        return LLGuidanceCompiler.from_tokenizer_json(path, vocab_size, tokenizer.eos_token_ids)
    return build_byte_grammar(vocab_size)


def build_byte_grammar(vocab_size: int) -> LLGuidanceCompiler:
    """Structured outputs over :class:`ByteTokenizer` for a model of ``vocab_size`` ids
    (the ids past the tokenizer's are never allowed)."""
    tokenizer = ByteTokenizer()
    tokens = tokenizer.token_bytes()
    unused = range(len(tokens), vocab_size)
    return LLGuidanceCompiler.from_token_bytes(
        tokens + [b"<unused%d>" % i for i in unused],
        special_ids=[*range(BYTE_OFFSET), *unused],
        eos_token_ids=tokenizer.eos_token_ids,
    )


def resolve(settings: ModelSettings) -> ResolvedModel:
    cache_dir = Path(settings.cache_dir) if settings.cache_dir else None
    return resolve_model(settings.model, cache_dir=cache_dir, progress=settings.progress)


# Names under which a model is also advertised to Tinker clients, so that tinker-cookbook
# recipes (which look renderers up by exact model name) find one that writes the model's
# chat format: SmolLM2 uses ChatML, as the Qwen3 instruct renderer does.
DEFAULT_TINKER_ALIASES = {SMOLLM2_NAME: ("Qwen/Qwen3-4B-Instruct-2507",)}
DEFAULT_CHECKPOINT_DIR = "~/.cache/infer/tinker"


def model_names(
    resolved: ResolvedModel, served: str | None, aliases: Sequence[str] | None
) -> list[str]:
    """The served name first, then the Tinker aliases."""
    name = served or resolved.name
    extra = DEFAULT_TINKER_ALIASES.get(resolved.name, ()) if aliases is None else aliases
    return [name, *(a for a in extra if a != name)]


def fake_model_names(served: str | None, aliases: Sequence[str] | None) -> list[str]:
    """The fake runner's names: the served name (default ``fake``), then the aliases."""
    name = served or FAKE_MODEL_NAME
    return [name, *(a for a in aliases or () if a != name)]


def build_lora_serving(
    model: Transformer, tinker: TinkerSettings, models: ModelSettings
) -> LoraServing | None:
    """Multi-LoRA serving, for Tinker's samples and the ``--lora-modules``."""
    if not tinker.enabled and not models.lora_modules:
        return None
    return LoraServing(model, max_adapters=models.max_loras)


def build_served_models(
    names: list[str],
    root: str,
    settings: ModelSettings,
    lora: LoraServing | None,
    tinker: TinkerService | None,
) -> ServedModels:
    """The names the OpenAI faces serve: ``names[0]`` and the aliases of ``settings``, the
    LoRA modules (loaded now: a bad folder fails the start), Tinker's checkpoints (on the
    base model under any of ``names``, Tinker's aliases included)."""
    models = ServedModels(
        [names[0], *settings.aliases],
        root,
        version=settings.model_version,
        lora_modules=settings.lora_modules,
        adapters=lora,
        tinker=tinker,
        tinker_base_names=names,
        deprecations=settings.deprecations,
    )
    models.load_lora_modules()
    return models


def build_torch_embeddings(
    settings: EmbeddingSettings, device: str | None
) -> EmbeddingService | None:
    """The embedding model (float32) on the chat model's device; None: no embeddings."""
    if settings.embedding_model is None:
        return None
    resolved = resolve_embedding_model(settings.embedding_model)
    embedder = TorchEmbedder.from_folder(resolved.path, device or default_device())
    return EmbeddingService(embedder, resolved.name, settings.limits)


def build_fake_embeddings(settings: EmbeddingSettings) -> EmbeddingService | None:
    """A :class:`FakeEmbedder` served under the model's name; None: no embeddings."""
    spec = settings.embedding_model
    return None if spec is None else EmbeddingService(FakeEmbedder(), spec, settings.limits)


def build_training_backend(
    resolved: ResolvedModel, names: list[str], dtype: str, device: str | None, engine: EngineConfig
) -> LoraTrainingBackend:
    entry = BaseModelEntry(
        names[0],
        resolved.path,
        aliases=tuple(names[1:]),
        dtype=DTYPES[dtype],
        max_context=engine.max_seq_len,
        random_weights=resolved.random_weights,
        device=device or default_device(),
    )
    return LoraTrainingBackend([entry])


def build_toy_backend(names: list[str], engine: EngineConfig) -> ToyBackend:
    return ToyBackend(names[0], aliases=tuple(names[1:]), max_context=engine.max_seq_len)


def build_tinker(
    settings: TinkerSettings,
    training_backend: Callable[[], TrainingBackend],
    engine: AsyncEngine,
    lora: LoraServing | None,
    names: list[str],
    metrics: Metrics | None = None,
    tracing: Tracing | None = None,
) -> TinkerService | None:
    """The Tinker service: a :class:`ToyBackend` samples itself; LoRA training samples
    through the engine (it needs the torch runner's LoRA serving). The backend is built
    only when the service is."""
    if not settings.enabled:
        return None
    backend = training_backend()
    limits = settings.limits
    storage = FileCheckpointStorage(Path(settings.checkpoint_dir or DEFAULT_CHECKPOINT_DIR))
    observers: list[TrainingObserver] = [o for o in (metrics, tracing) if o is not None]
    observer = TrainingObserverGroup(observers) if observers else None
    if isinstance(backend, ToyBackend):
        service = TinkerService(backend, backend, storage, limits=limits, observer=observer)
    elif lora is None or not isinstance(backend, LoraTrainingBackend):
        return None
    else:
        lora.live_state = backend.peft_state
        sampler = EngineSampler(engine, lora, names, max_in_engine=limits.max_sample_requests)
        service = TinkerService(backend, sampler, storage, limits=limits, observer=observer)
    if metrics is not None:
        metrics.track_pending_futures(service.futures.pending)
    return service


def build_metrics(
    settings: ObservabilitySettings, names: list[str], engine: EngineConfig, runner: object
) -> Metrics | None:
    if not settings.metrics:
        return None
    cache = getattr(runner, "cache", None)  # the torch runner's KV cache
    kv_bytes = 0
    if cache is not None:
        kv_bytes = sum(t.numel() * t.element_size() for t in (cache.k, cache.v))
    return Metrics(
        names[0],
        max_batch_size=engine.max_batch_size,
        kv_cache_bytes=kv_bytes,
        max_tenants=settings.max_tenant_labels,
    )


def build_tracing(settings: ObservabilitySettings, names: list[str]) -> Tracing | None:
    if not settings.tracing.enabled:
        return None
    return Tracing(build_tracer_provider(settings.tracing), names[0])


def build_observer(metrics: Metrics | None, tracing: Tracing | None) -> StepObserver:
    observers: list[StepObserver] = [o for o in (metrics, tracing) if o is not None]
    if not observers:
        return NullObserver()
    return observers[0] if len(observers) == 1 else ObserverGroup(observers)


def build_access(
    keyring: Keyring | None, redis_url: str | None, engine: AsyncEngine, metrics: Metrics | None
) -> Access:
    """Keys and limits: counters in Redis with ``redis_url``, else in memory; tenants'
    weights go to the scheduler."""
    quotas = None
    if keyring is not None:
        refused = metrics.rate_limited if metrics is not None else None
        quotas = Quotas(LimitsCounters(redis_url), on_refused=refused)

    def weigh(tenants: Sequence[Tenant]) -> None:
        scheduler = engine.engine.scheduler
        if isinstance(scheduler, ContinuousScheduler):
            scheduler.set_tenant_weights({t.id: t.weight for t in tenants})

    return Access(keyring, quotas, on_tenants=weigh)


def build_idempotency(settings: AccessSettings) -> IdempotencyStore | None:
    """Replies to Idempotency-Key requests: in Redis with ``redis_url``, else in memory
    (``idempotency_max_keys`` at most); ``idempotency_ttl`` 0: off."""
    if settings.idempotency_ttl == 0:
        return None
    if settings.redis_url is not None:
        return RedisIdempotencyStore(settings.redis_url)
    return MemoryIdempotencyStore(settings.idempotency_max_keys)


def build_http_settings(config: ServerConfig, tool_parser: str) -> HttpSettings:
    """The app's settings from the config's groups (and the tool-call format chosen)."""
    return HttpSettings(
        allowed_origins=config.http.allowed_origins,
        sse_heartbeat_interval=config.http.sse_heartbeat_interval,
        request_timeout=config.http.request_timeout,
        idempotency_ttl=config.access.idempotency_ttl,
        tool_call_parser=tool_parser,
        tinker_api_keys=config.tinker.tinker_api_keys,
    )


def metrics_render(metrics: Metrics | None) -> Callable[[], tuple[bytes, str]] | None:
    return metrics.render if metrics is not None else None


def shutdown_hooks(tracing: Tracing | None) -> tuple[Callable[[], None], ...]:
    return (tracing.shutdown,) if tracing is not None else ()


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


class Container(containers.DeclarativeContainer):
    config = providers.Object(ServerConfig())  # create_container's
    # Hooks run on the server's event loop at start (not configuration: code).
    on_startup = providers.Object(())

    resolved_model = providers.Singleton(resolve, config.provided.model)
    # --dtype auto resolved once (measured on a CPU): the model and training use it.
    dtype = providers.Singleton(
        choose_dtype, config.provided.model.dtype, resolved_model, config.provided.model.device
    )
    model = providers.Singleton(
        build_model,
        resolved_model,
        dtype,
        config.provided.model.device,
        config.provided.model.quantization,
    )
    sampler = providers.Singleton(TokenSampler)
    # The engine's flags; the torch runner's KV pool is sized from them on the model (by
    # ``kv_cache_memory`` when given), and the scheduler and the runner get that one.
    engine_settings = providers.Singleton(EngineSettings.engine_config, config.provided.engine)
    engine_config = providers.Selector(
        config.provided.model.runner,
        torch=providers.Singleton(
            build_engine_config,
            engine_settings,
            model,
            config.provided.model.kv_cache_memory,
        ),
        fake=engine_settings,
    )
    served_names = providers.Selector(
        config.provided.model.runner,
        torch=providers.Singleton(
            model_names,
            resolved_model,
            config.provided.model.served_model_name,
            config.provided.tinker.tinker_aliases,
        ),
        fake=providers.Singleton(
            fake_model_names,
            config.provided.model.served_model_name,
            config.provided.tinker.tinker_aliases,
        ),
    )

    # The runner selector: "torch" (the model) or "fake" (no model).
    torch_tokenizer = providers.Singleton(build_tokenizer, resolved_model)
    fake_tokenizer = providers.Singleton(ByteTokenizer)
    tokenizer = providers.Selector(
        config.provided.model.runner, torch=torch_tokenizer, fake=fake_tokenizer
    )
    lora_serving = providers.Selector(
        config.provided.model.runner,
        torch=providers.Singleton(
            build_lora_serving, model, config.provided.tinker, config.provided.model
        ),
        fake=providers.Object(None),
    )
    vocab_size = providers.Selector(
        config.provided.model.runner,
        torch=model.provided.config.vocab_size,
        fake=providers.Object(None),  # the tokenizer's
    )
    # Structured outputs (None: refused): the compiler checks requests, the matchers run
    # in the torch runner.
    grammar = providers.Selector(
        config.provided.model.runner,
        torch=providers.Singleton(build_grammar, resolved_model, vocab_size, torch_tokenizer),
        fake=providers.Object(None),
    )
    torch_runner = providers.Singleton(
        TorchModelRunner,
        model,
        engine_config,
        sampler,
        lora_serving,
        providers.Singleton(RequestMatchers, grammar),
    )
    fake_runner = providers.Singleton(FakeModelRunner)
    runner = providers.Selector(config.provided.model.runner, torch=torch_runner, fake=fake_runner)

    # Metrics and traces (None when off); every step's statistics go to the observer
    # (both of them, or a test's override).
    metrics = providers.Singleton(
        build_metrics, config.provided.observability, served_names, engine_config, runner
    )
    tracing = providers.Singleton(build_tracing, config.provided.observability, served_names)
    observer = providers.Singleton(build_observer, metrics, tracing)
    async_engine = providers.Singleton(
        AsyncEngine,
        engine_config,
        runner,
        tokenizer,
        vocab_size=vocab_size,
        observer=observer,
        grammar=grammar,
    )
    engine = async_engine.provided.engine
    sink = async_engine.provided.sink
    # /v1/embeddings (None without an embedding model): the selector follows the runner's.
    embeddings = providers.Selector(
        config.provided.model.runner,
        torch=providers.Singleton(
            build_torch_embeddings, config.provided.embeddings, config.provided.model.device
        ),
        fake=providers.Singleton(build_fake_embeddings, config.provided.embeddings),
    )
    # The training-backend selector: "lora" (on the model) or "toy" (numpy, no model).
    lora_backend = providers.Singleton(
        build_training_backend,
        resolved_model,
        served_names,
        dtype,
        config.provided.model.device,
        engine_config,
    )
    toy_backend = providers.Singleton(build_toy_backend, served_names, engine_config)
    training_backend = providers.Selector(
        config.provided.tinker.training_backend, lora=lora_backend, toy=toy_backend
    )
    tinker = providers.Singleton(
        build_tinker,
        config.provided.tinker,
        training_backend.provider,
        async_engine,
        lora_serving,
        served_names,
        metrics,
        tracing,
    )
    # API keys -> tenants (None: an open server), read from the keys file once.
    keyring = providers.Singleton(AccessSettings.keyring, config.provided.access)
    access = providers.Singleton(
        build_access, keyring, config.provided.access.redis_url, async_engine, metrics
    )
    idempotency = providers.Singleton(build_idempotency, config.provided.access)
    served_models = providers.Singleton(
        build_served_models,
        served_names,
        providers.Selector(
            config.provided.model.runner,
            torch=resolved_model.provided.name,
            fake=providers.Object(FAKE_MODEL_NAME),
        ),
        config.provided.model,
        lora_serving,
        tinker,
    )
    tool_parser = providers.Singleton(
        choose_tool_parser, config.provided.model.tool_call_parser, tokenizer
    )
    # The server begins the drain (SIGTERM); the app refuses new work while it lasts.
    draining = providers.Singleton(Draining)
    http_services = providers.Singleton(
        HttpServices,
        models=served_models,
        tinker=tinker,
        access=access,
        idempotency=idempotency,
        embeddings=embeddings,
        metrics=providers.Callable(metrics_render, metrics),
        draining=draining,
        on_startup=on_startup,
        on_shutdown=providers.Callable(shutdown_hooks, tracing),
    )
    http_settings = providers.Singleton(build_http_settings, config, tool_parser)
    http_app = providers.Singleton(
        build_http_app,
        async_engine,
        served_names,
        http_services,
        http_settings,
        config.provided.observability,
        metrics,
        tracing,
    )


def create_container(
    config: ServerConfig | None = None,
    *,
    on_startup: Sequence[Callable[[], None]] = (),
) -> Container:
    """The composition root for ``config`` (None: :class:`ServerConfig`'s defaults: the
    embedded model on the torch runner, no Tinker, no embeddings); ``on_startup``: hooks
    run on the server's event loop at start (the CLI's SIGHUP handler). Nothing is built
    until asked for."""
    container = Container()
    container.config.override(providers.Object(config or ServerConfig()))
    container.on_startup.override(providers.Object(tuple(on_startup)))
    return container
