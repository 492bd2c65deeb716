"""Rollouts over HTTP, through the composition root (fake runner): ``/admin/rollouts``
(admin keys; list, read, set, move, pin tenants, roll back, remove; OpenAI-format errors;
an audit line per change), a rollout's name served as a model (its pick in the reply's
``model`` and ``x-infer-model``; sticky per ``user``; keys' model scopes), and each
target's requests in the metrics and in the usage API."""

import json
import time
from pathlib import Path
from typing import Any

from litestar.testing import TestClient

from adapters.fake import ByteTokenizer
from adapters.fake.runner import FakeModelRunner, reply_script
from application.access.keys import hash_key
from entrypoints.config.access import AccessSettings
from entrypoints.config.model import ModelSettings
from entrypoints.config.observability import ObservabilitySettings
from tests.fakes import fake_container
from tests.support.json_logs import json_log_stream

KEYS = {"ops": "sk-ops", "alice": "sk-alice", "beta": "sk-beta", "scoped": "sk-scoped"}
ROLLOUTS = "/admin/rollouts"


def keys_file(tmp_path: Path) -> str:
    tenants = [
        {"id": "ops", "keys": [hash_key(KEYS["ops"])], "faces": ["openai", "admin"]},
        {"id": "alice", "keys": [hash_key(KEYS["alice"])]},
        {"id": "beta", "keys": [hash_key(KEYS["beta"])]},
        {"id": "scoped", "keys": [hash_key(KEYS["scoped"])], "models": ["v1"]},
    ]
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"tenants": tenants}))
    return str(path)


def client_for(tmp_path: Path, *, keyed: bool = True, flags: tuple[str, ...] = ()) -> TestClient:
    from domain.rollout import parse_rollout

    runner = FakeModelRunner(script=reply_script(ByteTokenizer(), "ok"))
    access = AccessSettings(api_keys_file=keys_file(tmp_path) if keyed else None)
    model = ModelSettings(
        aliases=("v1", "v2"), rollouts=tuple(parse_rollout(spec) for spec in flags)
    )
    container = fake_container(
        runner,
        cache_dir=str(tmp_path),
        served_model_name="base",
        model=model,
        access=access,
        observability=ObservabilitySettings(metrics=True),
    )
    return TestClient(app=container.http_app())


def bearer(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name]}"}


def chat(
    client: TestClient, who: str | None, model: str = "support", user: str | None = None
) -> Any:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
    }
    if user is not None:
        body["user"] = user
    return client.post("/v1/chat/completions", json=body, headers=bearer(who) if who else {})


CANARY = {
    "targets": [{"model": "v1", "weight": 90}, {"model": "v2", "weight": 10, "tenants": ["beta"]}]
}


