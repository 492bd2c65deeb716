"""The app on the fake model (and the toy Tinker backend), in process or under a real uvicorn
server with ``adapters.http.uvicorn_server``'s limits, and checks that nothing is left running."""

import json
import socket
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from litestar import Litestar

from adapters.fake import ByteTokenizer
from adapters.fake.runner import FakeModelRunner, reply_script
from adapters.fake.toy_backend import ToyBackend
from adapters.http import HttpServices, create_app
from adapters.http.uvicorn_server import ConnectionLimits, LimitedServer, server_config
from adapters.storage.checkpoints import FileCheckpointStorage
from application.engine.async_engine import AsyncEngine
from application.tinker.service import TinkerService
from tests.fakes import fake_async_engine
from tests.support.engine_leftovers import EngineLeftovers
from tests.support.uvicorn_thread import running

MODEL = "test/fake-model"
TINKER_BASE_MODEL = "test/base"
TOKENIZER = ByteTokenizer()
# Far from what a test waits for: a request that is not aborted is still running then.
ENDLESS = 1500


@dataclass
class Stack(EngineLeftovers):
    engine: AsyncEngine
    runner: FakeModelRunner
    tinker: TinkerService | None

    def app(self) -> Litestar:
        return create_app(self.engine, MODEL, HttpServices(tinker=self.tinker))


def fake_stack(
    checkpoints: Path | None = None,
    *,
    reply: str = "Paris is the capital.",
    endless: bool = False,
    step_latency_s: float = 0.0,
    **config: Any,
) -> Stack:
    """The engine on the fake runner; ``endless``: every request generates until
    ``max_tokens`` (no EOS); ``checkpoints``: also the toy Tinker backend, stored there."""
    runner = FakeModelRunner(
        script=reply_script(TOKENIZER, reply, then_eos=not endless),
        step_latency_s=step_latency_s,
    )
    engine = fake_async_engine(runner, tokenizer=TOKENIZER, **{"max_model_len": 2048, **config})
    tinker = None
    if checkpoints is not None:
        backend = ToyBackend(TINKER_BASE_MODEL)
        tinker = TinkerService(
            backend, backend, FileCheckpointStorage(checkpoints), long_poll_s=0.2
        )
    return Stack(engine, runner, tinker)


@dataclass
class Served:
    server: LimitedServer
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def connect(self, timeout_s: float = 5.0) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=timeout_s)
        return sock

    @property
    def open_connections(self) -> int:
        return len(self.server.server_state.connections)


@contextmanager
def serving(app: Litestar, limits: ConnectionLimits | None = None) -> Iterator[Served]:
    """``app`` under a real uvicorn server (``adapters.http.uvicorn_server``'s) on 127.0.0.1."""
    config = server_config(app, "127.0.0.1", 0, limits or ConnectionLimits(), log_level="warning")
    server = LimitedServer(config)
    with running(server) as started:
        yield Served(server, started.port)


def read_until_closed(sock: socket.socket, timeout_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and how long it took
    (``timeout_s`` at most: then the connection was still open)."""
    start = time.monotonic()
    sock.settimeout(0.1)
    data = b""
    while time.monotonic() - start < timeout_s:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionError:
            break
        if not chunk:
            break
        data += chunk
    return data, time.monotonic() - start


def status_of(raw: bytes) -> int | None:
    """The status code of a raw HTTP/1.1 response (None: no response)."""
    if not raw.startswith(b"HTTP/1.1 "):
        return None
    return int(raw.split(b" ", 2)[1])


def json_body(raw: bytes) -> Any:
    return json.loads(raw.split(b"\r\n\r\n", 1)[1])


def reset(sock: socket.socket) -> None:
    """Close with a TCP reset (SO_LINGER 0), as a client killed mid-request does."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()
