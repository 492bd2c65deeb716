"""The Tinker API against the stock ``tinker`` SDK's own source and types.

1. Every ``/api/v1/...`` endpoint the installed SDK (and its CLI) can call (found by scanning
   its source)
   has a live handler here, unless it is in an explicit allow-list with the reason.
2. Our responses validate against the SDK's own pydantic types (as its client parses them)
   and our protobuf results decode with the SDK's own decoder.
"""

import ast
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pydantic
import pytest
import tinker
from litestar.testing import TestClient
from tinker import types
from tinker.proto.response_conv import deserialize_proto_response
from tinker.types.try_again_response import TryAgainResponse

from application.tinker.service import TinkerService
from tests.support.tinker_client import HEADERS, PROTOBUF, SEQ, forward_backward_proto, post_proto
from tests.support.tinker_server import BASE_MODEL, tinker_app, toy_service

os.environ.setdefault("TINKER_TELEMETRY", "0")


# --- the SDK's endpoints ----------------------------------------------------------------

SDK_ROOT = Path(tinker.__file__).parent
_HTTP_METHODS = {"get": "GET", "post": "POST", "put": "PUT", "delete": "DELETE", "patch": "PATCH"}
# Sample values for the f-string placeholders of SDK paths (checkpoint ids hold a '/').
SAMPLE_VALUES = {
    "model_id": "session-0:train:0",
    "training_run_id": "session-0:train:0",
    "checkpoint_id": "weights/step-1",
    "session_id": "session-0",
    "sampler_id": "sampler-0",
    "sampling_session_id": "sampler-0",
}

# SDK endpoints this server has no handler for, on purpose. Entries must stay accurate: a
# listed endpoint that gains a handler (or leaves the SDK) fails the test below.
NOT_SERVED: dict[tuple[str, str], str] = {
    ("POST", "/api/v1/auth/token"): "flag-gated (pjwt_auth_enabled), off here",
    ("DELETE", "/api/v1/auth/apikey/me"): "revokes the key: keys are the operator's, not the API's",
}


@dataclass(frozen=True)
class SdkCall:
    method: str
    path: str  # placeholders filled with SAMPLE_VALUES
    where: str  # file:line in the SDK


def _sdk_files() -> list[Path]:
    files = [
        *sorted((SDK_ROOT / "resources").glob("*.py")),
        *sorted((SDK_ROOT / "lib" / "public_interfaces").glob("*.py")),
        *sorted((SDK_ROOT / "lib").glob("*.py")),
        *sorted((SDK_ROOT / "cli").glob("*.py")),
    ]
    return [f for f in files if not f.name.endswith("_test.py")]


