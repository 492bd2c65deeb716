"""The console's data endpoints (fake runner and the toy Tinker backend, through the
composition root): ``/ui/api/tenants`` for admin keys only, with each tenant's limits and
usage today (requests, tokens, 429s); ``/ui/api/training/...``: Tinker runs, their metrics
per step as results come, and their checkpoints (size, TTL, published, the model name the
OpenAI endpoints take), each caller seeing what its key may."""

import json
from pathlib import Path
from typing import Any

from litestar.testing import TestClient

from adapters.fake import ByteTokenizer
from adapters.fake.runner import FakeModelRunner, reply_script
from adapters.http.console.security import CONTENT_SECURITY_POLICY
from application.access.keys import hash_key
from entrypoints.config.access import AccessSettings
from entrypoints.config.tinker import TinkerSettings
from entrypoints.config.transport import TransportSettings
from tests.fakes import fake_container
from tests.support.tinker_client import Api, forward_backward_proto, post_proto, sample_body

KEYS = {
    "ops": "sk-ops",
    "alice": "sk-alice",
    "bob": "sk-bob",
    "chat-only": "sk-chat",
}


def keys_file(tmp_path: Path) -> Path:
    tenants = [
        {"id": "ops", "keys": [hash_key(KEYS["ops"])], "faces": ["openai", "tinker", "admin"]},
        {
            "id": "alice",
            "keys": [hash_key(KEYS["alice"])],
            "requests_per_minute": 100,
            "max_concurrent_streams": 2,
            "weight": 2,
        },
        {"id": "bob", "keys": [hash_key(KEYS["bob"])], "tokens_per_minute": 40},
        {"id": "chat-only", "keys": [hash_key(KEYS["chat-only"])], "faces": ["openai"]},
    ]
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"tenants": tenants}))
    return path


def client_for(tmp_path: Path, *, keyed: bool = True, **overrides: Any) -> tuple[TestClient, Any]:
    runner = FakeModelRunner(script=reply_script(ByteTokenizer(), "ok" * 10))
    tinker = TinkerSettings(
        enabled=True, training_backend="toy", checkpoint_dir=str(tmp_path / "checkpoints")
    )
    overrides.setdefault("tinker", tinker)
    if keyed:
        overrides["api_keys_file"] = str(keys_file(tmp_path))
    container = fake_container(runner, cache_dir=str(tmp_path), **overrides)
    return TestClient(app=container.http_app()), container


def bearer(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name]}"}


def complete(client: TestClient, headers: dict[str, str], max_tokens: int = 4) -> Any:
    return client.post(
        "/v1/completions",
        json={"model": "fake", "prompt": "Hi", "max_tokens": max_tokens},
        headers=headers,
    )


def train(api: Api, steps: int, *, base_model: str) -> str:
    """A run of ``steps`` forward/backward + optim steps; its id."""
    session = api.session()
    model_id = api.model(session, base_model=base_model)
    seq = 1
    for _ in range(steps):
        api.result(api.forward_backward(model_id, seq))
        adam = {"learning_rate": 0.05}
        api.run("optim_step", {"model_id": model_id, "seq_id": seq + 1, "adam_params": adam})
        seq += 2
    return model_id


def base_model(container: Any) -> str:
    name: str = container.backend.served_names()[0]
    return name


# --- tenants ----------------------------------------------------------------------------