def test_a_canary_is_set_served_moved_and_rolled_back(tmp_path: Path) -> None:
    with client_for(tmp_path) as client:
        assert chat(client, "alice").status_code == 404  # no rollout yet
        put = client.put(f"{ROLLOUTS}/support", json=CANARY, headers=bearer("ops"))
        assert put.status_code == 200, put.text
        body = put.json()
        assert body["object"] == "rollout" and body["name"] == "support"
        nothing = {"requests": 0, "failed": 0, "error_rate": None}
        assert body["targets"] == [
            {"model": "v1", "weight": 90.0, "share": 0.9, "tenants": [], "recent": nothing},
            {"model": "v2", "weight": 10.0, "share": 0.1, "tenants": ["beta"], "recent": nothing},
        ]
        listed = client.get(ROLLOUTS, headers=bearer("ops")).json()
        assert [r["name"] for r in listed["data"]] == ["support"]
        assert client.get(f"{ROLLOUTS}/support", headers=bearer("ops")).json() == body
        for _ in range(3):
            chat(client, "beta")
        recent = client.get(f"{ROLLOUTS}/support", headers=bearer("ops")).json()["targets"]
        assert recent[1]["recent"] == {"requests": 3, "failed": 0, "error_rate": 0.0}
        # The pinned tenant always lands on the canary; the model that ran is named.
        for _ in range(5):
            reply = chat(client, "beta")
            assert reply.status_code == 200, reply.text
            assert reply.json()["model"] == "v2" and reply.headers["x-infer-model"] == "v2"
        # Others split by weight, each user sticking to one target.
        picks = {}
        for i in range(60):
            reply = chat(client, "alice", user=f"user-{i}")
            picks[f"user-{i}"] = reply.json()["model"]
            assert reply.headers["x-infer-model"] == picks[f"user-{i}"]
        assert set(picks.values()) == {"v1", "v2"}  # 60 users at 10 %: both all but surely
        assert all(chat(client, "alice", user=u).json()["model"] == m for u, m in picks.items())
        models = client.get("/v1/models", headers=bearer("alice")).json()
        assert "support" in [m["id"] for m in models["data"]]
        # Roll back: every request on v1, the pinned tenant included.
        back = {"targets": [{"model": "v1", "weight": 1}]}
        assert client.put(f"{ROLLOUTS}/support", json=back, headers=bearer("ops")).is_success
        assert {chat(client, "beta").json()["model"] for _ in range(5)} == {"v1"}
        # Removed: the name is gone.
        gone = client.delete(f"{ROLLOUTS}/support", headers=bearer("ops"))
        assert gone.json() == {"object": "rollout.deleted", "name": "support", "deleted": True}
        assert chat(client, "alice").status_code == 404
        missing = client.delete(f"{ROLLOUTS}/support", headers=bearer("ops"))
        assert missing.status_code == 404


def test_each_target_is_counted_in_metrics_and_usage(tmp_path: Path) -> None:
    with client_for(tmp_path, flags=("support=v1:1,v2:1",)) as client:
        served = [chat(client, "alice", user=f"u{i}").json()["model"] for i in range(20)]
        metrics = client.get("/metrics").text
        for target in ("v1", "v2"):
            line = (
                f'infer:rollout_requests_total{{code="200",model_name="base",'
                f'rollout="support",target="{target}"}} {float(served.count(target))}'
            )
            assert line in metrics, metrics[-2000:]
        assert 'infer:rollout_time_to_first_token_seconds_count{model_name="base"' in metrics
        usage = client.get(
            "/v1/organization/usage/completions",
            params={"start_time": int(time.time()) - 60, "group_by": "model"},
            headers=bearer("ops"),
        ).json()
        counted = {r["model"]: r["num_model_requests"] for b in usage["data"] for r in b["results"]}
        assert counted == {t: served.count(t) for t in ("v1", "v2")}


def test_only_admin_keys_change_rollouts_and_scopes_hold(tmp_path: Path) -> None:
    with client_for(tmp_path, flags=("support=v1:1,v2:1",)) as client:
        assert client.get(ROLLOUTS).status_code == 401
        refused = client.put(f"{ROLLOUTS}/x", json=CANARY, headers=bearer("alice"))
        assert refused.status_code == 403
        assert refused.json()["error"]["type"] == "permission_error"
        assert client.delete(f"{ROLLOUTS}/support", headers=bearer("alice")).status_code == 403
        # A key allowed only v1 may not use the rollout's name (whatever it would pick).
        assert chat(client, "scoped").status_code == 403
        assert chat(client, "scoped", model="v1").status_code == 200


def test_bad_rollouts_are_400s_naming_the_problem(tmp_path: Path) -> None:
    cases = [
        ({"targets": [{"model": "v9", "weight": 1}]}, "not a served model name"),
        ({"targets": []}, "1 to 16 targets"),
        ({"targets": [{"model": "v1", "weight": -1}]}, "0 or more"),
        ({"targets": [{"model": "v1", "weight": 0}]}, "not all be 0"),
        ({"targets": [{"model": "v1", "weight": 1, "share": 3}]}, "share"),
        ({"targets": "v1"}, "targets"),
        ({}, "targets"),
    ]
    with client_for(tmp_path, keyed=False) as client:
        for body, words in cases:
            answer = client.put(f"{ROLLOUTS}/support", json=body)
            assert answer.status_code == 400, (body, answer.text)
            error = answer.json()["error"]
            assert error["type"] == "invalid_request_error" and words in error["message"], body
        taken = client.put(f"{ROLLOUTS}/v1", json={"targets": [{"model": "v2", "weight": 1}]})
        assert taken.status_code == 400 and "served model's" in taken.json()["error"]["message"]
        broken = client.put(
            f"{ROLLOUTS}/support",
            content=b"{not json",
            headers={"content-type": "application/json"},
        )
        assert broken.status_code == 400
        assert client.get(ROLLOUTS).json()["data"] == []  # nothing was set


