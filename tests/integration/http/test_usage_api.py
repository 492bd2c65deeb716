"""The usage ledger through the composition root (fake runner): every ``/v1/`` request is
recorded when it ends, and OpenAI's usage API (``GET /v1/organization/usage/completions``,
``.../embeddings``) sums it per time bucket, tenant (``project_id``) and model; an admin key
reads every tenant, another key its own; bad parameters are 400s in OpenAI's format; a
SQLite file keeps the usage across a restart (the console's tenants page reads it too)."""

import json
import time
from pathlib import Path
from typing import Any

from litestar.testing import TestClient

from adapters.fake import ByteTokenizer
from adapters.fake.runner import FakeModelRunner, reply_script
from application.access.keys import hash_key, key_id
from entrypoints.config.access import AccessSettings
from tests.fakes import fake_container

KEYS = {
    "ops": "sk-ops",
    "alice": "sk-alice",
    "bob": "sk-bob",
    "tinker-only": "sk-tinker",
    "daily": "sk-daily",
}
USAGE = "/v1/organization/usage/completions"


def keys_file(tmp_path: Path) -> str:
    tenants = [
        {"id": "ops", "keys": [hash_key(KEYS["ops"])], "faces": ["admin"]},
        {"id": "alice", "keys": [hash_key(KEYS["alice"])]},
        {"id": "bob", "keys": [hash_key(KEYS["bob"])], "tokens_per_minute": 40},
        {"id": "tinker-only", "keys": [hash_key(KEYS["tinker-only"])], "faces": ["tinker"]},
        {"id": "daily", "keys": [hash_key(KEYS["daily"])], "requests_per_day": 2},
    ]
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"tenants": tenants}))
    return str(path)


def client_for(tmp_path: Path, *, keyed: bool = True, usage_db: str | None = None) -> TestClient:
    runner = FakeModelRunner(script=reply_script(ByteTokenizer(), "ok" * 10))
    access = AccessSettings(api_keys_file=keys_file(tmp_path) if keyed else None, usage_db=usage_db)
    container = fake_container(runner, cache_dir=str(tmp_path), access=access)
    return TestClient(app=container.http_app())


def bearer(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name]}"}


def complete(client: TestClient, who: str | None, max_tokens: int = 4) -> Any:
    return client.post(
        "/v1/completions",
        json={"model": "fake", "prompt": "Hello", "max_tokens": max_tokens},
        headers=bearer(who) if who else {},
    )


def usage(client: TestClient, who: str | None, **params: Any) -> Any:
    params.setdefault("start_time", int(time.time()) - 3600)
    return client.get(USAGE, params=params, headers=bearer(who) if who else {})


def results(page: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for bucket in page["data"] for r in bucket["results"]]


def test_usage_by_tenant_and_model_matches_what_replies_said(tmp_path: Path) -> None:
    with client_for(tmp_path) as client:
        replies = [complete(client, "alice").json() for _ in range(2)]
        replies.append(complete(client, "bob", max_tokens=30).json())
        assert complete(client, "bob", max_tokens=38).status_code == 429  # over 40 a minute
        answer = usage(client, "ops", group_by=["project_id", "model"])
        assert answer.status_code == 200, answer.text
        page = answer.json()
        assert page["object"] == "page" and page["has_more"] is False
        (bucket,) = page["data"]  # one day from start_time
        assert bucket["object"] == "bucket" and bucket["end_time"] - bucket["start_time"] <= 86400
        # bob's 429 (refused before its model was read) is no model request: not listed.
        assert len(bucket["results"]) == 2, bucket["results"]
        by_project = {r["project_id"]: r for r in bucket["results"]}
        assert sorted(by_project) == ["alice", "bob"]
        alice, bob = by_project["alice"], by_project["bob"]
        assert alice["object"] == "organization.usage.completions.result"
        assert alice["model"] == "fake" and alice["num_model_requests"] == 2
        assert alice["input_tokens"] == sum(r["usage"]["prompt_tokens"] for r in replies[:2])
        assert alice["output_tokens"] == sum(r["usage"]["completion_tokens"] for r in replies[:2])
        # The 429 is not a model request and used no tokens.
        assert bob["num_model_requests"] == 1
        assert bob["output_tokens"] == replies[2]["usage"]["completion_tokens"]
        assert (alice["input_cached_tokens"], alice["api_key_id"], alice["batch"]) == (
            0,
            None,  # not grouped by key
            None,
        )