def _path_of(node: ast.expr) -> str | None:
    """The path a string literal or f-string spells, placeholders filled; None if not a
    ``/api/v1/`` path."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value if node.value.startswith("/api/v1/") else None
    if not isinstance(node, ast.JoinedStr):
        return None
    template = "".join(
        str(v.value) if isinstance(v, ast.Constant) else "{" + ast.unparse(v) + "}"
        for v in node.values
    )
    if not template.startswith("/api/v1/"):
        return None
    parts = []
    for value in node.values:
        if isinstance(value, ast.Constant):
            parts.append(str(value.value))
            continue
        assert isinstance(value, ast.FormattedValue)
        name = ast.unparse(value.value).split(".")[-1]
        if name not in SAMPLE_VALUES:
            raise AssertionError(f"no sample value for {{{name}}} in SDK path {template}")
        parts.append(SAMPLE_VALUES[name])
    return "".join(parts)


def scan_sdk() -> tuple[set[SdkCall], list[str]]:
    """(every SDK HTTP call of an /api/v1 path, path literals found outside such a call)."""
    calls: dict[tuple[str, str], SdkCall] = {}
    stray: list[str] = []
    for file in _sdk_files():
        tree = ast.parse(file.read_text(), filename=str(file))
        nodes = list(ast.walk(tree))  # the tree stays alive while ids are compared
        # Constants inside an f-string are parts of it, not literals of their own.
        parts = {id(p) for n in nodes if isinstance(n, ast.JoinedStr) for p in n.values}
        in_calls: set[int] = set()
        literals: list[tuple[int, str]] = []
        for node in nodes:
            if isinstance(node, ast.Constant | ast.JoinedStr) and id(node) not in parts:
                path = _path_of(node)
                if path is not None:
                    literals.append((id(node), f"{file.name}:{node.lineno}: {path}"))
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            method = _HTTP_METHODS.get(node.func.attr.lstrip("_"))
            args = node.args
            if method is None and node.func.attr.lstrip("_") == "request" and len(args) >= 2:
                # the CLI's style: request("GET", "/api/v1/...")
                verb = args[0]
                if isinstance(verb, ast.Constant) and str(verb.value).lower() in _HTTP_METHODS:
                    method, args = _HTTP_METHODS[str(verb.value).lower()], args[1:]
            if method is None or not args:
                continue
            path = _path_of(args[0])
            if path is not None:
                calls.setdefault(
                    (method, path), SdkCall(method, path, f"{file.name}:{node.lineno}")
                )
                in_calls.add(id(args[0]))
        stray += [where for key, where in literals if key not in in_calls]
    return set(calls.values()), stray


SDK_CALLS, STRAY_LITERALS = scan_sdk()
SDK_ORDERED: list[SdkCall] = sorted(SDK_CALLS, key=lambda c: (c.path, c.method))


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient[Any]]:
    with TestClient(tinker_app(toy_service(tmp_path))) as test_client:
        yield test_client


def send(client: TestClient[Any], method: str, path: str) -> Any:
    if method in ("POST", "PUT", "PATCH"):
        return client.request(method, path, json={}, headers=HEADERS)
    return client.request(method, path, headers=HEADERS)


def is_framework_miss(response: Any) -> bool:
    """A 404/405 the framework made (no route): our handlers' errors carry a category."""
    if response.status_code not in (404, 405):
        return False
    try:
        body = response.json()
    except ValueError:
        return True
    return not (isinstance(body, dict) and "category" in body)


def test_the_sdk_scan_finds_the_sdk_endpoints() -> None:
    found = {(c.method, c.path) for c in SDK_CALLS}
    assert len(found) >= 30, sorted(found)
    for expected in [
        ("POST", "/api/v1/forward_backward"),
        ("POST", "/api/v1/retrieve_future"),
        ("POST", "/api/v1/client/config"),
        ("GET", "/api/v1/get_server_capabilities"),
        ("GET", "/api/v1/auth/apikey/me"),  # the CLI's: request("GET", path)
        ("POST", "/api/v1/sessions/session-0/finish"),
        ("DELETE", "/api/v1/training_runs/session-0:train:0/checkpoints/weights/step-1/publish"),
        ("PUT", "/api/v1/training_runs/session-0:train:0/checkpoints/weights/step-1/ttl"),
        (
            "GET",
            "/api/v1/training_runs/session-0:train:0/checkpoints/weights/step-1/external_weights_urls",
        ),
    ]:
        assert expected in found
    # Every /api/v1 path literal of the SDK was attributed to a call with a known method
    # (a new calling style would otherwise hide endpoints from this test).
    assert STRAY_LITERALS == []


def test_framework_misses_and_handler_404s_are_told_apart(client: TestClient[Any]) -> None:
    no_route = client.post("/api/v1/definitely_not_an_endpoint", json={}, headers=HEADERS)
    assert no_route.status_code == 404 and is_framework_miss(no_route)
    wrong_method = client.get("/api/v1/create_session", headers=HEADERS)
    assert wrong_method.status_code == 405 and is_framework_miss(wrong_method)
    handler_404 = client.post("/api/v1/retrieve_future", json={"request_id": "x"}, headers=HEADERS)
    assert handler_404.status_code == 404 and not is_framework_miss(handler_404)
    assert handler_404.json()["category"] == "user"
    run = SAMPLE_VALUES["training_run_id"]
    ckpt_404 = client.get(f"/api/v1/training_runs/{run}/checkpoints", headers=HEADERS)
    assert ckpt_404.status_code == 404 and not is_framework_miss(ckpt_404)


def _name(call: SdkCall) -> str:
    return f"{call.method} {call.path}"


