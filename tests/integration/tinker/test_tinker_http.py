"""The Tinker API's edges over raw HTTP (and the stock SDK where it has the call): keys,
unknown fields, the retrieve_future long poll, failed futures, error statuses, checkpoint
downloads, ttl, publishing and session listings."""

import io
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

import httpx
import pytest
import tinker
from litestar.testing import TestClient
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from application.tinker.service import TinkerService
from tests.support.tinker_client import (
    HEADERS,
    PROTOBUF,
    SEQ,
    Api,
    datum,
    json_datum,
    model_body,
    sample_body,
)
from tests.support.tinker_server import API_KEY, BASE_MODEL, serve, tinker_app, toy_service

EXTRA = {"future_field": 1}  # a field a newer SDK might send


@pytest.fixture
def service(tmp_path: Path) -> TinkerService:
    # a future that never finishes fails a test fast
    return toy_service(tmp_path / "ckpt", long_poll_s=0.5)


# --- API keys -----------------------------------------------------------------------------


def test_requests_without_a_tml_key_are_refused(client: TestClient[Any]) -> None:
    for headers in ({}, {"X-API-Key": ""}, {"X-API-Key": "sk-not-tinker"}):
        response = client.post("/api/v1/create_session", json={"tags": []}, headers=headers)
        assert response.status_code == 401, (headers, response.text)
        assert response.json()["category"] == "user"
        assert client.get("/api/v1/training_runs", headers=headers).status_code == 401
    for headers in ({"X-API-Key": "tml-anyone"}, {"Authorization": "Bearer tml-anyone"}):
        response = client.post("/api/v1/create_session", json={"tags": []}, headers=headers)
        assert response.status_code == 200, response.text


def test_configured_keys_are_the_only_ones_accepted(tmp_path: Path) -> None:
    app = tinker_app(toy_service(tmp_path), api_keys=frozenset({"tml-a"}))
    with TestClient(app) as client:
        refused = client.post("/api/v1/create_session", json={}, headers={"X-API-Key": "tml-b"})
        assert refused.status_code == 401 and refused.json()["category"] == "user"
        assert client.get("/api/v1/sessions", headers={"X-API-Key": "tml-b"}).status_code == 401
        accepted = client.post("/api/v1/create_session", json={}, headers={"X-API-Key": "tml-a"})
        assert accepted.status_code == 200, accepted.text
        listed = client.get("/api/v1/sessions", headers={"X-API-Key": "tml-a"})
        assert listed.json()["sessions"] == [accepted.json()["session_id"]]


# --- unknown fields -----------------------------------------------------------------------


