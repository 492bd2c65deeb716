"""Fixtures of the Tinker API tests: over raw HTTP, the module's own ``service`` fixture
under Litestar's test client (``client``) and raw calls through it (``api``); a tiny random
Llama saved once per module for the real backends (``tiny_model``)."""

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from litestar.testing import TestClient

from application.tinker.service import TinkerService
from tests.support.tinker_client import Api
from tests.support.tinker_server import tinker_app, toy_service
from tests.support.tiny_models import save_tiny_model


@pytest.fixture
def service(tmp_path: Path) -> TinkerService:
    return toy_service(tmp_path)


@pytest.fixture
def client(service: TinkerService) -> Iterator[TestClient[Any]]:
    with TestClient(tinker_app(service)) as test_client:
        yield test_client


@pytest.fixture
def api(client: TestClient[Any]) -> Api:
    return Api(client)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_model("llama", folder)
    return folder