def test_buckets_cover_the_range_and_page(tmp_path: Path) -> None:
    with client_for(tmp_path, keyed=False) as client:
        assert complete(client, None).status_code == 200
        now = int(time.time())
        start = now - 10 * 60 + 1  # the request ended in the tenth minute bucket
        first = usage(client, None, start_time=start, bucket_width="1m", limit=4).json()
        assert [b["start_time"] for b in first["data"]] == [start + 60 * i for i in range(4)]
        assert first["has_more"] is True and first["next_page"] == "4"
        assert results(first) == []
        pages = [first]
        while pages[-1]["has_more"]:
            params = {"start_time": start, "bucket_width": "1m", "limit": 4}
            following = usage(client, None, page=pages[-1]["next_page"], **params).json()
            pages.append(following)
        assert [len(p["data"]) for p in pages] == [4, 4, 2]
        (last,) = results(pages[-1])
        assert last["num_model_requests"] == 1 and last["project_id"] is None
        assert last["model"] is None  # not grouped by model
        # An open server's callers are no tenant's.
        whole = usage(client, None, group_by="project_id,model").json()
        assert [(r["project_id"], r["model"]) for r in results(whole)] == [(None, "fake")]


def test_a_tenant_reads_its_own_usage_and_an_admin_everyones(tmp_path: Path) -> None:
    with client_for(tmp_path) as client:
        complete(client, "alice")
        complete(client, "bob")
        own = usage(client, "alice", group_by="project_id").json()
        assert [r["project_id"] for r in results(own)] == ["alice"]
        asked_for_bob = usage(client, "alice", group_by="project_id", project_ids="bob").json()
        assert results(asked_for_bob) == []
        everyone = usage(client, "ops", group_by="project_id").json()
        assert [r["project_id"] for r in results(everyone)] == ["alice", "bob"]
        only_bob = usage(client, "ops", group_by="project_id", project_ids=["bob"]).json()
        assert [r["project_id"] for r in results(only_bob)] == ["bob"]
        missing = usage(client, None)
        assert missing.status_code == 401
        assert missing.json()["error"]["code"] == "invalid_api_key"
        forbidden = usage(client, "tinker-only")
        assert forbidden.status_code == 403
        assert forbidden.json()["error"]["type"] == "permission_error"


def test_bad_parameters_are_openai_400s(tmp_path: Path) -> None:
    with client_for(tmp_path, keyed=False) as client:
        now = int(time.time())
        cases = [
            ({}, "start_time"),
            ({"start_time": "yesterday"}, "start_time"),
            ({"start_time": now, "end_time": now - 5}, "end_time"),
            ({"start_time": now - 60, "bucket_width": "1w"}, "bucket_width"),
            ({"start_time": now - 60, "bucket_width": "1d", "limit": 32}, "limit"),
            ({"start_time": now - 60, "limit": 0}, "limit"),
            ({"start_time": now - 60, "page": -1}, "page"),
            ({"start_time": now - 60, "group_by": "user_id"}, "group_by"),
            ({"start_time": now - 60, "group_by": "colour"}, "group_by"),
            ({"start_time": str(10**30)}, "start_time"),
        ]
        for params, field in cases:
            answer = client.get(USAGE, params=params)
            assert answer.status_code == 400, (params, answer.text)
            error = answer.json()["error"]
            assert error["type"] == "invalid_request_error" and error["param"] == field, params


def test_usage_survives_a_restart_in_a_sqlite_file(tmp_path: Path) -> None:
    db = str(tmp_path / "usage.sqlite3")
    with client_for(tmp_path, usage_db=db) as client:
        first = complete(client, "alice").json()
    with client_for(tmp_path, usage_db=db) as client:
        again = usage(client, "ops", group_by="project_id").json()
        (alice,) = results(again)
        assert alice["output_tokens"] == first["usage"]["completion_tokens"]
        tenants = client.get("/ui/api/tenants", headers=bearer("ops")).json()["tenants"]
        by_id = {t["id"]: t["usage"] for t in tenants}
        assert by_id["alice"]["requests"] == 1
        assert by_id["alice"]["completion_tokens"] == first["usage"]["completion_tokens"]