def test_unknown_fields_in_every_request_are_ignored(api: Api) -> None:
    sid = api.session(**EXTRA)
    assert (
        api.post("session_heartbeat", {"session_id": sid, **EXTRA})["type"] == "session_heartbeat"
    )
    created = api.run(
        "create_model",
        {
            "session_id": sid,
            "model_seq_id": 0,
            "base_model": BASE_MODEL,
            "lora_config": {"rank": 4, "seed": 0, **EXTRA},
            "optimizer_config": {"type": "adamw", **EXTRA},
            **EXTRA,
        },
    )
    model_id = created["model_id"]
    info = api.post("get_info", {"model_id": model_id, **EXTRA})
    assert info["model_id"] == model_id and info["lora_rank"] == 4

    fbi = {"loss_fn": "cross_entropy", "data": [json_datum(SEQ, **EXTRA)], **EXTRA}
    out = api.run(
        "forward", {"model_id": model_id, "seq_id": 1, "forward_backward_input": fbi, **EXTRA}
    )
    assert len(out["loss_fn_outputs"][0]["logprobs"]["data"]) == len(SEQ) - 1
    # Protobuf: an unknown field (number 999, varint 1) appended to the SDK's own encoding.
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=[datum(SEQ)], loss_fn="cross_entropy"
        ),
        model_id=model_id,
        seq_id=2,
    )
    body = forward_backward_request_to_proto(request).SerializeToString() + b"\xb8\x3e\x01"
    response = api.http.post(
        "/api/v1/forward_backward",
        content=body,
        headers={**HEADERS, "Content-Type": PROTOBUF},
    )
    assert response.status_code == 200, response.text
    assert "loss:sum" in api.result(response.json()["request_id"])["metrics"]

    adam = {"learning_rate": 0.01, **EXTRA}
    metrics = api.run(
        "optim_step", {"model_id": model_id, "seq_id": 3, "adam_params": adam, **EXTRA}
    )["metrics"]
    assert isinstance(metrics, dict)
    saved = api.run("save_weights", {"model_id": model_id, "path": "w1", "seq_id": 4, **EXTRA})
    for_sampler = api.run(
        "save_weights_for_sampler", {"model_id": model_id, "path": "s1", "seq_id": 5, **EXTRA}
    )
    external = api.run(
        "save_weights_external", {"model_id": model_id, "path": "e1", "seq_id": 6, **EXTRA}
    )
    assert external["path"].endswith("/external_weights/e1")
    loaded = api.run(
        "load_weights", {"model_id": model_id, "path": saved["path"], "seq_id": 7, **EXTRA}
    )
    assert loaded["model_id"] == model_id

    sampler = api.sampler(sid, model_path=for_sampler["path"], **EXTRA)
    body = sample_body(SEQ[:3], sampling_session_id=sampler, seq_id=0, **EXTRA)
    body["sampling_params"] |= EXTRA
    body["prompt"] |= EXTRA
    del body["base_model"]
    sampled = api.run("asample", body)
    assert len(sampled["sequences"]) == 1 and len(sampled["sequences"][0]["tokens"]) == 3
    # retrieve_future itself, weights_info and ttl take unknown fields too.
    future = api.post("asample", sample_body(SEQ[:3]))["request_id"]
    assert "sequences" in api.result(future, **EXTRA)
    winfo = api.post("weights_info", {"tinker_path": saved["path"], **EXTRA})
    assert winfo["base_model"] == BASE_MODEL
    api.put(f"training_runs/{model_id}/checkpoints/weights/w1/ttl", {"ttl_seconds": 99, **EXTRA})
    assert api.post("telemetry", {"events": [], **EXTRA}) == {"status": "accepted"}
    assert api.run("unload_model", {"model_id": model_id, **EXTRA})["model_id"] == model_id


# --- the retrieve_future long poll ---------------------------------------------------------


def test_retrieve_future_long_polls_then_says_try_again(service: TinkerService) -> None:
    service.long_poll_s = 0.2
    with serve(tinker_app(service)) as url, httpx.Client(base_url=url, timeout=30) as http:
        api = Api(http)
        model_id = api.model(api.session())
        # Sent first, run last: seq 3 (a forward) waits for seq 1 (forward_backward) and
        # seq 2 (an optim step with lr 0.05).
        third = api.forward_backward(model_id, 3, forward_only=True)
        second = api.post(
            "optim_step",
            {"model_id": model_id, "seq_id": 2, "adam_params": {"learning_rate": 0.05}},
        )["request_id"]
        start = time.monotonic()
        pending = api.poll(third)
        waited = time.monotonic() - start
        assert pending == {"type": "try_again", "request_id": third, "queue_state": "active"}
        assert 0.15 <= waited < 5, waited  # held for the long poll, not answered at once
        assert api.poll(second)["type"] == "try_again"

        # A long poll in flight returns as soon as its future finishes.
        service.long_poll_s = 10
        with ThreadPoolExecutor(1) as pool:
            polling = pool.submit(api.poll, third)
            time.sleep(0.2)
            assert not polling.done()
            start = time.monotonic()
            first = api.forward_backward(model_id, 1)
            answer = polling.result(timeout=10)
        assert time.monotonic() - start < 5
        assert "loss:sum" in answer["metrics"], answer
        before = api.result(first)["metrics"]["loss:sum"]
        assert "metrics" in api.result(second)
        # Run in seq_id order: the forward (seq 3) saw the weights after the step (seq 2).
        assert answer["metrics"]["loss:sum"] < before


def test_a_failed_future_answers_200_with_error_and_category(api: Api) -> None:
    request_id = api.post("asample", sample_body([1, 600]))["request_id"]  # vocab is 0..511
    answer = api.result(request_id)
    assert set(answer) == {"error", "category"}
    assert answer["category"] == "user" and "0..511" in answer["error"]
    # Also when the client asks for protobuf (a sampling result's form): still JSON.
    response = api.http.post(
        "/api/v1/retrieve_future",
        json={"request_id": request_id},
        headers={**HEADERS, "Accept": PROTOBUF},
    )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/json")
    assert response.json() == answer