@pytest.mark.parametrize("call", SDK_ORDERED, ids=_name)
def test_every_sdk_endpoint_has_a_handler(client: TestClient[Any], call: SdkCall) -> None:
    response = send(client, call.method, call.path)
    reason = NOT_SERVED.get((call.method, call.path))
    if reason is not None:
        assert is_framework_miss(response), (
            f"{call.method} {call.path} is handled now ({response.status_code}): "
            f"remove it from NOT_SERVED ({reason})"
        )
        return
    assert not is_framework_miss(response), (
        f"{call.method} {call.path} (SDK {call.where}) has no handler: "
        f"{response.status_code} {response.text}"
    )
    # Garbage input is the caller's fault: never a status the SDK retries for minutes.
    assert response.status_code < 500 and response.status_code not in (408, 409, 429), (
        response.status_code,
        response.text,
    )


def test_the_allow_list_names_only_sdk_endpoints() -> None:
    found = {(c.method, c.path) for c in SDK_CALLS}
    assert set(NOT_SERVED) <= found, set(NOT_SERVED) - found


# --- responses against the SDK's types ---------------------------------------------------


def dump(request: pydantic.BaseModel) -> dict[str, Any]:
    """A request body as the SDK sends it."""
    return request.model_dump(mode="json", exclude_none=True)


