"""Composition root: which adapters implement which ports, chosen from configuration.

Tests and embedders override providers (``container.tokenizer.override(fake)``).
"""

from pathlib import Path

import torch
from dependency_injector import containers, providers

from adapters.fake.tokenizer import ByteTokenizer
from adapters.hf_tokenizer.tokenizer import HFTokenizer
from adapters.http import create_app
from adapters.torch.loader import load_model
from adapters.torch.runner import TorchModelRunner
from adapters.torch.sampler import Sampler
from adapters.torch.transformer import Transformer
from adapters.weights import ResolvedModel, resolve_model
from application.async_engine import AsyncEngine, QueueOutputSink
from application.engine import Engine
from domain.config import EngineConfig
from domain.ports import Tokenizer

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


class Container(containers.DeclarativeContainer):
    config = providers.Configuration()

    resolved_model = providers.Singleton(
        resolve, config.model, config.cache_dir, config.progress.as_(bool)
    )
    model = providers.Singleton(build_model, resolved_model, config.dtype, config.device)
    tokenizer = providers.Singleton(build_tokenizer, resolved_model)
    sampler = providers.Singleton(Sampler)

    engine_config = providers.Singleton(EngineConfig)
    runner = providers.Singleton(TorchModelRunner, model, engine_config, sampler)
    sink = providers.Singleton(QueueOutputSink)
    engine = providers.Singleton(
        Engine, engine_config, runner, tokenizer, sink, vocab_size=model.provided.config.vocab_size
    )
    async_engine = providers.Singleton(AsyncEngine, engine, sink)
    http_app = providers.Singleton(
        lambda engine, resolved, name: create_app(engine, name or resolved.name),
        async_engine,
        resolved_model,
        config.served_model_name,
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
) -> Container:
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
        }
    )
    if engine is not None:
        container.engine_config.override(providers.Object(engine))
    return container