def test_futures_of_another_key_are_not_found(api: Api) -> None:
    request_id = api.post("asample", sample_body([1, 2]))["request_id"]
    assert "sequences" in api.result(request_id)
    other = Api(api.http, {"X-API-Key": "tml-other"})
    answer = other.post("retrieve_future", {"request_id": request_id}, status=404)
    assert answer["category"] == "user"


# --- bad input gets a permanent 4xx ---------------------------------------------------------


def test_bad_input_is_never_answered_with_a_retryable_status(api: Api) -> None:
    sid = api.session()
    model_id = api.model(sid)
    fbi = {"loss_fn": "cross_entropy", "data": [json_datum(SEQ)]}
    proto = {**HEADERS, "Content-Type": PROTOBUF}
    cases: list[tuple[str, str, dict[str, Any], int]] = [
        # (what, path, request kwargs, expected status)
        ("malformed JSON", "create_session", {"content": b"{not json"}, 400),
        ("JSON array body", "create_model", {"content": b"[1, 2]"}, 400),
        ("deeply nested JSON", "create_model", {"content": b"[" * 100_000}, 400),
        ("wrong type", "create_model", {"json": {"session_id": 5, "model_seq_id": "x"}}, 400),
        ("missing field", "get_info", {"json": {}}, 400),
        (
            "unknown loss_fn",
            "forward",
            {
                "json": {
                    "model_id": model_id,
                    "forward_backward_input": {**fbi, "loss_fn": "no_such_loss"},
                }
            },
            400,
        ),
        (
            "unknown base_model",
            "create_model",
            {"json": model_body(sid, 1, base_model="no/such-model")},
            400,
        ),
        ("bad tinker path", "weights_info", {"json": {"tinker_path": "tinker://nope"}}, 400),
        ("not a tinker path", "weights_info", {"json": {"tinker_path": "s3://b/k"}}, 400),
        (
            "unknown checkpoint",
            "weights_info",
            {"json": {"tinker_path": f"tinker://{model_id}/weights/missing"}},
            404,
        ),
        ("unknown future id", "retrieve_future", {"json": {"request_id": "req-999999"}}, 404),
        ("unknown model", "get_info", {"json": {"model_id": "nope:train:0"}}, 404),
        ("unknown session", "session_heartbeat", {"json": {"session_id": "session-nope"}}, 404),
        (
            "garbage protobuf",
            "forward_backward",
            {"content": b"\xff\xff\xff\xff", "headers": proto},
            400,
        ),
        (
            "zstd body while off",
            "forward_backward",
            {"content": b"x", "headers": {**proto, "Content-Encoding": "zstd"}},
            400,
        ),
        (
            "bad adam params",
            "optim_step",
            {"json": {"model_id": model_id, "adam_params": {"learning_rate": -1}}},
            400,
        ),
        (
            "bad lora rank",
            "create_model",
            {"json": model_body(sid, 2, lora_config={"rank": 0})},
            400,
        ),
        ("num_samples 0", "asample", {"json": sample_body([1, 2], num_samples=0)}, 400),
        ("empty prompt", "asample", {"json": sample_body([])}, 400),
        (
            "bad checkpoint name",
            "save_weights",
            {"json": {"model_id": model_id, "path": "../x"}},
            400,
        ),
        ("copy_weights (unsupported)", "copy_weights", {"json": {}}, 400),
    ]
    for what, path, kwargs, status in cases:
        headers = kwargs.pop("headers", HEADERS)
        response = api.http.post(f"/api/v1/{path}", headers=headers, **kwargs)
        assert response.status_code == status, (what, response.status_code, response.text)
        body = response.json()
        assert body["category"] == "user" and body["error"], (what, body)

    # A seq_id at or behind the last one run (0 is the run's creation) is the caller's
    # mistake too: 400, not 409.
    stale = api.http.post(
        "/api/v1/optim_step", json={"model_id": model_id, "seq_id": 0}, headers=HEADERS
    )
    assert stale.status_code == 400, stale.text
    assert stale.json()["category"] == "user"

    # A finished session: heartbeats and new work get 410 (which stops the SDK's heartbeat).
    assert api.post(f"sessions/{sid}/finish", {}) == {}
    gone = api.http.post("/api/v1/session_heartbeat", json={"session_id": sid}, headers=HEADERS)
    assert gone.status_code == 410 and gone.json()["category"] == "user"
    late = api.http.post("/api/v1/create_model", json=model_body(sid, 3), headers=HEADERS)
    assert late.status_code == 410, late.text
    assert api.post(f"sessions/{sid}/finish", {}) == {}  # finishing again is fine


