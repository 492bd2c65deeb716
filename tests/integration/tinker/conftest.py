"""Fixtures of the Tinker API tests over raw HTTP: the module's own ``service`` fixture
under Litestar's test client (``client``), and raw calls through it (``api``)."""

from collections.abc import Iterator
from typing import Any

import pytest
from litestar.testing import TestClient

from application.tinker.service import TinkerService
from tests.support.tinker_client import Api
from tests.support.tinker_server import tinker_app


@pytest.fixture
def client(service: TinkerService) -> Iterator[TestClient[Any]]:
    with TestClient(tinker_app(service)) as test_client:
        yield test_client


@pytest.fixture
def api(client: TestClient[Any]) -> Api:
    return Api(client)