def test_every_change_writes_an_audit_line(tmp_path: Path) -> None:
    with json_log_stream() as stream, client_for(tmp_path) as client:
        client.put(f"{ROLLOUTS}/support", json=CANARY, headers=bearer("ops"))
        client.put(
            f"{ROLLOUTS}/support",
            json={"targets": [{"model": "v1", "weight": 1}]},
            headers=bearer("ops"),
        )
        client.delete(f"{ROLLOUTS}/support", headers=bearer("ops"))
    lines = [json.loads(line) for line in stream.getvalue().splitlines() if line.startswith("{")]
    audit = [line for line in lines if line.get("logger") == "infer.audit" and "rollout" in line]
    assert [a["event"] for a in audit] == ["rollout set", "rollout set", "rollout removed"]
    assert audit[0]["targets"] == {"v1": 90.0, "v2": 10.0} and audit[0]["before"] is None
    assert audit[0]["pinned"] == {"v2": ["beta"]} and audit[0]["actor"] == "ops"
    assert audit[1]["before"] == {"v1": 90.0, "v2": 10.0}


def test_a_failing_canary_is_rolled_back_by_itself(tmp_path: Path) -> None:
    """Requests with a long prompt fail in the engine: the tenant pinned to the canary
    sends them, the others' succeed on the baseline; at the policy's error rate the canary
    is taken out, its tenant served by the baseline, an audit line says so."""
    ok = reply_script(ByteTokenizer(), "ok")

    def script(request: Any) -> int:
        if len(request.prompt_token_ids) > 200:
            raise RuntimeError("the canary's weights are broken")
        return ok(request)

    access = AccessSettings(api_keys_file=keys_file(tmp_path))
    container = fake_container(
        FakeModelRunner(script=script),
        cache_dir=str(tmp_path),
        served_model_name="base",
        model=ModelSettings(aliases=("v1", "v2")),
        access=access,
    )
    policy = {"max_error_rate": 0.5, "min_requests": 4, "window": 10}
    canary = {
        "targets": [{"model": "v1", "weight": 1}, {"model": "v2", "tenants": ["beta"]}],
        "rollback": policy,
    }
    with json_log_stream() as stream, TestClient(app=container.http_app()) as client:
        put = client.put(f"{ROLLOUTS}/support", json=canary, headers=bearer("ops"))
        assert put.json()["rollback"] == policy and put.json()["rolled_back"] == []
        for _ in range(4):
            assert chat(client, "alice").status_code == 200  # v1, healthy
        long = "x" * 300
        for _ in range(4):
            body = {"model": "support", "messages": [{"role": "user", "content": long}]}
            failed = client.post("/v1/chat/completions", json=body, headers=bearer("beta"))
            assert failed.headers["x-infer-model"] == "v2"
        after = chat(client, "beta")
        assert after.status_code == 200 and after.json()["model"] == "v1"
        state = client.get(f"{ROLLOUTS}/support", headers=bearer("ops")).json()
        assert [t["weight"] for t in state["targets"]] == [1.0, 0.0]
        assert state["targets"][1]["tenants"] == []
        (event,) = state["rolled_back"]
        assert (event["target"], event["requests"], event["error_rate"]) == ("v2", 4, 1.0)
    lines = [json.loads(line) for line in stream.getvalue().splitlines() if line.startswith("{")]
    (audit,) = [line for line in lines if line.get("event") == "rollout target rolled back"]
    assert (audit["target"], audit["actor"]) == ("v2", "automatic")


