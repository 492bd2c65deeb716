"""Tenants and API keys at run time, ``/admin/tenants`` through the composition root (fake
runner): create a tenant, mint its key (shown once, stored hashed), change its limits,
revoke the key, delete the tenant — each applied at once, written to the keys file (TOML
or JSON, read back by a fresh server), audited; admin keys only; no lock-out; errors in
OpenAI's format; a change made by another process is picked up by the file watch."""

import json
import tomllib
from pathlib import Path
from typing import Any

import pytest
from litestar.testing import TestClient

from adapters.fake import ByteTokenizer
from adapters.fake.runner import FakeModelRunner, reply_script
from adapters.storage.keys_file import KeysFileStore, load_entries
from application.access.keys import hash_key
from application.access.tenant_admin import key_id
from domain.tenancy import Tenant, TenantEntry
from entrypoints.config.access import AccessSettings
from entrypoints.config.model import ModelSettings
from tests.fakes import fake_container
from tests.support.json_logs import json_log_stream

OPS = "sk-ops"
TENANTS = "/admin/tenants"
OPS_LINE = f'''[[tenants]]
id = "ops"
keys = ["{hash_key(OPS)}"]
faces = ["openai", "admin"]
'''


def keys_file(tmp_path: Path, suffix: str = ".toml") -> Path:
    path = tmp_path / f"keys{suffix}"
    if suffix == ".json":
        tenants = [{"id": "ops", "keys": [hash_key(OPS)], "faces": ["openai", "admin"]}]
        path.write_text(json.dumps({"tenants": tenants}))
    else:
        path.write_text("# the operator's notes\n" + OPS_LINE)
    return path


def client_for(path: Path | None) -> TestClient:
    runner = FakeModelRunner(script=reply_script(ByteTokenizer(), "ok"))
    access = AccessSettings(api_keys_file=None if path is None else str(path))
    container = fake_container(
        runner, cache_dir=str(path.parent if path else "/tmp"), access=access
    )
    return TestClient(app=container.http_app())


def ops() -> dict[str, str]:
    return {"Authorization": f"Bearer {OPS}"}


def complete(client: TestClient, key: str) -> Any:
    return client.post(
        "/v1/completions",
        json={"model": "fake", "prompt": "Hi", "max_tokens": 2},
        headers={"Authorization": f"Bearer {key}"},
    )


@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_a_tenants_life_through_the_admin_api(tmp_path: Path, suffix: str) -> None:
    path = keys_file(tmp_path, suffix)
    with client_for(path) as client:
        made = client.put(
            f"{TENANTS}/acme", json={"models": ["fake"], "requests_per_minute": 2}, headers=ops()
        )
        assert made.status_code == 201, made.text
        assert made.json() == {
            "object": "tenant",
            "id": "acme",
            "faces": ["openai", "tinker"],
            "admin": False,
            "models": ["fake"],
            "weight": 1.0,
            "limits": {
                "requests_per_second": None,
                "requests_per_minute": 2,
                "tokens_per_minute": None,
                "max_concurrent_streams": None,
                "requests_per_day": None,
                "tokens_per_day": None,
                "max_output_tokens": None,
            },
            "keys": [],
        }
        minted = client.post(f"{TENANTS}/acme/keys", headers=ops())
        assert minted.status_code == 201, minted.text
        key, kid = minted.json()["key"], minted.json()["id"]
        assert key.startswith("sk-infer-") and kid == key_id(hash_key(key))
        # The key works at once, under the tenant's limits.
        assert complete(client, key).status_code == 200
        assert complete(client, key).status_code == 200
        assert complete(client, key).status_code == 429
        # Its limit raised: applies at once (the window so far counted).
        raised = client.put(f"{TENANTS}/acme", json={"requests_per_minute": 10}, headers=ops())
        assert raised.status_code == 200 and raised.json()["keys"] == [{"id": kid}]
        assert complete(client, key).status_code == 200
        listed = client.get(TENANTS, headers=ops()).json()
        assert [t["id"] for t in listed["data"]] == ["ops", "acme"]
        assert key not in json.dumps(listed)  # listed by id only, never the key or its hash
        assert hash_key(key) not in json.dumps(listed)
        # The file holds the digest, never the key; another reader sees the tenant.
        text = path.read_text()
        assert hash_key(key) in text and key not in text
        (_, acme) = load_entries(path)
        assert acme.tenant.limits.requests_per_minute == 10 and acme.keys == (hash_key(key),)
        if suffix == ".toml":
            assert tomllib.loads(text)["tenants"][1]["id"] == "acme"
        # Revoked: refused at once.
        revoked = client.delete(f"{TENANTS}/acme/keys/{kid}", headers=ops())
        assert revoked.json() == {"object": "api_key.deleted", "id": kid, "deleted": True}
        assert complete(client, key).status_code == 401
        assert client.delete(f"{TENANTS}/acme/keys/{kid}", headers=ops()).status_code == 404
        gone = client.delete(f"{TENANTS}/acme", headers=ops())
        assert gone.json() == {"object": "tenant.deleted", "id": "acme", "deleted": True}
        assert client.get(f"{TENANTS}/acme", headers=ops()).status_code == 404
    # A fresh server reads what the admin API wrote.
    with client_for(path) as client:
        assert [t["id"] for t in client.get(TENANTS, headers=ops()).json()["data"]] == ["ops"]


