"""A uvicorn server run in a daemon thread for the length of a ``with`` block: requests really
reach it over sockets and run concurrently with the test."""

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import uvicorn


@dataclass
class Running:
    port: int
    thread: threading.Thread

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextmanager
def running(
    server: uvicorn.Server,
    *,
    target: Callable[[], object] | None = None,
    start_timeout_s: float | None = 15,
    stop_timeout_s: float = 15,
) -> Iterator[Running]:
    """``server`` serving in a daemon thread until the block ends (then it is told to exit
    and joined for ``stop_timeout_s``); yields the port it bound and the thread.

    ``target`` runs the server (default: ``asyncio.run(server.serve())``); a server that has
    not started within ``start_timeout_s`` (None: however long it takes), or whose thread
    ended first, fails the test."""
    thread = threading.Thread(target=target or (lambda: asyncio.run(server.serve())), daemon=True)
    thread.start()
    deadline = None if start_timeout_s is None else time.monotonic() + start_timeout_s
    while not server.started:
        alive = thread.is_alive() and (deadline is None or time.monotonic() < deadline)
        assert alive, "server failed to start"
        time.sleep(0.01)
    try:
        yield Running(server.servers[0].sockets[0].getsockname()[1], thread)
    finally:
        server.should_exit = True
        thread.join(timeout=stop_timeout_s)
