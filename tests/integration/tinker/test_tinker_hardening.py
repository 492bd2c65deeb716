"""Issue 11 on the Tinker API (toy backend, raw HTTP): malformed bodies get 4xx in Tinker's
error form (never 5xx, which the SDK retries for minutes; never exception text), per-key
limits, and checkpoint links and errors that name no server path."""

import json
import stat
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from litestar.testing import TestClient

from application.tinker.service import TinkerService
from domain.tinker.values import TinkerLimits
from tests.support.tinker_client import (
    HEADERS,
    SEQ,
    Api,
    forward_backward_proto,
    json_datum,
    post_proto,
    sample_body,
)
from tests.support.tinker_server import BASE_MODEL, tinker_app, toy_service

JSON = {**HEADERS, "Content-Type": "application/json"}


@pytest.fixture
def service(tmp_path: Path) -> TinkerService:
    limits = TinkerLimits(max_pending_requests=4)
    return toy_service(tmp_path / "ckpt", limits=limits, long_poll_s=0.5)


def user_error(response: Any, status: int = 400) -> str:
    """The response is a Tinker user error with ``status``; its message."""
    assert response.status_code == status, response.text
    body = response.json()
    assert body["category"] == "user", body
    assert "Error" not in body["error"] and "Traceback" not in body["error"], body
    message: str = body["error"]
    return message


def fb_json(model_id: str, seq_id: int | None, data: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "model_id": model_id,
        "seq_id": seq_id,
        "forward_backward_input": {"data": data, "loss_fn": "cross_entropy"},
    }


# --- malformed bodies -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    ["create_session", "session_heartbeat", "create_model", "forward_backward", "optim_step",
     "asample", "retrieve_future", "save_weights"],
)  # fmt: skip
def test_invalid_utf8_in_a_json_body_is_a_400(client: TestClient[Any], path: str) -> None:
    body = b'{"session_id": "\xff\xfe", "model_id": "\xc3\x28", "tags": ["\xed\xa0\x80"]}'
    message = user_error(client.post(f"/api/v1/{path}", content=body, headers=JSON))
    if path in ("create_session", "session_heartbeat", "optim_step"):  # a field it reads
        assert "UTF-8" in message


def test_protobuf_bytes_that_are_not_whole_values_are_a_400(
    client: TestClient[Any], api: Api
) -> None:
    model_id = api.model(api.session())
    msg = forward_backward_proto(model_id, 1)
    msg.data[0].model_input[0].encoded_text.tokens += b"\x01"  # 4-byte ids and a stray byte
    assert "whole number" in user_error(post_proto(client, msg))
    msg = forward_backward_proto(model_id, 1)
    msg.data[0].loss_fn_inputs["target_tokens"].dense += b"\x00" * 3  # int64 + 3 bytes
    assert "whole number" in user_error(post_proto(client, msg))


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_protobuf_weights_must_be_finite(client: TestClient[Any], api: Api, bad: float) -> None:
    model_id = api.model(api.session())
    msg = forward_backward_proto(model_id, 1)
    weights = np.ones(len(SEQ) - 1, np.float32)
    weights[2] = bad
    msg.data[0].loss_fn_inputs["weights"].dense = weights.tobytes()
    assert "finite" in user_error(post_proto(client, msg))


def _json_fb(api: Api, model_id: str, **inputs: dict[str, Any]) -> Any:
    body = json_datum(SEQ)
    body["loss_fn_inputs"].update(inputs)
    return api.http.post(
        "/api/v1/forward_backward", json=fb_json(model_id, 1, [body]), headers=HEADERS
    )


