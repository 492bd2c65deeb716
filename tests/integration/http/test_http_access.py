"""API keys, tenants and limits on the HTTP faces (fake runner, through the composition
root): 401 / 403 / 429 in each face's own format, rate-limit headers, the tenant reaching
the engine, key rotation, and the Tinker face's keys from the same file."""

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from dependency_injector import providers
from litestar.testing import TestClient

from adapters.fake import ByteTokenizer
from adapters.fake.observer import RecordingObserver
from adapters.fake.runner import FakeModelRunner, reply_script
from adapters.storage.keys_file import KeysFileError, load_keyring
from application.access.keys import hash_key
from entrypoints.config.tinker import TinkerSettings
from tests.fakes import fake_container

TOY_TINKER = TinkerSettings(enabled=True, training_backend="toy")
KEYS = {"alice": "sk-alice", "bob": "sk-bob", "tinker-only": "tml-trainer", "narrow": "sk-n"}


def keys_file(tmp_path: Path, **overrides: dict[str, Any]) -> Path:
    tenants = [
        {"id": "alice", "keys": [hash_key(KEYS["alice"])], "requests_per_second": 50},
        {"id": "bob", "keys": [hash_key(KEYS["bob"])], "tokens_per_minute": 60, "weight": 3},
        {"id": "tinker-only", "keys": [hash_key(KEYS["tinker-only"])], "faces": ["tinker"]},
        {"id": "narrow", "keys": [hash_key(KEYS["narrow"])], "models": ["another-model"]},
    ]
    for tenant in tenants:
        tenant.update(overrides.get(str(tenant["id"]), {}))
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"tenants": tenants}))
    return path


def client_for(
    tmp_path: Path, path: Path, step_latency_s: float = 0.0, **kwargs: Any
) -> tuple[TestClient, Any]:
    script = reply_script(ByteTokenizer(), "ok" * 10)
    runner = FakeModelRunner(script=script, step_latency_s=step_latency_s)
    container = fake_container(runner, cache_dir=str(tmp_path), api_keys_file=str(path), **kwargs)
    observer = RecordingObserver()
    container.observer.override(providers.Object(observer))
    return TestClient(app=container.http_app()), (container, observer)  # type: ignore[arg-type]


def bearer(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name]}"}


def complete(client: TestClient, headers: dict[str, str], **body: Any) -> Any:
    return client.post(
        "/v1/completions",
        json={"model": "fake", "prompt": "Hi", "max_tokens": 4, **body},
        headers=headers,
    )


def test_keys_are_required_and_answered_in_openai_format(tmp_path: Path) -> None:
    client, _ = client_for(tmp_path, keys_file(tmp_path))
    with client:
        missing = complete(client, {})
        assert missing.status_code == 401
        error = missing.json()["error"]
        assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_api_key")
        assert complete(client, {"Authorization": "Bearer sk-nobody"}).status_code == 401
        assert client.get("/v1/models").status_code == 401
        ok = complete(client, bearer("alice"))
        assert ok.status_code == 200, ok.text
        assert ok.headers["x-ratelimit-limit-requests"] == "50"
        assert ok.headers["x-ratelimit-remaining-requests"] == "49"
        assert complete(client, {"X-API-Key": KEYS["alice"]}).status_code == 200
        # /health, /ready and /metrics stay open (probes and scrapers carry no key).
        assert client.get("/health").status_code == 200
        assert client.get("/metrics").status_code == 200


def test_a_face_or_model_out_of_scope_is_a_403(tmp_path: Path) -> None:
    client, _ = client_for(tmp_path, keys_file(tmp_path))
    with client:
        face = complete(client, {"Authorization": f"Bearer {KEYS['tinker-only']}"})
        assert face.status_code == 403
        assert face.json()["error"]["type"] == "permission_error"
        model = complete(client, bearer("narrow"))
        assert model.status_code == 403 and "fake" in model.json()["error"]["message"]
        assert client.get("/v1/models", headers=bearer("narrow")).json()["data"] == []
        native = client.post(
            "/v1/generate", json={"model": "fake", "prompt": "Hi"}, headers=bearer("narrow")
        )
        assert native.status_code == 403
        assert client.post("/v1/generate", json={"model": "fake", "prompt": "Hi"}).status_code == (
            401
        )


def test_tokens_per_minute_give_a_429_with_retry_after_and_headers(tmp_path: Path) -> None:
    client, _ = client_for(tmp_path, keys_file(tmp_path))
    with client:
        # Bob may use 60 tokens a minute: prompt (3) + max_tokens are reserved.
        first = complete(client, bearer("bob"), max_tokens=30)
        assert first.status_code == 200, first.text
        used = first.json()["usage"]["total_tokens"]
        # What the first did not use came back: 60 - used are left.
        assert used < 33
        refused = complete(client, bearer("bob"), max_tokens=60 - used)  # + 3 prompt: over
        assert refused.status_code == 429
        error = refused.json()["error"]
        assert (error["type"], error["code"]) == ("tokens", "rate_limit_exceeded")
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.headers["x-ratelimit-remaining-tokens"] == str(60 - used)
        fits = complete(client, bearer("bob"), max_tokens=60 - used - 3)
        assert fits.status_code == 200, fits.text