def test_the_tenants_page_needs_an_admin_key(tmp_path: Path) -> None:
    client, _ = client_for(tmp_path)
    with client:
        missing = client.get("/ui/api/tenants")
        assert missing.status_code == 401
        assert missing.json()["error"]["code"] == "invalid_api_key"
        assert client.get(
            "/ui/api/tenants", headers={"Authorization": "Bearer sk-x"}
        ).status_code == (401)
        refused = client.get("/ui/api/tenants", headers=bearer("alice"))
        assert refused.status_code == 403
        error = refused.json()["error"]
        assert error["type"] == "permission_error" and "admin" in error["message"]
        assert refused.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
        ok = client.get("/ui/api/tenants", headers=bearer("ops"))
        assert ok.status_code == 200, ok.text
        assert ok.headers["cache-control"] == "no-store"
        body = ok.json()
        assert body["keyed"] is True and body["viewer"] == "ops"
        tenants = {t["id"]: t for t in body["tenants"]}
        assert sorted(tenants) == ["alice", "bob", "chat-only", "ops"]
        assert tenants["ops"]["admin"] is True and tenants["alice"]["admin"] is False
        assert tenants["alice"]["faces"] == ["openai", "tinker"]
        assert tenants["alice"]["weight"] == 2
        assert tenants["alice"]["limits"] == {
            "requests_per_second": None,
            "requests_per_minute": 100,
            "tokens_per_minute": None,
            "max_concurrent_streams": 2,
            "requests_per_day": None,
            "tokens_per_day": None,
            "max_output_tokens": None,
        }
        assert tenants["bob"]["limits"]["tokens_per_minute"] == 40
        assert tenants["chat-only"]["faces"] == ["openai"]
        # No key's secret or hash is ever listed.
        assert "sha256" not in ok.text and "sk-" not in ok.text


def test_usage_today_counts_requests_tokens_and_429s(tmp_path: Path) -> None:
    client, _ = client_for(tmp_path)
    with client:
        for _ in range(2):
            assert complete(client, bearer("alice")).status_code == 200
        first = complete(client, bearer("bob"), max_tokens=30)
        assert first.status_code == 200, first.text
        assert complete(client, bearer("bob"), max_tokens=38).status_code == 429  # over 40/min
        assert client.get("/v1/models", headers=bearer("alice")).status_code == 200
        body = client.get("/ui/api/tenants", headers=bearer("ops")).json()
        usage = {t["id"]: t["usage"] for t in body["tenants"]}
        alice = usage["alice"]
        assert alice["requests"] == 3  # two completions and the model list
        assert alice["prompt_tokens"] > 0 and alice["completion_tokens"] > 0
        assert (alice["rate_limited"], alice["errors"]) == (0, 0)
        bob = usage["bob"]
        assert (bob["requests"], bob["rate_limited"]) == (2, 1)
        assert bob["completion_tokens"] == first.json()["usage"]["completion_tokens"]
        assert usage["ops"]["requests"] == 0
        # The console's own requests and keyless ones are not a tenant's.
        assert body["others"] == []
        assert body["tinker"] is True
        assert body["tenants"][0]["tinker_usage"] == {
            "trained_tokens": 0,
            "prefill_tokens": 0,
            "sampled_tokens": 0,
            "checkpoints_saved": 0,
        }
        assert body["day_start"] <= body["now"] < body["day_start"] + 86400


def test_tinker_refusals_count_in_the_tenants_errors(tmp_path: Path) -> None:
    """The Tinker API's refused calls are the tenant's (its successful ones, polls
    included, are metered by the Tinker usage meter instead)."""
    client, container = client_for(tmp_path)
    with client:
        api = Api(client, {"X-API-Key": KEYS["bob"]})
        api.session()  # a successful call: not in the request counts
        too_big = sample_body([1, 2, 3], sampling_params={"max_tokens": 100})
        too_big["base_model"] = base_model(container)
        api.post("asample", too_big, status=400)  # more than bob's 40 tokens a minute
        body = client.get("/ui/api/tenants", headers=bearer("ops")).json()
        bob = next(t for t in body["tenants"] if t["id"] == "bob")["usage"]
        assert (bob["requests"], bob["errors"], bob["rate_limited"]) == (1, 1, 0)


def test_tinker_usage_today_is_listed_per_tenant(tmp_path: Path) -> None:
    client, container = client_for(tmp_path)
    with client:
        api = Api(client, {"X-API-Key": KEYS["alice"]})
        train(api, 1, base_model=base_model(container))
        body = client.get("/ui/api/tenants", headers=bearer("ops")).json()
        alice = next(t for t in body["tenants"] if t["id"] == "alice")
        assert alice["tinker_usage"]["trained_tokens"] == 7  # one datum of 7 tokens


