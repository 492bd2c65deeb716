"""Fixtures of the end-to-end tests: the openai SDK against the module's own ``base_url``
fixture (a real ``infer serve`` process)."""

import openai
import pytest

from tests.e2e.browser import browser  # noqa: F401  (the web console's browser tests)


@pytest.fixture
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