def test_json_tensor_values_are_checked_not_overflowed_or_truncated(api: Api) -> None:
    model_id = api.model(api.session())
    n = len(SEQ) - 1
    targets = SEQ[1:]
    cases = {
        "out of range": {"target_tokens": {"data": [1e20, *targets[1:]], "dtype": "int64"}},
        "out of range ": {"target_tokens": {"data": [10**20, *targets[1:]], "dtype": "int64"}},
        "not an integer": {"target_tokens": {"data": [1.7, *targets[1:]], "dtype": "int64"}},
        "int64": {"target_tokens": {"data": [float(t) for t in targets], "dtype": "float32"}},
        "finite": {"weights": {"data": [1e39] + [1.0] * (n - 1), "dtype": "float32"}},
        "dtype": {"weights": {"data": [1.0] * n, "dtype": "float128"}},
        "shape": {"weights": {"data": [1.0] * n, "dtype": "float32", "shape": [n + 1]}},
    }
    for expected, inputs in cases.items():
        assert expected.strip() in user_error(_json_fb(api, model_id, **inputs)), expected
    token_ids = json_datum(SEQ)
    token_ids["model_input"]["chunks"][0]["tokens"][0] = 2**40
    response = api.http.post(
        "/api/v1/forward_backward", json=fb_json(model_id, 1, [token_ids]), headers=HEADERS
    )
    assert "token ids" in user_error(response)
    # The same request with good values is fine.
    assert _json_fb(api, model_id).status_code == 200


@pytest.mark.parametrize("lr", [1e38, -1.0])
def test_an_absurd_learning_rate_is_a_user_error(api: Api, lr: float) -> None:
    model_id = api.model(api.session())
    body = {"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": lr}}
    response = api.http.post("/api/v1/optim_step", json=body, headers=HEADERS)
    assert "learning_rate" in user_error(response)


def test_a_bug_answers_500_without_its_exception_text(
    client: TestClient[Any], service: TinkerService, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_: Any, **__: Any) -> Any:
        raise RuntimeError("secret detail /srv/data/x")

    monkeypatch.setattr(service.sessions, "create", broken)
    response = client.post("/api/v1/create_session", json={}, headers=HEADERS)
    assert response.status_code == 500
    assert "secret" not in response.text and "RuntimeError" not in response.text


# --- seq_id bounds and waiting requests -----------------------------------------------------


def test_a_huge_seq_id_is_refused_and_does_not_park_later_requests(api: Api) -> None:
    model_id = api.model(api.session())
    for seq_id in (10**30, 2**63 - 1, 5000):
        body = fb_json(model_id, seq_id, [json_datum(SEQ)])
        response = api.http.post("/api/v1/forward_backward", json=body, headers=HEADERS)
        assert "too far ahead" in user_error(response)
    # Unnumbered requests and the next numbered one run at once.
    api.run("optim_step", {"model_id": model_id})
    api.run("forward_backward", fb_json(model_id, 2, [json_datum(SEQ)]))


def test_a_full_queue_of_waiting_requests_answers_429_then_accepts(api: Api) -> None:
    model_id = api.model(api.session())
    waiting = [api.post("optim_step", {"model_id": model_id, "seq_id": s}) for s in (2, 3, 4, 5)]
    response = api.http.post(
        "/api/v1/optim_step", json={"model_id": model_id, "seq_id": 6}, headers=HEADERS
    )
    user_error(response, 429)
    assert response.headers["retry-after"] == "1"
    api.run("optim_step", {"model_id": model_id, "seq_id": 1})  # the gap fills: all run
    for request in waiting:
        assert "error" not in api.result(request["request_id"])
    api.run("optim_step", {"model_id": model_id, "seq_id": 6})  # the retry is accepted


def test_client_config_chunks_forward_backward_below_the_token_limit(api: Api) -> None:
    config = api.post("client/config", {})
    per_request = TinkerLimits().max_tokens_per_request
    assert config["fwdbwd_max_chunk_bytes_count"] == 4 * per_request


# --- samplers and download links --------------------------------------------------------------


def test_a_deleted_checkpoints_sampler_error_names_no_server_path(api: Api, tmp_path: Path) -> None:
    sid = api.session()
    model_id = api.model(sid)
    path = api.run("save_weights_for_sampler", {"model_id": model_id, "path": "s1"})["path"]
    sampler = api.sampler(sid, model_path=path)
    assert "error" not in api.run("asample", sample_body([1, 2], sampling_session_id=sampler))
    api.http.delete(
        f"/api/v1/training_runs/{model_id}/checkpoints/sampler_weights/s1", headers=HEADERS
    )
    response = api.http.post(
        "/api/v1/asample", json=sample_body([1, 2], sampling_session_id=sampler), headers=HEADERS
    )
    message = user_error(response, 404)
    assert str(tmp_path) not in response.text and "/ckpt" not in response.text
    assert path in message