def test_an_api_key_flag_is_the_operators_admin_key(tmp_path: Path) -> None:
    access = AccessSettings(api_key_hashes=(hash_key("sk-operator"),))
    client, _ = client_for(tmp_path, keyed=False, access=access)
    with client:
        answer = client.get("/ui/api/tenants", headers={"Authorization": "Bearer sk-operator"})
        assert answer.status_code == 200, answer.text
        (tenant,) = answer.json()["tenants"]
        assert (tenant["id"], tenant["faces"], tenant["admin"]) == (
            "default",
            ["admin", "openai"],
            True,
        )


def test_an_open_server_lists_its_keyless_usage(tmp_path: Path) -> None:
    client, _ = client_for(tmp_path, keyed=False)
    with client:
        assert complete(client, {}).status_code == 200
        body = client.get("/ui/api/tenants").json()
        assert body["keyed"] is False and body["tenants"] == []
        (keyless,) = body["others"]
        assert keyless["no_key"] is True and keyless["usage"]["requests"] == 1


# --- training ---------------------------------------------------------------------------


def test_a_runs_curve_gains_a_point_per_step(tmp_path: Path) -> None:
    client, container = client_for(tmp_path, keyed=False)
    with client:
        api = Api(client)
        model_id = train(api, 3, base_model=base_model(container))
        listed = client.get("/ui/api/training/runs").json()
        assert listed["enabled"] is True and listed["all"] is True
        (run,) = listed["runs"]
        assert run["id"] == model_id and run["lora_rank"] == 4 and run["steps"] == 3
        assert run["base_model"] == base_model(container) and run["loaded"] is True
        assert run["optimizer"] == "adamw" and "loss:sum" in run["last_metrics"]
        detail = client.get(f"/ui/api/training/runs/{model_id}").json()
        points = detail["points"]
        assert [p["step"] for p in points] == [0, 1, 2]
        assert all(p["done"] for p in points)
        losses = [p["metrics"]["loss:sum"] for p in points]
        assert losses[-1] < losses[0]  # it learns
        assert "grad_norm:mean" in points[0]["metrics"]
        # A forward/backward shows up at once, as the next step's (not done) point.
        api.result(api.forward_backward(model_id, 7))
        fresh = client.get(f"/ui/api/training/runs/{model_id}?since=2").json()["points"]
        assert [(p["step"], p["done"]) for p in fresh] == [(2, True), (3, False)]
        # A forward-only pass is an evaluation, kept apart from the training loss.
        msg = forward_backward_proto(model_id, 8, forward_only=True)
        api.result(post_proto(client, msg, api.headers).json()["request_id"])
        (open_point,) = client.get(f"/ui/api/training/runs/{model_id}?since=3").json()["points"]
        assert "forward/loss:sum" in open_point["metrics"]
        assert client.get(f"/ui/api/training/runs/{model_id}?since=-1").status_code == 400


def test_checkpoints_with_size_ttl_and_published(tmp_path: Path) -> None:
    client, container = client_for(tmp_path, keyed=False)
    with client:
        api = Api(client)
        model_id = train(api, 1, base_model=base_model(container))
        body = {"model_id": model_id, "path": "best", "seq_id": 3, "ttl_seconds": 3600}
        api.run("save_weights_for_sampler", body)
        api.run("save_weights", {"model_id": model_id, "path": "state", "seq_id": 4})
        api.post(f"training_runs/{model_id}/checkpoints/sampler_weights/best/publish", {})
        detail = client.get(f"/ui/api/training/runs/{model_id}").json()
        by_kind = {c["kind"]: c for c in detail["checkpoints"]}
        sampler, state = by_kind["sampler"], by_kind["training"]
        assert sampler["path"] == f"tinker://{model_id}/sampler_weights/best"
        assert sampler["size_bytes"] > 0 and sampler["public"] is True
        assert 3500 < sampler["expires_at"] - sampler["created_at"] <= 3600
        assert state["path"] == f"tinker://{model_id}/weights/state"
        assert state["expires_at"] is None and state["public"] is False
        assert state["model"] is None and state["sampleable"] is False
        # Its model name on the OpenAI endpoints is its path; the fake runner serves no
        # LoRA adapters, so the console is told why it cannot sample it here.
        assert sampler["model"] == sampler["path"]
        assert sampler["sampleable"] is False
        assert "does not serve Tinker checkpoints" in sampler["not_sampleable_because"]


