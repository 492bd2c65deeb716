"""A real `infer serve` with an API keys file, driven by the official openai SDK: keys are
required, a tenant's request limit answers 429 (the SDK's RateLimitError), a model out of
scope 403, and SIGHUP rotates the keys without a restart."""

import json
import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from application.access.keys import hash_key
from tests.e2e.server import infer_serve

pytestmark = pytest.mark.slow
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def write_keys(path: Path, tenants: list[dict[str, object]]) -> None:
    path.write_text(json.dumps({"tenants": tenants}))


def client(url: str, key: str | None) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key or "none", max_retries=0)


def ask(url: str, key: str | None) -> str:
    reply = client(url, key).completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0
    )
    return reply.choices[0].text


def test_keys_limits_and_rotation_with_the_openai_sdk(tmp_path: Path) -> None:
    keys = tmp_path / "keys.json"
    write_keys(
        keys,
        [
            {"id": "alice", "keys": [hash_key("sk-alice")], "requests_per_minute": 2},
            {"id": "bob", "keys": [hash_key("sk-bob")], "models": ["another"]},
        ],
    )
    with infer_serve("--no-tinker", "--api-keys-file", str(keys)) as url:
        with pytest.raises(openai.AuthenticationError):
            ask(url, "sk-nobody")
        assert ask(url, "sk-alice")
        response = client(url, "sk-alice").completions.with_raw_response.create(
            model=MODEL, prompt="Hi", max_tokens=1
        )
        assert response.headers["x-ratelimit-remaining-requests"] == "0"
        with pytest.raises(openai.RateLimitError) as limited:
            ask(url, "sk-alice")
        assert limited.value.response.headers["retry-after"]
        with pytest.raises(openai.PermissionDeniedError):
            ask(url, "sk-bob")

        write_keys(keys, [{"id": "carol", "keys": [hash_key("sk-carol")]}])
        pid = _server_pid(url)
        os.kill(pid, signal.SIGHUP)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                ask(url, "sk-carol")
                break
            except openai.AuthenticationError:
                time.sleep(0.2)
        assert ask(url, "sk-carol")
        with pytest.raises(openai.AuthenticationError):
            ask(url, "sk-bob")
        assert httpx.get(f"{url}/health").status_code == 200


def _server_pid(url: str) -> int:
    """The pid of the process listening on the URL's port."""
    port = int(url.rsplit(":", 1)[1])
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == port and fields[3] == "0A":
            inode = fields[9]
            break
    else:
        raise AssertionError("no listener")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inode}]":
                    return int(pid)
            except OSError:
                continue
    raise AssertionError("no process")


def test_usage_and_daily_quotas_in_postgresql_across_a_restart(tmp_path: Path) -> None:
    """Two `infer serve` lives writing the usage ledger to a real PostgreSQL: the daily
    quota counts the first life's request, and the usage API reads both lives'."""
    from tests.support.postgres import postgres_bin, postgres_server

    if postgres_bin() is None:
        pytest.skip("no PostgreSQL binaries (apt install postgresql; make test does)")
    keys = tmp_path / "keys.json"
    write_keys(
        keys,
        [
            {"id": "alice", "keys": [hash_key("sk-alice")], "requests_per_day": 2},
            {"id": "ops", "keys": [hash_key("sk-ops")], "faces": ["admin"]},
        ],
    )
    start = int(time.time()) - 60
    with postgres_server() as db:
        flags = ("--no-tinker", "--api-keys-file", str(keys), "--usage-db", db)
        with infer_serve(*flags) as url:
            assert ask(url, "sk-alice")
        with infer_serve(*flags) as url:
            assert ask(url, "sk-alice")
            with pytest.raises(openai.RateLimitError) as limited:
                ask(url, "sk-alice")
            assert "2 requests per day" in str(limited.value)
            usage = httpx.get(
                f"{url}/v1/organization/usage/completions",
                params={"start_time": start, "group_by": ["project_id", "model"]},
                headers={"Authorization": "Bearer sk-ops"},
            )
            assert usage.status_code == 200, usage.text
            results = [r for b in usage.json()["data"] for r in b["results"]]
            assert len(results) == 1, results
            (result,) = results
            assert (result["project_id"], result["model"]) == ("alice", MODEL)
            assert result["num_model_requests"] == 2
            assert result["input_tokens"] > 0 and result["output_tokens"] > 0
        import psycopg

        with psycopg.connect(db) as conn:
            rows = conn.execute(
                "SELECT tenant_id, status FROM infer_usage ORDER BY ended_at"
            ).fetchall()
        statuses = [status for tenant, status in rows if tenant == "alice"]
        assert statuses == [200, 200, 429]