def _download_urls(api: Api, model_id: str, name: str) -> dict[str, str]:
    urls: dict[str, str] = api.get(
        f"training_runs/{model_id}/checkpoints/external_weights/{name}/external_weights_urls"
    )["urls"]
    return urls


def test_an_old_link_never_serves_a_new_save_under_the_same_name(api: Api) -> None:
    model_id = api.model(api.session())
    api.run("save_weights_external", {"model_id": model_id, "path": "dl"})
    old = _download_urls(api, model_id, "dl")["adapter_config.json"]
    assert api.http.get(old).status_code == 200
    api.http.delete(
        f"/api/v1/training_runs/{model_id}/checkpoints/external_weights/dl", headers=HEADERS
    )
    api.run("optim_step", {"model_id": model_id, "adam_params": {"learning_rate": 0.1}})
    api.run("save_weights_external", {"model_id": model_id, "path": "dl"})
    assert api.http.get(old).status_code == 403
    new = _download_urls(api, model_id, "dl")["adapter_config.json"]
    assert api.http.get(new).status_code == 200


def test_links_stay_valid_across_a_restart_and_the_key_is_private(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    with TestClient(tinker_app(toy_service(root))) as client:
        api = Api(client)
        model_id = api.model(api.session())
        api.run("save_weights_external", {"model_id": model_id, "path": "keep"})
        link = _download_urls(api, model_id, "keep")["adapter_model.safetensors"]
        first = client.get(link)
        assert first.status_code == 200
    secret = root / "url-secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    with TestClient(tinker_app(toy_service(root))) as client:  # a restarted server
        again = client.get(link)
        assert again.status_code == 200 and again.content == first.content


def test_caps_reach_create_model_over_http(tmp_path: Path) -> None:
    limits = TinkerLimits(max_lora_rank=8, max_runs_per_key=1)
    with TestClient(tinker_app(toy_service(tmp_path, limits=limits))) as client:
        api = Api(client)
        sid = api.session()
        body = {"session_id": sid, "model_seq_id": 0, "base_model": BASE_MODEL}
        big = api.http.post(
            "/api/v1/create_model", json={**body, "lora_config": {"rank": 64}}, headers=HEADERS
        )
        assert "rank" in user_error(big)
        api.model(sid, 1)
        second = api.http.post(
            "/api/v1/create_model",
            json={**body, "model_seq_id": 2, "lora_config": {"rank": 4}},
            headers=HEADERS,
        )
        assert "training runs loaded" in json.dumps(user_error(second))


@pytest.mark.parametrize("long", ["run", "name"])
def test_a_path_longer_than_any_the_server_issues_is_a_400_naming_it(
    api: Api, client: TestClient[Any], long: str
) -> None:
    """A ``tinker://`` path whose run id (or name) is thousands of characters never reaches
    the disk (the file system's name limit made it a 500): a user error naming the path, on
    every call that takes one."""
    sid = api.session()
    model_id = api.model(sid)
    run, name = ("r" * 5000, "s1") if long == "run" else (model_id, "n" * 5000)
    path = f"tinker://{run}/sampler_weights/{name}"
    calls = [
        ("weights_info", {"tinker_path": path}),
        ("load_weights", {"model_id": model_id, "path": path, "seq_id": 1}),
        (
            "create_sampling_session",
            {"session_id": sid, "sampling_session_seq_id": 0, "model_path": path},
        ),
        ("asample", sample_body([1, 2], base_model=None, model_path=path)),
    ]
    for call, body in calls:
        response = client.post(f"/api/v1/{call}", json=body, headers=HEADERS)
        if response.status_code == 200 and "request_id" in response.json():  # a future
            future = {"request_id": response.json()["request_id"]}
            response = client.post("/api/v1/retrieve_future", json=future, headers=HEADERS)
            assert response.status_code == 200 and response.json().get("category") == "user", (
                call,
                response.text[:300],
            )
            continue
        message = user_error(response)
        assert "tinker://" in message and len(message) < 400, (call, message[:300])