def test_who_sees_which_runs(tmp_path: Path) -> None:
    client, container = client_for(tmp_path)
    with client:
        alices = train(
            Api(client, {"X-API-Key": KEYS["alice"]}), 1, base_model=base_model(container)
        )
        bobs = train(Api(client, {"X-API-Key": KEYS["bob"]}), 1, base_model=base_model(container))

        def runs(name: str) -> Any:
            return client.get("/ui/api/training/runs", headers=bearer(name))

        assert runs("alice").json()["all"] is False
        assert [r["id"] for r in runs("alice").json()["runs"]] == [alices]
        assert runs("alice").json()["runs"][0]["owner"] is None
        admin = runs("ops").json()
        assert admin["all"] is True
        assert {r["id"]: r["owner"] for r in admin["runs"]} == {alices: "alice", bobs: "bob"}
        assert runs("chat-only").status_code == 403
        assert client.get("/ui/api/training/runs").status_code == 401
        # Another tenant's run is not found; the admin's view has it.
        other = client.get(f"/ui/api/training/runs/{bobs}", headers=bearer("alice"))
        assert other.status_code == 404 and other.json()["error"]["type"] == "invalid_request_error"
        assert client.get(f"/ui/api/training/runs/{bobs}", headers=bearer("ops")).status_code == 200
        assert client.get("/ui/api/training/runs/nope", headers=bearer("ops")).status_code == 404


def test_without_tinker_the_training_page_says_so(tmp_path: Path) -> None:
    client, _ = client_for(tmp_path, keyed=False, tinker=TinkerSettings(enabled=False))
    with client:
        assert client.get("/ui/api/training/runs").json() == {
            "enabled": False,
            "all": True,
            "runs": [],
        }
        assert client.get("/ui/api/training/runs/x").status_code == 404
        assert client.get("/ui/api/tenants").json()["tinker"] is False


def test_no_ui_serves_no_console_data(tmp_path: Path) -> None:
    client, _ = client_for(tmp_path, keyed=False, http=TransportSettings(ui=False))
    with client:
        assert client.get("/ui/api/tenants").status_code == 404
        assert client.get("/ui/api/training/runs").status_code == 404


def test_a_sampler_checkpoint_is_sampled_by_its_model_name(tmp_path: Path) -> None:
    """On a real (tiny) model with LoRA serving: the name the page gets for a sampler
    checkpoint is one the OpenAI endpoints serve to the key that saved it, and the page
    says why another key, or none, could not."""
    from domain.config import EngineConfig
    from entrypoints.config import ServerConfig
    from entrypoints.container import create_container
    from tests.support.tiny_models import save_tiny_model

    folder = tmp_path / "tiny"
    save_tiny_model("llama", folder)
    config = ServerConfig.for_model(
        str(folder),
        dtype="float32",
        device="cpu",
        cache_dir=str(tmp_path / "cache"),
        progress=False,
        engine=EngineConfig(max_model_len=128, max_num_seqs=4),
        served_model_name="tiny",
        tinker=TinkerSettings(enabled=True, checkpoint_dir=str(tmp_path / "ckpt")),
    )
    with TestClient(app=create_container(config).http_app()) as client:
        alice = {"Authorization": "Bearer tml-alice"}
        trainer = Api(client, {"X-API-Key": "tml-alice"})
        model_id = train(trainer, 1, base_model="tiny")
        body = {"model_id": model_id, "path": "s", "seq_id": 3}
        path = trainer.run("save_weights_for_sampler", body)["path"]

        def checkpoint(headers: dict[str, str]) -> Any:
            detail = client.get(f"/ui/api/training/runs/{model_id}", headers=headers).json()
            (found,) = detail["checkpoints"]
            return found

        mine = checkpoint(alice)
        assert (mine["model"], mine["sampleable"]) == (path, True)
        reply = client.post(
            "/v1/completions",
            json={"model": mine["model"], "prompt": "hello", "max_tokens": 2},
            headers=alice,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["model"] == path
        bobs = checkpoint({"Authorization": "Bearer tml-bob"})
        assert bobs["sampleable"] is False and "saved it" in bobs["not_sampleable_because"]
        keyless = checkpoint({})
        assert "Tinker key that saved it" in keyless["not_sampleable_because"]