def db_container(tmp_path: Path, db: str, flags: tuple[str, ...] = ()) -> Any:
    from domain.rollout import parse_rollout

    access = AccessSettings(api_keys_file=keys_file(tmp_path), usage_db=db)
    model = ModelSettings(
        aliases=("v1", "v2"), rollouts=tuple(parse_rollout(spec) for spec in flags)
    )
    return fake_container(
        FakeModelRunner(script=reply_script(ByteTokenizer(), "ok")),
        cache_dir=str(tmp_path),
        served_model_name="base",
        model=model,
        access=access,
    )


def test_rollouts_are_kept_across_a_restart_and_shared(tmp_path: Path) -> None:
    db = str(tmp_path / "usage.sqlite3")
    with TestClient(app=db_container(tmp_path, db, ("support=v1:1",)).http_app()) as client:
        moved = client.put(f"{ROLLOUTS}/support", json=CANARY, headers=bearer("ops"))
        assert moved.status_code == 200
    # Restarted with the same flag: the stored decision (90/10, beta pinned) is served.
    again = db_container(tmp_path, db, ("support=v1:1",))
    other = db_container(tmp_path, db)  # a second server on the same database
    with TestClient(app=again.http_app()) as client, TestClient(app=other.http_app()) as peer:
        state = client.get(f"{ROLLOUTS}/support", headers=bearer("ops")).json()
        assert [(t["model"], t["weight"]) for t in state["targets"]] == [("v1", 90), ("v2", 10)]
        assert chat(client, "beta").json()["model"] == "v2"
        assert chat(peer, "beta").json()["model"] == "v2"
        # A change on one server reaches the other when it next reads the store.
        back = {"targets": [{"model": "v1", "weight": 1}]}
        client.put(f"{ROLLOUTS}/support", json=back, headers=bearer("ops"))
        assert chat(peer, "beta").json()["model"] == "v2"  # not read yet
        assert other.rollouts().sync()  # what its watch does every 2 s
        assert chat(peer, "beta").json()["model"] == "v1"
        client.delete(f"{ROLLOUTS}/support", headers=bearer("ops"))
        assert other.rollouts().sync() and chat(peer, "beta").status_code == 404
        assert not other.rollouts().sync()  # nothing new


def test_a_rollout_name_may_hold_a_slash_as_model_names_do(tmp_path: Path) -> None:
    with client_for(tmp_path, keyed=False) as client:
        body = {"targets": [{"model": "v2", "weight": 1}]}
        put = client.put(f"{ROLLOUTS}/acme/support", json=body)
        assert put.status_code == 200 and put.json()["name"] == "acme/support"
        assert client.get(f"{ROLLOUTS}/acme/support").json()["name"] == "acme/support"
        assert chat(client, None, model="acme/support").json()["model"] == "v2"
        assert client.delete(f"{ROLLOUTS}/acme/support").json()["name"] == "acme/support"
        assert client.get(f"{ROLLOUTS}/acme/support").status_code == 404


def test_a_database_down_is_a_503_and_the_rollouts_keep_serving(tmp_path: Path) -> None:
    container = db_container(tmp_path, str(tmp_path / "usage.sqlite3"), ("support=v1:1",))
    with TestClient(app=container.http_app()) as client:
        store = container.rollouts().store

        def down(*_: Any) -> None:
            raise ConnectionError("the database is down")

        store.save = down  # type: ignore[method-assign]
        answer = client.put(f"{ROLLOUTS}/support", json=CANARY, headers=bearer("ops"))
        assert answer.status_code == 503, answer.text
        assert "cannot be stored now" in answer.json()["error"]["message"]
        bad = client.put(f"{ROLLOUTS}/support", json={"targets": []}, headers=bearer("ops"))
        assert bad.status_code == 400  # the caller's mistake stays a 400
        assert chat(client, "alice").json()["model"] == "v1"  # what was served still is
