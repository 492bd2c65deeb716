"""Fixtures of the port contract tests: a real PostgreSQL server for the stores held
against one (skipped where its binaries are missing)."""

from collections.abc import Iterator

import pytest

from tests.support.postgres import postgres_bin, postgres_server


@pytest.fixture(scope="module")
def postgres_url() -> Iterator[str]:
    if postgres_bin() is None:
        pytest.skip("no PostgreSQL binaries (apt install postgresql; make test does)")
    with postgres_server() as url:
        yield url
