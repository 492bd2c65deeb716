"""A Tinker API server on 127.0.0.1 in a background thread, for the real tinker SDK."""

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import uvicorn
from litestar import Litestar

from adapters.http.tinker_routes import tinker_router
from adapters.storage.checkpoints import FileCheckpointStorage
from adapters.toy_backend.backend import ToyBackend
from application.tinker.service import TinkerService

API_KEY = "tml-test-key"
TOY_MODEL = "toy/bigram"


def toy_service(root: Path, **kwargs: object) -> TinkerService:
    backend = ToyBackend(TOY_MODEL, aliases=("Qwen/Qwen3-toy",))
    return TinkerService(backend, backend, FileCheckpointStorage(root), **kwargs)  # type: ignore[arg-type]


def tinker_app(
    service: TinkerService,
    api_keys: frozenset[str] | None = None,
    client_config: dict[str, object] | None = None,
) -> Litestar:
    @asynccontextmanager
    async def lifespan(_: Litestar) -> AsyncIterator[None]:
        service.start()
        try:
            yield
        finally:
            await service.stop()

    router = tinker_router(service, api_keys=api_keys, client_config=client_config)
    return Litestar(route_handlers=[router], lifespan=[lifespan])


@contextmanager
def serve(app: Litestar) -> Iterator[str]:
    """Run ``app`` with uvicorn on a free port; yields its base URL."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("server failed to start")
        threading.Event().wait(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