def post_json(client: TestClient[Any], path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = client.post(path, json=body, headers=HEADERS)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/json")
    result: dict[str, Any] = response.json()
    return result


def get_json(client: TestClient[Any], path: str) -> Any:
    response = client.get(path, headers=HEADERS)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/json")
    return response.json()


def submit(client: TestClient[Any], path: str, body: dict[str, Any]) -> str:
    """Start a future; its reply validates as the SDK's UntypedAPIFuture."""
    return types.UntypedAPIFuture.model_validate(post_json(client, path, body)).request_id


def outcome(client: TestClient[Any], request_id: str, *, proto: bool = False) -> Any:
    """A future's final answer: JSON dict, or protobuf bytes when ``proto``."""
    headers = {**HEADERS, "Accept": PROTOBUF} if proto else HEADERS
    for _ in range(200):
        body = {"request_id": request_id, "allow_metadata_only": True}
        response = client.post("/api/v1/retrieve_future", json=body, headers=headers)
        assert response.status_code == 200, response.text
        if response.headers["content-type"].startswith(PROTOBUF):
            return response.content
        result = response.json()
        if result.get("type") != "try_again":
            return result
    raise AssertionError(f"future {request_id} never finished")


def post_forward_backward(client: TestClient[Any], model_id: str, seq_id: int) -> str:
    response = post_proto(client, forward_backward_proto(model_id, seq_id))
    assert response.status_code == 200, response.text
    return types.UntypedAPIFuture.model_validate(response.json()).request_id


def test_responses_validate_against_the_sdk_types(tmp_path: Path) -> None:
    service: TinkerService = toy_service(tmp_path)
    with TestClient(tinker_app(service)) as client:
        types.HealthResponse.model_validate(get_json(client, "/api/v1/healthz"))
        types.ClientConfigResponse.model_validate(post_json(client, "/api/v1/client/config", {}))
        caps = types.GetServerCapabilitiesResponse.model_validate(
            get_json(client, "/api/v1/get_server_capabilities")
        )
        assert BASE_MODEL in [m.model_name for m in caps.supported_models]

        session = types.CreateSessionResponse.model_validate(
            post_json(
                client,
                "/api/v1/create_session",
                dump(
                    types.CreateSessionRequest(
                        tags=["t"], user_metadata={"k": "v"}, sdk_version=tinker.__version__
                    )
                ),
            )
        )
        sid = session.session_id
        types.SessionHeartbeatResponse.model_validate(
            post_json(
                client,
                "/api/v1/session_heartbeat",
                dump(types.SessionHeartbeatRequest(session_id=sid)),
            )
        )
        types.TelemetryResponse.model_validate(post_json(client, "/api/v1/telemetry", {}))

        # Training: create, get_info, forward_backward (protobuf both ways), optim, saves.
        create = types.CreateModelRequest(
            session_id=sid,
            model_seq_id=0,
            base_model=BASE_MODEL,
            lora_config=types.LoraConfig(rank=4, seed=0),
        )
        created = types.CreateModelResponse.model_validate(
            outcome(client, submit(client, "/api/v1/create_model", dump(create)))
        )
        model_id = created.model_id
        assert model_id == f"{sid}:train:0"
        info = types.GetInfoResponse.model_validate(
            post_json(client, "/api/v1/get_info", dump(types.GetInfoRequest(model_id=model_id)))
        )
        assert (info.model_id, info.lora_rank) == (model_id, 4)

        raw = outcome(client, post_forward_backward(client, model_id, 1), proto=True)
        assert isinstance(raw, bytes)
        fb = deserialize_proto_response(raw, types.ForwardBackwardOutput)
        assert isinstance(fb, types.ForwardBackwardOutput)
        assert fb.metrics["loss:sum"] > 0
        assert all(key.count(":") == 1 for key in fb.metrics)
        assert len(fb.loss_fn_outputs[0]["logprobs"].tolist()) == len(SEQ) - 1

        optim = types.OptimStepRequest(
            optim_params=types.AdamParams(learning_rate=0.05), model_id=model_id, seq_id=2
        )
        types.OptimStepResponse.model_validate(
            outcome(client, submit(client, "/api/v1/optim_step", dump(optim)))
        )
        save = types.SaveWeightsRequest(model_id=model_id, path="step-1", seq_id=3)
        saved = types.SaveWeightsResponse.model_validate(
            outcome(client, submit(client, "/api/v1/save_weights", dump(save)))
        )
        assert saved.path == f"tinker://{model_id}/weights/step-1"
        for_sampler = types.SaveWeightsForSamplerRequest(model_id=model_id, path="s1", seq_id=4)
        sampler_saved = types.SaveWeightsForSamplerResponseInternal.model_validate(
            outcome(client, submit(client, "/api/v1/save_weights_for_sampler", dump(for_sampler)))
        )
        assert sampler_saved.path == f"tinker://{model_id}/sampler_weights/s1"
        external = types.SaveWeightsExternalRequest(model_id=model_id, path="e1", seq_id=5)
        external_saved = types.SaveWeightsExternalResponseInternal.model_validate(
            outcome(client, submit(client, "/api/v1/save_weights_external", dump(external)))
        )
        assert external_saved.path == f"tinker://{model_id}/external_weights/e1"

        # try_again: a request held behind a seq_id gap, polled with a short long-poll.
        service.long_poll_s = 0.05
        held = post_forward_backward(client, model_id, 7)
        pending = post_json(client, "/api/v1/retrieve_future", {"request_id": held})
        try_again = TryAgainResponse.model_validate(pending)
        assert (try_again.request_id, try_again.queue_state) == (held, "active")
        assert pending["type"] == "try_again"  # what the SDK's _fetch_via_rest looks at

        # Sampling: a session on the saved weights, its GET, asample with protobuf results.
        sampling = types.CreateSamplingSessionRequest(
            session_id=sid, sampling_session_seq_id=0, model_path=sampler_saved.path
        )
        sampler = types.CreateSamplingSessionResponse.model_validate(
            post_json(client, "/api/v1/create_sampling_session", dump(sampling))
        )
        got = types.GetSamplerResponse.model_validate(
            get_json(client, f"/api/v1/samplers/{sampler.sampling_session_id}")
        )
        assert (got.sampler_id, got.base_model) == (sampler.sampling_session_id, BASE_MODEL)
        assert got.model_path == sampler_saved.path
        sample = types.SampleRequest(
            num_samples=2,
            prompt=types.ModelInput.from_ints(SEQ[:3]),
            sampling_params=types.SamplingParams(max_tokens=4, seed=1),
            sampling_session_id=sampler.sampling_session_id,
            seq_id=0,
            prompt_logprobs=True,
        )
        sample_future = types.UntypedAPIFuture.model_validate(
            post_json(client, "/api/v1/asample", dump(sample))
        )
        assert sample_future.sample_sequence_ids is not None
        assert len(sample_future.sample_sequence_ids) == 2
        raw = outcome(client, sample_future.request_id, proto=True)
        assert isinstance(raw, bytes)
        sampled = deserialize_proto_response(raw, types.SampleResponse)
        assert isinstance(sampled, types.SampleResponse)
        assert len(sampled.sequences) == 2
        for seq in sampled.sequences:
            assert seq.logprobs is not None and len(seq.logprobs) == len(seq.tokens) == 4
            assert seq.stop_reason == "length"
        assert sampled.prompt_logprobs is not None and sampled.prompt_logprobs[0] is None

        # A failed future (token id outside the toy vocab 0..511).
        bad = types.SampleRequest(
            prompt=types.ModelInput.from_ints([1, 600]),
            sampling_params=types.SamplingParams(max_tokens=1),
            base_model=BASE_MODEL,
        )
        failed = types.RequestFailedResponse.model_validate(
            outcome(client, submit(client, "/api/v1/asample", dump(bad)))
        )
        assert failed.category == "user" and "0..511" in failed.error

        # REST listings.
        runs = types.TrainingRunsResponse.model_validate(get_json(client, "/api/v1/training_runs"))
        assert [r.training_run_id for r in runs.training_runs] == [model_id]
        run = types.TrainingRun.model_validate(
            get_json(client, f"/api/v1/training_runs/{model_id}")
        )
        assert run.last_checkpoint is not None and run.last_checkpoint.tinker_path == saved.path
        listed = types.CheckpointsListResponse.model_validate(
            get_json(client, f"/api/v1/training_runs/{model_id}/checkpoints")
        )
        assert {c.checkpoint_id for c in listed.checkpoints} == {
            "weights/step-1",
            "sampler_weights/s1",
            "external_weights/e1",
        }
        mine = types.CheckpointsListResponse.model_validate(get_json(client, "/api/v1/checkpoints"))
        assert len(mine.checkpoints) == 3
        winfo = types.WeightsInfoResponse.model_validate(
            post_json(client, "/api/v1/weights_info", {"tinker_path": saved.path})
        )
        assert (winfo.base_model, winfo.lora_rank) == (BASE_MODEL, 4)
        urls = types.ExternalWeightsUrlsResponse.model_validate(
            get_json(
                client,
                f"/api/v1/training_runs/{model_id}/checkpoints/external_weights/e1"
                "/external_weights_urls",
            )
        )
        assert urls.urls
        sessions = types.ListSessionsResponse.model_validate(get_json(client, "/api/v1/sessions"))
        assert sessions.sessions == [sid]
        got_session = types.GetSessionResponse.model_validate(
            get_json(client, f"/api/v1/sessions/{sid}")
        )
        assert got_session.training_run_ids == [model_id]
        assert got_session.sampler_ids == [sampler.sampling_session_id]

        unloaded = types.UnloadModelResponse.model_validate(
            outcome(
                client,
                submit(
                    client,
                    "/api/v1/unload_model",
                    dump(types.UnloadModelRequest(model_id=model_id)),
                ),
            )
        )
        assert unloaded.model_id == model_id
        assert post_json(client, f"/api/v1/sessions/{sid}/finish", {}) == {}


def test_sampling_sessions_admin_and_usage_validate_against_the_sdk_types(
    tmp_path: Path,
) -> None:
    """The routes of a sampling session's clients (join, retrieve_futures, cancel) and the
    REST / admin ones (whoami, search, project, trace export, audit, billing)."""
    from tinker.cli.auth_api import SelfApiKeyResponse

    service: TinkerService = toy_service(tmp_path)
    with TestClient(tinker_app(service)) as client:
        config = types.ClientConfigResponse.model_validate(
            post_json(client, "/api/v1/client/config", {})
        )
        assert config.sample_use_retrieve_futures and config.sample_join_sampling_session
        dynamic = types.ClientDynamicConfigResponse.model_validate(
            post_json(client, "/api/v1/client/dynamic_config", {})
        )
        assert dynamic.sample_cancel_enabled
        me = get_json(client, "/api/v1/auth/apikey/me")
        whoami = types.WhoamiResponse.model_validate(me)
        assert whoami.user_urn.startswith("tml:user:") and HEADERS["X-API-Key"] not in str(me)
        assert SelfApiKeyResponse.model_validate(me).key_id > 0

        sid = types.CreateSessionResponse.model_validate(
            post_json(
                client,
                "/api/v1/create_session",
                dump(
                    types.CreateSessionRequest(
                        tags=[],
                        user_metadata={"k": "v"},
                        sdk_version=tinker.__version__,
                        project_id="proj-a",
                        display_name="Night Run",
                    )
                ),
            )
        ).session_id
        create = types.CreateModelRequest(
            session_id=sid,
            model_seq_id=0,
            base_model=BASE_MODEL,
            lora_config=types.LoraConfig(rank=4),
        )
        model_id = types.CreateModelResponse.model_validate(
            outcome(client, submit(client, "/api/v1/create_model", dump(create)))
        ).model_id
        outcome(client, post_forward_backward(client, model_id, 1), proto=True)
        save = types.SaveWeightsRequest(model_id=model_id, path="c1", seq_id=2)
        saved = types.SaveWeightsResponse.model_validate(
            outcome(client, submit(client, "/api/v1/save_weights", dump(save)))
        )

        # A sampling session: the original client (clone 0) and a joined one (clone 1).
        sampling = types.CreateSamplingSessionRequest(
            session_id=sid, sampling_session_seq_id=0, base_model=BASE_MODEL
        )
        sampler = types.CreateSamplingSessionResponse.model_validate(
            post_json(client, "/api/v1/create_sampling_session", dump(sampling))
        ).sampling_session_id
        join = types.JoinSamplingSessionRequest(sampling_session_id=sampler)
        joined = types.JoinSamplingSessionResponse.model_validate(
            post_json(client, "/api/v1/join_sampling_session", dump(join))
        )
        assert joined.client_counter == 1
        request_ids = {}
        for clone in (0, 1):
            sample = types.SampleRequest(
                prompt=types.ModelInput.from_ints(SEQ[:3]),
                sampling_params=types.SamplingParams(max_tokens=4, seed=1),
                sampling_session_id=sampler,
                seq_id=clone * 1_000_000_000,
            )
            request_ids[clone] = submit(client, "/api/v1/asample", dump(sample))
        for clone in (0, 1):
            poll = types.FuturesRetrieveRequest(
                target=types.SamplingSessionFuturesTarget(
                    sampling_session_id=sampler, cloned_sampler_id=clone
                ),
                timeout=5,
            )
            found = types.FuturesRetrieveResponse.model_validate(
                post_json(client, "/api/v1/retrieve_futures", dump(poll))
            )
            assert [c.request_id for c in found.completions] == [request_ids[clone]]
            assert found.completions[0].state == "finished" and found.cursor > 0
        cancel = post_json(client, "/api/v1/cancel_future", {"request_id": request_ids[0]})
        assert cancel == {}  # a finished sample: nothing to stop

        # REST: the session's project, search, trace export.
        first = types.SessionSearchRequest(session_id=sid)
        [created] = types.SessionSearchResponse.model_validate(
            post_json(client, "/api/v1/sessions/search", dump(first))
        ).sessions
        assert created.project_id == "proj-a"
        moved = client.put(
            f"/api/v1/sessions/{sid}/project", json={"project_id": "proj-b"}, headers=HEADERS
        )
        assert moved.status_code == 200, moved.text
        search = types.SessionSearchRequest(display_name="night", project_ids=["proj-b"])
        page = types.SessionSearchResponse.model_validate(
            post_json(client, "/api/v1/sessions/search", dump(search))
        )
        [summary] = page.sessions
        assert (summary.session_id, summary.project_id) == (sid, "proj-b")
        assert summary.checkpoints_count == 1 and summary.checkpoint_storage_bytes
        assert isinstance(summary.status, types.SessionActive)
        export = get_json(client, f"/api/v1/sessions/{sid}/trace_export")
        assert export["status"] == "ready"
        trace = client.get(export["url"])  # no API key: the link is signed
        assert trace.status_code == 200, trace.text
        names = {e["name"] for e in trace.json()["traceEvents"] if e["ph"] == "X"}
        assert {"CreateModel", "ForwardBackward", "SaveWeights", "Sample"} <= names

        # Admin: the audit log and the usage.
        audit = types.AuditLogResponse.model_validate(get_json(client, "/api/v1/audit"))
        events = [e.event for e in audit.entries]
        assert events[:3] == ["session_create", "training_run_create", "checkpoint_create"]
        assert events[-1] == "project_session_set"
        [made] = [e for e in audit.entries if e.event == "checkpoint_create"]
        assert made.tinker_path == saved.path
        hour = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
        start, end = hour - timedelta(hours=1), hour + timedelta(hours=1)  # an hour may turn
        window = f"starting_on={start.isoformat()}&ending_before={end.isoformat()}"
        usage = types.BillingUsageResponse.model_validate(
            get_json(client, "/api/v1/billing/usage/events?" + window.replace("+", "%2B"))
        )
        kinds = {e.event_info.type: e for e in usage.data}
        assert set(kinds) == {"training", "sampling_prefill", "sampling_sample", "checkpoint"}
        assert kinds["training"].event_info.token_count == len(SEQ) - 1  # type: ignore[union-attr]
        assert kinds["sampling_sample"].event_info.token_count == 8  # type: ignore[union-attr]
        assert all(e.estimated_cost_usd is None and e.session_id == sid for e in usage.data)
        assert usage.sessions[sid].user_metadata == {"k": "v"}
        storage = types.CurrentCheckpointStorageUsageResponse.model_validate(
            get_json(client, "/api/v1/billing/usage/checkpoints/current")
        )
        [row] = storage.data
        assert (row.project_id, row.checkpoint_count) == ("proj-b", 1) and row.size_bytes > 0


# --- the SDK's client-config flags ---------------------------------------------------------

# Flags of the SDK's client configs this server leaves at the SDK's default, with why.
# Every other field must be sent explicitly (so a flag the SDK adds shows up here).
FLAGS_AT_DEFAULT: dict[str, str] = {
    "pjwt_auth_enabled": "no JWT exchange (auth/token): keys are checked on every call",
    "credential_default_source": "API keys, the SDK's default",
    "sample_dispatch_bytes_semaphore_size": "a client-side bound; the SDK's default fits",
    "inflight_response_bytes_semaphore_size": "a client-side bound; the SDK's default fits",
    "parallel_fwdbwd_chunks": "chunks in parallel (default on): served in seq_id order",
    "proto_compress_fwdbwd": "zstd bodies are not accepted (a 400 names them)",
    "fwdbwd_max_chunk_len": "datums per chunk: the token bound is the one that matters here",
    "fwdbwd_dispatch_bytes_semaphore_size": "a client-side bound; the SDK's default fits",
    "billing_exception_max_pause_duration_sec": "no billing pauses (no 402s) here",
    "sample_no_retries": "samples are retried (default), as the server expects",
    "sample_enable_stuck_detection": "default on: long polls answer within 30 s",
    "sample_max_concurrent_requests": "the engine's own slots bound the work, not the client",
    "use_pyqwest_transport": "either transport works: the SDK's default",
    "refresh_interval_sec": "dynamic config rarely changes: the SDK's default period",
    "sample_cancel_max_batch_size": "the SDK's default batch of cancels is fine",
}


def test_every_client_config_flag_is_sent_or_listed_with_a_reason(tmp_path: Path) -> None:
    with TestClient(tinker_app(toy_service(tmp_path))) as client:
        sent = {
            **post_json(client, "/api/v1/client/config", {}),
            **post_json(client, "/api/v1/client/dynamic_config", {}),
        }
    fields = {
        *types.ClientConfigResponse.model_fields,
        *types.ClientDynamicConfigResponse.model_fields,
    }
    unaccounted = sorted(f for f in fields if f not in sent and f not in FLAGS_AT_DEFAULT)
    assert not unaccounted, f"SDK client-config flags neither sent nor listed: {unaccounted}"
    stale = sorted(f for f in FLAGS_AT_DEFAULT if f in sent or f not in fields)
    assert not stale, f"listed as left at default but sent, or gone from the SDK: {stale}"
    # What is sent turns the served features on.
    assert sent["custom_loss_server_side"] and sent["sample_use_retrieve_futures"]
    assert sent["sample_join_sampling_session"] and sent["sample_cancel_enabled"]