def test_only_admin_keys_and_no_lock_out(tmp_path: Path) -> None:
    path = keys_file(tmp_path)
    with client_for(path) as client:
        client.put(f"{TENANTS}/acme", json={}, headers=ops())
        key = client.post(f"{TENANTS}/acme/keys", headers=ops()).json()["key"]
        assert client.get(TENANTS).status_code == 401
        refused = client.put(
            f"{TENANTS}/acme",
            json={"faces": ["openai", "admin"]},
            headers={"Authorization": f"Bearer {key}"},
        )
        assert refused.status_code == 403
        assert refused.json()["error"]["type"] == "permission_error"
        # The last admin cannot lose its face, its key or its tenant.
        for method, url, body in [
            ("PUT", f"{TENANTS}/ops", {"faces": ["openai"]}),
            ("DELETE", f"{TENANTS}/ops/keys/{key_id(hash_key(OPS))}", None),
            ("DELETE", f"{TENANTS}/ops", None),
        ]:
            answer = client.request(method, url, json=body, headers=ops())
            assert answer.status_code == 400, (method, url, answer.text)
            assert "locked out" in answer.json()["error"]["message"]
        assert complete(client, OPS).status_code == 200


def test_bad_bodies_and_ids_are_400s(tmp_path: Path) -> None:
    path = keys_file(tmp_path)
    before = path.read_text()
    with client_for(path) as client:
        for body, param in [
            ({"faces": ["root"]}, "faces"),
            ({"weight": 0}, "weight"),
            ({"requests_per_minute": 0}, "requests_per_minute"),
            ({"tokens_per_day": -5}, "tokens_per_day"),
            ({"colour": "red"}, "colour"),
            ({"weight": "heavy"}, "weight"),
        ]:
            answer = client.put(f"{TENANTS}/acme", json=body, headers=ops())
            assert answer.status_code == 400, (body, answer.text)
            assert answer.json()["error"]["param"] == param, body
        long_id = "x" * 129
        assert client.put(f"{TENANTS}/{long_id}", json={}, headers=ops()).status_code == 400
        assert client.post(f"{TENANTS}/nobody/keys", headers=ops()).status_code == 404
    assert path.read_text() == before  # nothing written


def test_without_a_keys_file_the_api_says_how_to_get_one(tmp_path: Path) -> None:
    with client_for(None) as client:
        answer = client.get(TENANTS)
        assert answer.status_code == 409
        assert "--api-keys-file" in answer.json()["error"]["message"]


def test_another_processs_change_is_picked_up(tmp_path: Path) -> None:
    path = keys_file(tmp_path)
    runner = FakeModelRunner(script=reply_script(ByteTokenizer(), "ok"))
    access = AccessSettings(api_keys_file=str(path))
    container = fake_container(runner, cache_dir=str(tmp_path), access=access)
    with TestClient(app=container.http_app()) as client:
        admin = container.tenant_admin()
        assert not admin.reload_if_changed()  # nothing changed since it started
        # Another server (its own store on the same file) adds a tenant and its key.
        other = KeysFileStore(path)
        other.update(lambda entries: [*entries, TenantEntry(Tenant("zed"), (hash_key("sk-z"),))])
        assert complete(client, "sk-z").status_code == 401  # not seen here yet
        assert admin.reload_if_changed()  # what the watch does every 2 s
        assert complete(client, "sk-z").status_code == 200
        # A broken file keeps the keys in use.
        path.write_text("[[tenants]\n")
        assert admin.reload_if_changed()
        assert complete(client, "sk-z").status_code == 200