# --- checkpoint download ---------------------------------------------------------------------


def _with_query(url: str, **changes: str) -> str:
    parts = urlsplit(url)
    query = {k: v[0] for k, v in parse_qs(parts.query).items()} | changes
    return urlunsplit(parts._replace(query=urlencode(query)))


def test_external_weights_download_without_the_key(service: TinkerService) -> None:
    with serve(tinker_app(service)) as url:
        sc = tinker.ServiceClient(base_url=url, api_key=API_KEY)
        tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=0).result()
        tc.forward_backward([datum(SEQ)], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=0.05)).result()
        path = tc.save_weights_external("exported").result().path
        assert path == f"tinker://{tc.model_id}/external_weights/exported"

        rest = tinker.RestClient(base_url=url, api_key=API_KEY)
        urls = rest.get_external_weights_urls(path).result().urls
        folder = service.storage.folder(tc.model_id, "external", "exported")
        assert set(urls) == {"adapter_model.safetensors", "adapter_config.json"}
        with httpx.Client(timeout=30) as http:  # no API key
            for name, link in urls.items():
                got = http.get(link)
                assert got.status_code == 200, got.text
                assert got.content == (folder / name).read_bytes()
            link = urls["adapter_model.safetensors"]
            sig = parse_qs(urlsplit(link).query)["sig"][0]
            tampered = sig[:-1] + ("0" if sig[-1] != "0" else "1")
            assert http.get(_with_query(link, sig=tampered)).status_code == 403
            expires = int(parse_qs(urlsplit(link).query)["expires"][0])
            assert http.get(_with_query(link, expires=str(expires + 1))).status_code == 403
            other_file = link.replace("adapter_model.safetensors", "adapter_config.json")
            assert http.get(other_file).status_code == 403  # a link is for its own file only

            archive_url = (
                f"{url}/api/v1/training_runs/{tc.model_id}/checkpoints/external_weights/exported"
                "/archive"
            )
            assert http.get(archive_url).status_code == 401  # the archive needs the key
            archive = http.get(archive_url, headers={"X-API-Key": API_KEY})
            assert archive.status_code == 200, archive.text
        with tarfile.open(fileobj=io.BytesIO(archive.content)) as tar:
            members = {m.name: tar.extractfile(m) for m in tar.getmembers()}
            assert set(members) == set(urls)
            for name, member in members.items():
                assert member is not None and member.read() == (folder / name).read_bytes()
        # Links die with their checkpoint.
        rest.delete_checkpoint_from_tinker_path(path).result()
        with httpx.Client(timeout=30) as http:
            gone = http.get(urls["adapter_config.json"])
        assert gone.status_code == 404 and gone.json()["category"] == "user"
        sc.close("success").result()


def test_external_weights_urls_of_a_checkpoint_named_files(api: Api) -> None:
    model_id = api.model(api.session())
    api.run("save_weights_external", {"model_id": model_id, "path": "files"})
    urls = api.get(
        f"training_runs/{model_id}/checkpoints/external_weights/files/external_weights_urls"
    )
    assert set(urls["urls"]) == {"adapter_model.safetensors", "adapter_config.json"}


# --- ttl and publishing --------------------------------------------------------------------


def _listed(api: Api, model_id: str) -> dict[str, dict[str, Any]]:
    checkpoints = api.get(f"training_runs/{model_id}/checkpoints")["checkpoints"]
    return {c["checkpoint_id"]: c for c in checkpoints}