def test_requests_per_second_and_concurrent_streams(tmp_path: Path) -> None:
    path = keys_file(
        tmp_path,
        alice={"requests_per_second": 2},
        bob={"max_concurrent_streams": 1, "tokens_per_minute": None},
    )
    # Bob's "tokens_per_minute": None is written as null: the file must not have it.
    data = json.loads(path.read_text())
    data["tenants"][1].pop("tokens_per_minute")
    path.write_text(json.dumps(data))
    client, _ = client_for(tmp_path, path, step_latency_s=0.1)
    with client:
        codes = [complete(client, bearer("alice")).status_code for _ in range(3)]
        assert codes == [200, 200, 429]
        # Bob: one request in progress at a time (the fake runner takes 0.1 s a step).
        first: list[Any] = []
        thread = threading.Thread(
            target=lambda: first.append(complete(client, bearer("bob"), max_tokens=8))
        )
        thread.start()
        time.sleep(0.3)
        second = complete(client, bearer("bob"))
        thread.join()
        assert first[0].status_code == 200
        assert second.status_code == 429
        assert second.json()["error"]["type"] == "streams"
        assert complete(client, bearer("bob")).status_code == 200


def test_the_tenant_reaches_the_engine_with_its_priority(tmp_path: Path) -> None:
    path = keys_file(tmp_path, alice={"weight": 3})
    client, (container, observer) = client_for(tmp_path, path)
    with client:
        response = client.post(
            "/v1/chat/completions",
            json={
                "model": "fake",
                "messages": [{"role": "user", "content": "Hi"}],
                "metadata": {"priority": "-5"},
            },
            headers=bearer("alice"),
        )
        assert response.status_code == 200, response.text
    [start] = [s for stats in observer.steps for s in stats.started]
    assert (start.context.tenant_id, start.context.priority) == ("alice", 5)
    scheduler = container.engine().scheduler
    assert scheduler.tenant_weight("alice") == 3.0


def test_keys_rotate_without_a_restart(tmp_path: Path) -> None:
    client, (container, _) = client_for(tmp_path, keys_file(tmp_path))
    with client:
        assert complete(client, bearer("alice")).status_code == 200
        rotated = keys_file(tmp_path, alice={"keys": [hash_key("sk-alice-2")]})
        container.access().replace(load_keyring(rotated), str(rotated))
        assert complete(client, bearer("alice")).status_code == 401
        assert complete(client, {"Authorization": "Bearer sk-alice-2"}).status_code == 200


def test_the_tinker_face_takes_the_keys_file_tenants(tmp_path: Path) -> None:
    client, _ = client_for(tmp_path, keys_file(tmp_path), tinker=TOY_TINKER)
    with client:
        ok = client.get("/api/v1/training_runs", headers={"X-API-Key": "tml-trainer"})
        assert ok.status_code == 200, ok.text
        other = client.get("/api/v1/training_runs", headers={"X-API-Key": "tml-not-a-key"})
        assert other.status_code == 401
        # Faces default to openai and tinker: alice's key works here too.
        alice = client.get("/api/v1/training_runs", headers={"X-API-Key": "sk-alice"})
        assert alice.status_code == 200
    client, _ = client_for(
        tmp_path,
        keys_file(tmp_path, alice={"faces": ["openai"]}),
        tinker=TOY_TINKER,
    )
    with client:
        refused = client.get("/api/v1/training_runs", headers={"X-API-Key": "sk-alice"})
        assert refused.status_code == 403


@pytest.mark.parametrize(
    ("tenants", "message"),
    [
        ([{"id": "a", "keys": ["plain-key"]}], "sha256"),
        ([{"id": "a", "keys": [hash_key("k")], "color": "red"}], "unknown field 'color'"),
        ([{"id": "a", "keys": [hash_key("k")]}, {"id": "a", "keys": [hash_key("j")]}], "twice"),
        ([{"id": "a", "keys": [hash_key("k")], "faces": ["ftp"]}], "faces"),
        ([{"id": "a", "keys": [hash_key("k")], "tokens_per_minute": 0}], "tokens_per_minute"),
        ([{"id": "a", "keys": [hash_key("k")]}, {"id": "b", "keys": [hash_key("k")]}], "twice"),
    ],
)
def test_a_bad_keys_file_is_refused_naming_the_problem(
    tmp_path: Path, tenants: list[dict[str, Any]], message: str
) -> None:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"tenants": tenants}))
    with pytest.raises(KeysFileError, match=message):
        load_keyring(path)


def test_a_toml_keys_file_loads(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(
        f'[[tenants]]\nid = "acme"\nkeys = ["{hash_key("sk-a")}"]\nweight = 2.5\n'
        'requests_per_minute = 10\nmodels = ["m"]\n'
    )
    keyring = load_keyring(path)
    acme = keyring.tenant("sk-a")
    assert acme is not None and acme.id == "acme" and acme.weight == 2.5
    assert acme.limits.requests_per_minute == 10 and acme.models == frozenset({"m"})
    assert keyring.tenant("sk-b") is None


def test_infer_key_prints_a_key_and_its_stored_form(capsys: pytest.CaptureFixture[str]) -> None:
    from entrypoints.cli import main

    assert main(["key"]) == 0
    key_line, hash_line = capsys.readouterr().out.splitlines()
    key = key_line.removeprefix("key: ")
    assert key.startswith("sk-infer-") and len(key) > 40
    assert hash_line == f'keys = ["{hash_key(key)}"]'
    assert main(["key", "sk-given"]) == 0
    assert capsys.readouterr().out.strip() == f'keys = ["{hash_key("sk-given")}"]'