def test_every_change_is_audited(tmp_path: Path) -> None:
    path = keys_file(tmp_path)
    with json_log_stream() as stream, client_for(path) as client:
        client.put(f"{TENANTS}/acme", json={"tokens_per_day": 100}, headers=ops())
        kid = client.post(f"{TENANTS}/acme/keys", headers=ops()).json()["id"]
        client.delete(f"{TENANTS}/acme/keys/{kid}", headers=ops())
        client.delete(f"{TENANTS}/acme", headers=ops())
    lines = [json.loads(line) for line in stream.getvalue().splitlines() if line.startswith("{")]
    events = [
        (line["event"], line.get("actor"))
        for line in lines
        if line.get("logger") == "infer.audit" and line.get("tenant") == "acme"
    ]
    assert events == [
        ("tenant created", "ops"),
        ("api key created", "ops"),
        ("api key revoked", "ops"),
        ("tenant deleted", "ops"),
    ]
    created = next(line for line in lines if line.get("event") == "tenant created")
    assert created["limits"] == {"tokens_per_day": 100}
    assert "sk-infer-" not in stream.getvalue()  # a minted key is never logged


def test_the_audit_trail_lists_every_change_and_survives_a_restart(tmp_path: Path) -> None:
    path = keys_file(tmp_path)
    db = str(tmp_path / "usage.sqlite3")

    def server() -> TestClient:
        runner = FakeModelRunner(script=reply_script(ByteTokenizer(), "ok"))
        access = AccessSettings(api_keys_file=str(path), usage_db=db)
        model = ModelSettings(aliases=("v1", "v2"))
        container = fake_container(
            runner, cache_dir=str(tmp_path), access=access, model=model, served_model_name="b"
        )
        return TestClient(app=container.http_app())

    with server() as client:
        client.put(f"{TENANTS}/acme", json={"tokens_per_day": 100}, headers=ops())
        minted = client.post(f"{TENANTS}/acme/keys", headers=ops()).json()
        rollout = {"targets": [{"model": "v1", "weight": 1}]}
        client.put("/admin/rollouts/support", json=rollout, headers=ops())
        client.delete("/admin/rollouts/support", headers=ops())
    with server() as client:
        answer = client.get("/admin/audit", headers=ops())
        assert answer.status_code == 200, answer.text
        body = answer.json()
        events = [(e["event"], e["actor"], e["subject"]) for e in body["data"]]
        assert events[:4] == [
            ("rollout removed", "ops", "rollout:support"),
            ("rollout set", "ops", "rollout:support"),
            ("api key created", "ops", "tenant:acme"),
            ("tenant created", "ops", "tenant:acme"),
        ]
        assert body["data"][2]["details"]["key_id"] == minted["id"]
        assert minted["key"] not in answer.text  # a key itself never
        assert body["data"][3]["details"]["limits"] == {"tokens_per_day": 100}
        assert body["has_more"] is False
        two = client.get("/admin/audit", params={"limit": 2}, headers=ops()).json()
        assert len(two["data"]) == 2 and two["has_more"] is True
        newest = body["data"][0]["at"]
        later = client.get("/admin/audit", params={"since": newest + 1}, headers=ops()).json()
        assert later["data"] == []
        for params in ({"limit": 0}, {"limit": 1.5}, {"since": "yesterday"}, {"until": "inf"}):
            bad = client.get("/admin/audit", params=params, headers=ops())
            assert bad.status_code == 400, params
        key = minted["key"]
        assert (
            client.get("/admin/audit", headers={"Authorization": f"Bearer {key}"}).status_code
            == 403
        )
        assert client.get("/admin/audit").status_code == 401


def test_a_keys_file_broken_by_hand_is_a_503_saying_so(tmp_path: Path) -> None:
    path = keys_file(tmp_path)
    with client_for(path) as client:
        path.write_text("[[tenants]\n")  # broken while the server runs: the old keys stay
        answer = client.put(f"{TENANTS}/acme", json={}, headers=ops())
        assert answer.status_code == 503, answer.text
        assert "keys file cannot be used" in answer.json()["error"]["message"]
        assert client.put(f"{TENANTS}/acme", json={"weight": 0}, headers=ops()).status_code == 400
        assert complete(client, OPS).status_code == 200  # the keys in use still work


def test_a_writer_killed_before_its_rename_leaves_nothing_in_the_way(tmp_path: Path) -> None:
    path = keys_file(tmp_path)
    stale = tmp_path / f".{path.name}.tmp-abc123"  # what a kill -9 mid-write leaves
    kept = tmp_path / f".{path.name}.bak"  # not ours: left alone
    kept.write_text("")
    stale.write_text("[[tenants]\n")
    (tmp_path / f"{path.name}.lock").write_text("")  # its lock file (the flock died with it)
    with client_for(path) as client:
        assert client.put(f"{TENANTS}/acme", json={}, headers=ops()).status_code == 201
    assert not stale.exists() and kept.exists()
    assert [e.tenant.id for e in load_entries(path)] == ["ops", "acme"]
