"""A Tinker API server on 127.0.0.1 in a background thread, for the real tinker SDK."""

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import torch
import uvicorn
from litestar import Litestar

from adapters.fake.toy_backend import ToyBackend
from adapters.http.tinker import tinker_router
from adapters.storage.checkpoints import FileCheckpointStorage
from adapters.torch.loading.loader import load_model
from adapters.torch.lora.custom_loss import custom_loss_gradient
from adapters.torch.lora.serving import LoraServing
from adapters.torch.lora.training import BaseModelEntry, LoraTrainingBackend
from application.access.access import Access
from application.engine.async_engine import AsyncEngine
from application.tinker.engine_sampler import EngineSampler
from application.tinker.service import TinkerService
from domain.config import EngineConfig
from domain.tinker.values import SampleRequest, TinkerSampleResult, WeightsSource
from tests.fakes import torch_async_engine
from tests.support.uvicorn_thread import running

os.environ.setdefault("TINKER_TELEMETRY", "0")  # the tinker SDK reports nothing home

API_KEY = "tml-test-key"
BASE_MODEL = "test/base"


def lora_service(root: Path, model_folder: Path) -> tuple[TinkerService, AsyncEngine]:
    """The real backends on a (tiny) model in float32: LoRA training, and sampling through
    a serving engine with multi-LoRA; start the engine with the app (``tinker_app``)."""
    backend = LoraTrainingBackend([BaseModelEntry(BASE_MODEL, model_folder, dtype=torch.float32)])
    model = load_model(model_folder, dtype=torch.float32)
    lora = LoraServing(model, live_state=backend.peft_state)
    config = EngineConfig(max_num_seqs=8, max_model_len=256)
    engine = torch_async_engine(model, config, lora=lora)
    sampler = EngineSampler(engine, lora, [BASE_MODEL])
    return TinkerService(backend, sampler, FileCheckpointStorage(root)), engine


def toy_service(root: Path, **kwargs: object) -> TinkerService:
    backend = ToyBackend(BASE_MODEL, aliases=("Qwen/Qwen3-toy",), custom_loss=custom_loss_gradient)
    return TinkerService(backend, backend, FileCheckpointStorage(root), **kwargs)  # type: ignore[arg-type]


def backend_app(
    kind: str, root: Path, model_folder: Path, **kwargs: Any
) -> tuple[Litestar, TinkerService]:
    """A server (``tinker_app`` with ``kwargs``) and its service over ``root``: on the toy
    backend (``kind`` "toy") or the real ones on the (tiny) model in ``model_folder``."""
    if kind == "toy":
        service = toy_service(root)
        return tinker_app(service, **kwargs), service
    service, engine = lora_service(root, model_folder)
    return tinker_app(service, engine=engine, **kwargs), service


class GatedSampler:
    """A SamplingBackend whose samples wait for ``open`` (or their cancellation)."""

    def __init__(self, inner: ToyBackend) -> None:
        self.inner = inner
        self.open = threading.Event()
        self.started = threading.Event()
        self.cancelled = threading.Event()

    async def sample(
        self, source: WeightsSource, request: SampleRequest, *, tenant: str = ""
    ) -> TinkerSampleResult:
        self.started.set()
        try:
            while not self.open.is_set():
                await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return await self.inner.sample(source, request, tenant=tenant)


def tinker_app(
    service: TinkerService,
    api_keys: frozenset[str] | None = None,
    client_config: dict[str, object] | None = None,
    engine: AsyncEngine | None = None,
    access: Access | None = None,
) -> Litestar:
    @asynccontextmanager
    async def lifespan(_: Litestar) -> AsyncIterator[None]:
        if engine is not None:
            engine.start()
        service.start()
        try:
            yield
        finally:
            await service.stop()
            if engine is not None:
                await engine.stop()

    router = tinker_router(service, api_keys=api_keys, client_config=client_config, access=access)
    return Litestar(route_handlers=[router], lifespan=[lifespan])


@contextmanager
def serve(app: Litestar) -> Iterator[str]:
    """Run ``app`` with uvicorn on a free port; yields its base URL."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    with running(server, start_timeout_s=None, stop_timeout_s=30) as started:
        yield started.url