def test_cached_prompt_tokens_are_summed(tmp_path: Path) -> None:
    prompt = "x" * 200  # several full blocks: the second request finds them cached
    with client_for(tmp_path, keyed=False) as client:
        replies = []
        for _ in range(2):
            answer = client.post(
                "/v1/completions", json={"model": "fake", "prompt": prompt, "max_tokens": 2}
            )
            assert answer.status_code == 200, answer.text
            replies.append(answer.json()["usage"])
        cached = sum(r.get("prompt_tokens_details", {}).get("cached_tokens", 0) for r in replies)
        assert cached > 0
        (row,) = results(usage(client, None).json())
        assert row["input_cached_tokens"] == cached


def test_daily_quotas_survive_a_restart_through_the_ledger(tmp_path: Path) -> None:
    db = str(tmp_path / "usage.sqlite3")
    with client_for(tmp_path, usage_db=db) as client:
        assert complete(client, "daily").status_code == 200
    with client_for(tmp_path, usage_db=db) as client:
        assert complete(client, "daily").status_code == 200
        refused = complete(client, "daily")
        assert refused.status_code == 429, refused.text
        assert "2 requests per day" in refused.json()["error"]["message"]
    # In memory (no ledger file) a restart starts the day afresh.
    with client_for(tmp_path) as client:
        assert complete(client, "daily").status_code == 200


def test_usage_by_api_key(tmp_path: Path) -> None:
    """Two keys of one tenant (a rotation): each key's requests apart, by its public id."""
    keys = tmp_path / "keys.json"
    tenants = [
        {"id": "ops", "keys": [hash_key(KEYS["ops"])], "faces": ["admin"]},
        {"id": "alice", "keys": [hash_key("sk-old"), hash_key("sk-new")]},
    ]
    keys.write_text(json.dumps({"tenants": tenants}))
    runner = FakeModelRunner(script=reply_script(ByteTokenizer(), "ok" * 10))
    access = AccessSettings(api_keys_file=str(keys))
    container = fake_container(runner, cache_dir=str(tmp_path), access=access)
    with TestClient(app=container.http_app()) as client:
        for key, times in (("sk-old", 1), ("sk-new", 2)):
            for _ in range(times):
                answer = client.post(
                    "/v1/completions",
                    json={"model": "fake", "prompt": "Hi", "max_tokens": 2},
                    headers={"Authorization": f"Bearer {key}"},
                )
                assert answer.status_code == 200
        page = usage(client, "ops", group_by=["project_id", "api_key_id"]).json()
        counted = {r["api_key_id"]: r["num_model_requests"] for r in results(page)}
        assert counted == {key_id(hash_key("sk-old")): 1, key_id(hash_key("sk-new")): 2}
        assert all(r["project_id"] == "alice" for r in results(page))
        assert "sk-old" not in json.dumps(page)  # keys by their public ids only


def test_the_writer_is_watched_in_the_metrics(tmp_path: Path) -> None:
    with client_for(tmp_path, keyed=False) as client:
        assert complete(client, None).status_code == 200
        metrics = client.get("/metrics").text
        for name in ("usage_records_pending", "usage_records_dropped", "usage_write_failures"):
            assert f"infer:{name}{{" in metrics, name
        assert 'infer:usage_records_dropped{model_name="fake"} 0.0' in metrics


def test_a_usage_database_down_is_a_503(tmp_path: Path) -> None:
    runner = FakeModelRunner(script=reply_script(ByteTokenizer(), "ok"))
    container = fake_container(runner, cache_dir=str(tmp_path))
    with TestClient(app=container.http_app()) as client:
        ledger = container.usage().ledger

        def down(*_: Any) -> Any:
            raise ConnectionError("the database is down")

        ledger.totals = down
        assert complete(client, None).status_code == 200  # serving goes on
        answer = usage(client, None)
        assert answer.status_code == 503, answer.text
        assert "cannot be read now" in answer.json()["error"]["message"]
        assert answer.headers["retry-after"] == "1"
        container.audit().trail.read = down
        assert client.get("/admin/audit").status_code == 503
