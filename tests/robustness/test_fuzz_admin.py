"""Hostile bodies and query strings against the fleet endpoints (the fake model through
the composition root, a keys file and a SQLite usage database): ``PUT /admin/tenants/{id}``
and ``/admin/rollouts/{name}``, the usage API and the audit trail — never a 5xx, errors in
OpenAI's schema, and the keys file always readable afterwards."""

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from litestar.testing import TestClient

from adapters.fake import ByteTokenizer
from adapters.fake.runner import FakeModelRunner, reply_script
from adapters.storage.keys_file import load_entries
from application.access.keys import hash_key
from entrypoints.config.access import AccessSettings
from entrypoints.config.model import ModelSettings
from tests.fakes import fake_container
from tests.robustness.fuzz import (
    NASTY_NUMBERS,
    NASTY_STRINGS,
    Payload,
    assert_error_format,
    payloads,
)

ADMIN = {"Authorization": "Bearer sk-ops"}
TENANT_BODY: dict[str, Any] = {
    "faces": ["openai"],
    "models": ["v1"],
    "weight": 2,
    "requests_per_minute": 10,
    "tokens_per_day": 1000,
}
TENANT_PATHS = [("faces",), ("faces", 0), ("models",), ("models", 0), ("weight",)] + [
    (name,) for name in ("requests_per_minute", "tokens_per_day", "max_concurrent_streams")
]
ROLLOUT_BODY: dict[str, Any] = {
    "targets": [{"model": "v1", "weight": 90}, {"model": "v2", "weight": 10, "tenants": ["b"]}],
    "rollback": {"max_error_rate": 0.5, "min_requests": 5, "window": 10},
}
ROLLOUT_PATHS = [
    ("targets",),
    ("targets", 0),
    ("targets", 0, "model"),
    ("targets", 0, "weight"),
    ("targets", 1, "tenants"),
    ("rollback",),
    ("rollback", "max_error_rate"),
    ("rollback", "window"),
]
QUERY_VALUES = NASTY_STRINGS | NASTY_NUMBERS.map(str) | st.text(max_size=8) | st.integers().map(str)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, Path]]:
    folder = tmp_path_factory.mktemp("fleet-fuzz")
    keys = folder / "keys.toml"
    keys.write_text(
        f'[[tenants]]\nid = "ops"\nkeys = ["{hash_key("sk-ops")}"]\nfaces = ["admin"]\n'
    )
    access = AccessSettings(api_keys_file=str(keys), usage_db=str(folder / "usage.sqlite3"))
    container = fake_container(
        FakeModelRunner(script=reply_script(ByteTokenizer(), "ok")),
        cache_dir=str(folder),
        served_model_name="base",
        model=ModelSettings(aliases=("v1", "v2")),
        access=access,
    )
    with TestClient(app=container.http_app()) as client:
        yield client, keys


def answered(path: str, status: int, text: str) -> None:
    assert status < 500, (status, text[:500])
    if status >= 400:
        assert_error_format(path, status, text)


def put_answered(client: TestClient, path: str, payload: Payload) -> Any:
    """``PUT path`` of the fuzzed ``payload`` with the admin key, answered without a 5xx
    and any error in the face's format; the response."""
    answer = client.put(path, content=payload.content, headers=payload.headers(ADMIN))
    answered(path, answer.status_code, answer.text)
    return answer


@given(payload=payloads(TENANT_BODY, TENANT_PATHS))
def test_fuzzed_tenant_bodies(served: tuple[TestClient, Path], payload: Payload) -> None:
    client, keys = served
    put_answered(client, "/admin/tenants/acme", payload)
    assert next(e.tenant.id for e in load_entries(keys)) == "ops"  # the file still reads


@given(payload=payloads(ROLLOUT_BODY, ROLLOUT_PATHS))
def test_fuzzed_rollout_bodies(served: tuple[TestClient, Path], payload: Payload) -> None:
    client, _ = served
    answer = put_answered(client, "/admin/rollouts/support", payload)
    if answer.status_code == 200:  # whatever was accepted serves
        chat = client.post(
            "/v1/chat/completions",
            json={"model": "support", "messages": [{"role": "user", "content": "hi"}]},
            headers=ADMIN,
        )
        assert chat.status_code < 500, chat.text


@given(
    params=st.dictionaries(
        st.sampled_from(
            ["start_time", "end_time", "bucket_width", "group_by", "limit", "page", "models"]
        ),
        QUERY_VALUES,
        max_size=5,
    )
)
def test_fuzzed_usage_queries(served: tuple[TestClient, Path], params: dict[str, str]) -> None:
    client, _ = served
    path = "/v1/organization/usage/completions"
    answer = client.get(path, params=_safe(params), headers=ADMIN)
    answered(path, answer.status_code, answer.text)


@given(
    params=st.dictionaries(st.sampled_from(["since", "until", "limit"]), QUERY_VALUES, max_size=3)
)
def test_fuzzed_audit_queries(served: tuple[TestClient, Path], params: dict[str, str]) -> None:
    client, _ = served
    answer = client.get("/admin/audit", params=_safe(params), headers=ADMIN)
    answered("/admin/audit", answer.status_code, answer.text)
    if answer.status_code == 200:
        json.loads(answer.text)


def _safe(params: dict[str, str]) -> dict[str, str]:
    """Query values as a client can send them (lone surrogates cannot be encoded)."""
    return {k: v.encode("utf-8", "replace").decode() for k, v in params.items()}