def test_a_checkpoint_past_its_ttl_is_deleted_by_maintenance(
    api: Api, service: TinkerService
) -> None:
    model_id = api.model(api.session())
    api.run("save_weights", {"model_id": model_id, "path": "short"})
    api.run("save_weights", {"model_id": model_id, "path": "kept"})
    folder = service.storage.folder(model_id, "training", "short")
    assert folder.is_dir()
    ttl = f"training_runs/{model_id}/checkpoints/weights/short/ttl"
    api.put(ttl, {"ttl_seconds": 0}, status=400)
    api.put(ttl, {"ttl_seconds": 1})
    listed = _listed(api, model_id)
    assert listed["weights/short"]["expires_at"] is not None
    assert listed["weights/kept"]["expires_at"] is None
    service.maintain()  # not yet expired
    assert "weights/short" in _listed(api, model_id)

    time.sleep(1.1)
    service.maintain()
    assert set(_listed(api, model_id)) == {"weights/kept"}
    assert [c["checkpoint_id"] for c in api.get("checkpoints")["checkpoints"]] == ["weights/kept"]
    assert not folder.exists()
    api.post("weights_info", {"tinker_path": f"tinker://{model_id}/weights/short"}, status=404)

    # ttl null clears an expiry.
    kept_ttl = f"training_runs/{model_id}/checkpoints/weights/kept/ttl"
    api.put(kept_ttl, {"ttl_seconds": 1})
    api.put(kept_ttl, {"ttl_seconds": None})
    assert _listed(api, model_id)["weights/kept"]["expires_at"] is None


def test_publish_and_unpublish_toggle_public(service: TinkerService) -> None:
    with serve(tinker_app(service)) as url:
        sc = tinker.ServiceClient(base_url=url, api_key=API_KEY)
        tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=0).result()
        path = tc.save_state("shared").result().path
        rest = tinker.RestClient(base_url=url, api_key=API_KEY)
        other = tinker.RestClient(base_url=url, api_key="tml-someone-else")

        def public() -> bool:
            (ckpt,) = rest.list_checkpoints(tc.model_id).result().checkpoints
            return bool(ckpt.public)

        assert public() is False
        with pytest.raises(tinker.NotFoundError):
            other.get_weights_info_by_tinker_path(path).result()
        rest.publish_checkpoint_from_tinker_path(path).result()
        assert public() is True
        assert other.get_weights_info_by_tinker_path(path).result().base_model == BASE_MODEL
        with pytest.raises(tinker.NotFoundError):  # readable, not deletable, by another key
            other.delete_checkpoint_from_tinker_path(path).result()
        rest.unpublish_checkpoint_from_tinker_path(path).result()
        assert public() is False
        with pytest.raises(tinker.NotFoundError):
            other.get_weights_info_by_tinker_path(path).result()
        sc.close("success").result()


def test_deleting_a_checkpoint_named_publish(api: Api) -> None:
    model_id = api.model(api.session())
    api.run("save_weights", {"model_id": model_id, "path": "publish"})
    response = api.http.delete(
        f"/api/v1/training_runs/{model_id}/checkpoints/weights/publish", headers=HEADERS
    )
    assert response.status_code == 200, response.text
    assert _listed(api, model_id) == {}


# --- sessions ------------------------------------------------------------------------------


def test_sessions_are_listed_per_key_with_their_runs_and_samplers(api: Api) -> None:
    mine = [api.session(), api.session()]
    other = Api(api.http, {"X-API-Key": "tml-other"})
    theirs = other.session()
    assert api.get("sessions")["sessions"] == mine
    assert other.get("sessions")["sessions"] == [theirs]
    assert api.get("sessions?offset=1&limit=1")["sessions"] == mine[1:]

    model_id = api.model(mine[0])
    api.run("save_weights_for_sampler", {"model_id": model_id, "path": "s"})
    sampler = api.sampler(mine[0], base_model=BASE_MODEL)
    snapshot = api.run(
        "save_weights_for_sampler", {"model_id": model_id, "sampling_session_seq_id": 1}
    )["sampling_session_id"]
    session = api.get(f"sessions/{mine[0]}")
    assert session["training_run_ids"] == [model_id]
    assert sorted(session["sampler_ids"]) == sorted([sampler, snapshot])
    assert api.get(f"sessions/{mine[1]}") | {"user_metadata": None} == {
        "training_run_ids": [],
        "sampler_ids": [],
        "user_metadata": None,
        "display_name": None,
    }
    other.get(f"sessions/{mine[0]}", status=404)
    api.get(f"sessions/{theirs}", status=404)


def test_pending_futures_counts_what_is_not_resolved(service: TinkerService) -> None:
    assert service.pending_futures() == 0
    future = service.futures.create("tml-owner", "ForwardBackward")
    assert service.pending_futures() == 1
    service.futures.resolve(future, {"done": True})
    assert service.pending_futures() == 0
