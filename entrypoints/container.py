"""Composition root: which adapters implement which ports, chosen from configuration.

Tests and embedders override providers (``container.tokenizer.override(fake)``).
"""

from pathlib import Path

import torch
from dependency_injector import containers, providers

from adapters.fake.tokenizer import ByteTokenizer
from adapters.hf_tokenizer.tokenizer import HFTokenizer
from adapters.http import create_app
from adapters.storage.checkpoints import FileCheckpointStorage
from adapters.torch.loader import load_model
from adapters.torch.lora.serving import LoraServing
from adapters.torch.lora.training import BaseModelEntry, LoraTrainingBackend
from adapters.torch.models.transformer import Transformer
from adapters.torch.runtime.runner import TorchModelRunner
from adapters.torch.runtime.sampler import TokenSampler
from adapters.weights import ResolvedModel, resolve_model
from adapters.weights.packaged import SMOLLM2_NAME
from application.async_engine import AsyncEngine, QueueOutputSink
from application.engine import Engine
from application.tinker.engine_sampler import EngineSampler
from application.tinker.service import TinkerService
from domain.config import EngineConfig
from domain.ports import Tokenizer
from domain.training import TinkerLimits

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def build_model(resolved: ResolvedModel, dtype: str, device: str | None) -> Transformer:
    return load_model(
        resolved.path,
        dtype=DTYPES[dtype],
        device=device or default_device(),
        random_weights=resolved.random_weights,
    )


def build_tokenizer(resolved: ResolvedModel) -> Tokenizer:
    # Dummy-weight models have no tokenizer: bytes work with any real vocabulary size.
    return HFTokenizer.from_folder(resolved.path) if resolved.has_tokenizer else ByteTokenizer()


def resolve(spec: str | None, cache_dir: str | None, progress: bool) -> ResolvedModel:
    return resolve_model(spec, cache_dir=Path(cache_dir) if cache_dir else None, progress=progress)


# Names under which a model is also advertised to Tinker clients, so that tinker-cookbook
# recipes (which look renderers up by exact model name) find one that writes the model's
# chat format: SmolLM2 uses ChatML, as the Qwen3 instruct renderer does.
DEFAULT_TINKER_ALIASES = {SMOLLM2_NAME: ("Qwen/Qwen3-4B-Instruct-2507",)}
DEFAULT_CHECKPOINT_DIR = "~/.cache/infer/tinker"


def model_names(
    resolved: ResolvedModel, served: str | None, aliases: list[str] | None
) -> list[str]:
    """The served name first, then the Tinker aliases."""
    name = served or resolved.name
    extra = DEFAULT_TINKER_ALIASES.get(resolved.name, ()) if aliases is None else aliases
    return [name, *(a for a in extra if a != name)]


def build_lora_serving(model: Transformer, enabled: bool) -> LoraServing | None:
    return LoraServing(model) if enabled else None


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


def build_tinker(
    enabled: bool,
    backend: LoraTrainingBackend,
    engine: AsyncEngine,
    lora: LoraServing | None,
    names: list[str],
    checkpoint_dir: str | None,
    limits: TinkerLimits | None = None,
) -> TinkerService | None:
    if not enabled or lora is None:
        return None
    limits = limits or TinkerLimits()
    lora.live_state = backend.peft_state
    sampler = EngineSampler(engine, lora, names, max_in_engine=limits.max_sample_requests)
    storage = FileCheckpointStorage(Path(checkpoint_dir or DEFAULT_CHECKPOINT_DIR))
    return TinkerService(backend, sampler, storage, limits=limits)


class Container(containers.DeclarativeContainer):
    config = providers.Configuration()

    resolved_model = providers.Singleton(
        resolve, config.model, config.cache_dir, config.progress.as_(bool)
    )
    model = providers.Singleton(build_model, resolved_model, config.dtype, config.device)
    tokenizer = providers.Singleton(build_tokenizer, resolved_model)
    sampler = providers.Singleton(TokenSampler)

    engine_config = providers.Singleton(EngineConfig)
    lora_serving = providers.Singleton(build_lora_serving, model, config.tinker.as_(bool))
    runner = providers.Singleton(TorchModelRunner, model, engine_config, sampler, lora_serving)
    sink = providers.Singleton(QueueOutputSink)
    engine = providers.Singleton(
        Engine, engine_config, runner, tokenizer, sink, vocab_size=model.provided.config.vocab_size
    )
    async_engine = providers.Singleton(AsyncEngine, engine, sink)
    served_names = providers.Singleton(
        model_names, resolved_model, config.served_model_name, config.tinker_aliases
    )
    training_backend = providers.Singleton(
        build_training_backend,
        resolved_model,
        served_names,
        config.dtype,
        config.device,
        engine_config,
    )
    tinker = providers.Singleton(
        build_tinker,
        config.tinker.as_(bool),
        training_backend,
        async_engine,
        lora_serving,
        served_names,
        config.checkpoint_dir,
        config.tinker_limits,
    )
    http_app = providers.Singleton(
        lambda engine, names, tinker, keys: create_app(
            engine, names[0], tinker=tinker, tinker_api_keys=keys
        ),
        async_engine,
        served_names,
        tinker,
        config.tinker_api_keys,
    )


def create_container(
    model: str | None = None,
    *,
    dtype: str = "bfloat16",
    device: str | None = None,
    cache_dir: str | None = None,
    progress: bool = True,
    engine: EngineConfig | None = None,
    served_model_name: str | None = None,
    tinker: bool = False,
    tinker_aliases: list[str] | None = None,
    tinker_api_keys: frozenset[str] | None = None,
    checkpoint_dir: str | None = None,
    tinker_limits: TinkerLimits | None = None,
) -> Container:
    """``tinker``: also serve the Tinker fine-tuning API (LoRA training and sampling of the
    model; checkpoints under ``checkpoint_dir``; ``tinker_api_keys`` None accepts any
    ``tml-`` key)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    container = Container()
    container.config.from_dict(
        {
            "model": model,
            "dtype": dtype,
            "device": device,
            "cache_dir": cache_dir,
            "progress": progress,
            "served_model_name": served_model_name,
            "tinker": tinker,
            "tinker_aliases": tinker_aliases,
            "tinker_api_keys": tinker_api_keys,
            "checkpoint_dir": checkpoint_dir,
            "tinker_limits": tinker_limits,
        }
    )
    if engine is not None:
        container.engine_config.override(providers.Object(engine))
    return container
