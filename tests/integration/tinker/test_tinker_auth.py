"""The API-key guard on the Tinker face: which routes need a key, that the key is checked
before anything else, and that tenants see only their own resources."""

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from litestar.testing import TestClient

from tests.support.tinker_client import model_body
from tests.support.tinker_server import tinker_app, toy_service

OPEN = {"/api/v1/healthz", "/api/v1/client/config", "/api/v1/get_server_capabilities",
        "/api/v1/telemetry", "/api/v1/client/dynamic_config"}  # fmt: skip
SIGNED = {"/api/v1/session_traces/s"}  # a signed link: the signature is the permission


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient[Any]]:
    with TestClient(app=tinker_app(toy_service(tmp_path))) as client:
        yield client


def routes(client: TestClient[Any]) -> list[tuple[str, str]]:
    """(method, path) of every Tinker route, path parameters filled in."""
    found = []
    for route in client.app.routes:
        if not route.path.startswith("/api/v1/"):
            continue
        path = (
            route.path.replace("{session_id:str}", "s")
            .replace("{sampler_id:str}", "s")
            .replace("{run_id:str}", "r")
            .replace("{rest:path}", "weights/x")
        )
        for method in sorted(getattr(route, "methods", ())):
            if method not in ("HEAD", "OPTIONS"):
                found.append((method, path))
    return found


def test_every_route_but_the_open_ones_needs_a_key_checked_first(client: TestClient[Any]) -> None:
    checked = 0
    for method, path in routes(client):
        response = client.request(method, path, content=b"not json")
        if path in OPEN:
            assert response.status_code == 200, (method, path, response.text)
            continue
        if path in SIGNED:
            assert response.status_code == 403, (method, path, response.text)
            continue
        # No key: 401 before the (malformed) body or the (unknown) ids are looked at.
        assert response.status_code == 401, (method, path, response.text)
        assert response.json()["category"] == "user"
        checked += 1
    assert checked >= 25


def test_a_signed_download_link_needs_no_key_but_a_signature(client: TestClient[Any]) -> None:
    response = client.get("/api/v1/training_runs/r/checkpoints/weights/x/files/a.bin")
    assert response.status_code == 404  # no such checkpoint: not a 401


def test_tenants_see_only_their_own(client: TestClient[Any]) -> None:
    alice, bob = {"X-API-Key": "tml-alice"}, {"Authorization": "Bearer tml-bob"}
    session = client.post("/api/v1/create_session", json={}, headers=alice).json()["session_id"]
    created = client.post("/api/v1/create_model", json=model_body(session), headers=alice).json()
    model_id, request_id = created["model_id"], created["request_id"]
    assert client.get(f"/api/v1/sessions/{session}", headers=alice).status_code == 200
    for method, path, body in [
        ("GET", f"/api/v1/sessions/{session}", None),
        ("POST", "/api/v1/session_heartbeat", {"session_id": session}),
        ("POST", "/api/v1/get_info", {"model_id": model_id}),
        ("POST", "/api/v1/retrieve_future", {"request_id": request_id}),
        ("GET", f"/api/v1/training_runs/{model_id}", None),
        ("POST", "/api/v1/unload_model", {"model_id": model_id}),
    ]:
        response = client.request(method, path, json=body, headers=bob)
        assert response.status_code == 404, (path, response.text)
    assert client.get("/api/v1/sessions", headers=bob).json()["sessions"] == []
    assert client.get("/api/v1/sessions", headers=alice).json()["sessions"] == [session]
    # The same key as a bearer token is the same tenant.
    bearer = {"Authorization": "Bearer tml-alice"}
    assert client.get(f"/api/v1/sessions/{session}", headers=bearer).status_code == 200
