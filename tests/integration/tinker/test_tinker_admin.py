"""The REST and admin routes through the stock SDK (``RestClient``, ``AdminClient``, the CLI's
auth API) over real HTTP: session search, projects, trace export, audit log, usage, the
key's identity. Over raw HTTP: each tenant sees only its own, and bad input is a 400 in
Tinker's error form."""

import json
import urllib.request
import warnings
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
from litestar.testing import TestClient
from tinker import types
from tinker.cli.auth_api import AuthApiError, TinkerAuthApi
from tinker.lib.experimental import ExperimentalWarning

from adapters.http.auth import tenant_id
from tests.support.tinker_client import SEQ, Api, list_datum
from tests.support.tinker_server import API_KEY, BASE_MODEL, serve, tinker_app, toy_service


def this_hour() -> tuple[datetime, datetime]:
    """A window around now (an hour may turn during the test)."""
    hour = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    return hour - timedelta(hours=1), hour + timedelta(hours=1)


def test_rest_and_admin_clients_of_the_sdk(tmp_path: Path) -> None:
    service = toy_service(tmp_path)
    with serve(tinker_app(service)) as url:
        sc = tinker.ServiceClient(
            {"team": "rl"}, "proj-a", display_name="Nightly RL", base_url=url, api_key=API_KEY
        )
        rest = tinker.RestClient(base_url=url, api_key=API_KEY)
        admin = tinker.AdminClient(base_url=url, api_key=API_KEY)
        try:
            tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
            tc.forward_backward([list_datum(SEQ)], "cross_entropy").result()
            saved = tc.save_state("c1").result().path
            sampler = sc.create_sampling_client(base_model=BASE_MODEL).result()
            prompt = types.ModelInput.from_ints(SEQ[:3])
            sampler.sample(prompt, 2, types.SamplingParams(max_tokens=3)).result()
            session_id = sc.holder.get_session_id()
            other = tinker.ServiceClient(base_url=url, api_key=API_KEY)  # a second session
            other_id = other.holder.get_session_id()  # (made when first used)

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ExperimentalWarning)
                found = rest.search_sessions(
                    types.SessionSearchRequest(display_name="nightly rl")
                ).result()
                [summary] = found.sessions
                assert (summary.session_id, summary.project_id) == (session_id, "proj-a")
                assert summary.checkpoints_count == 1
                assert summary.user_metadata == {"team": "rl"}
                assert isinstance(summary.status, types.SessionActive)
                rest.assign_session_project(session_id, "proj-b").result()
                # Paged, newest first: the second session, then the first.
                first = rest.search_sessions(types.SessionSearchRequest(limit=1)).result()
                assert first.next_cursor is not None
                second = rest.search_sessions(
                    types.SessionSearchRequest(limit=1, cursor=first.next_cursor)
                ).result()
                assert [s.session_id for s in first.sessions + second.sessions] == [
                    other_id,
                    session_id,
                ]
                assert second.sessions[0].project_id == "proj-b" and second.next_cursor is None

            trace_url = rest.export_session_trace(session_id).result()
            with urllib.request.urlopen(trace_url, timeout=30) as response:  # no API key
                trace = json.load(response)
            ops = [e for e in trace["traceEvents"] if e["ph"] == "X"]
            assert {"CreateModel", "ForwardBackward", "SaveWeights", "Sample"} <= {
                e["name"] for e in ops
            }
            [fb] = [e for e in ops if e["name"] == "ForwardBackward"]
            assert fb["args"]["tokens"] == len(SEQ) - 1 and fb["dur"] >= 0

            log = admin.get_audit_log().result()
            events = [e.event for e in log.entries]
            assert events[:3] == ["session_create", "training_run_create", "checkpoint_create"]
            assert "project_session_set" in events
            assert [e.tinker_path for e in log.entries if e.event == "checkpoint_create"] == [saved]
            assert admin.get_audit_log("checkpoints").result().entries[0].tinker_path == saved

            start, end = this_hour()
            usage = admin.get_billing_usage(start, end).result()
            tokens = {e.event_info.type: e.event_info for e in usage.data}
            assert tokens["training"].token_count == len(SEQ) - 1  # type: ignore[union-attr]
            assert tokens["sampling_prefill"].token_count == 3  # type: ignore[union-attr]
            assert tokens["sampling_sample"].token_count == 6  # type: ignore[union-attr]
            assert tokens["checkpoint"].count == 1  # type: ignore[union-attr]
            assert {e.project_id for e in usage.data} == {"proj-b"}
            assert all(e.estimated_cost_usd is None for e in usage.data)
            storage = admin.get_current_checkpoint_storage_usage().result()
            [row] = storage.data
            assert (row.project_id, row.checkpoint_count) == ("proj-b", 1)
            assert row.size_bytes > 0 and row.org_user_urn == f"tml:user:{tenant_id(API_KEY)}"
            assert admin.get_current_checkpoint_storage_usage("nope").result().data == []

            # The CLI's `tinker auth login` check of a key.
            with httpx.Client(timeout=30) as http:
                auth = TinkerAuthApi(http, base_url=url)
                me = auth.get_self_api_key(API_KEY)
                assert me.name == tenant_id(API_KEY) and API_KEY not in me.model_dump_json()
                with pytest.raises(AuthApiError, match="401"):
                    auth.get_self_api_key("not-a-tinker-key")
            other.close("success").result()
        finally:
            sc.close("interrupted", "stopped by the test").result()

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ExperimentalWarning)
            finished = types.ClientFinishedSessionStatusQuery(reasons=["interrupted"])
            found = rest.search_sessions(types.SessionSearchRequest(statuses=[finished])).result()
        [summary] = found.sessions
        assert summary.session_id == session_id
        assert isinstance(summary.status, types.ClientSessionFinished)
        assert summary.status.reason.type == "interrupted"
        assert summary.status.detail == "stopped by the test"


# --- raw HTTP: tenancy and bad input ----------------------------------------------------


def setup_work(api: Api) -> dict[str, str]:
    """A session with a run, a checkpoint, a sampler and a finished sample."""
    session = api.session(display_name="mine", project_id="p")
    model_id = api.model(session)
    path = api.run("save_weights", {"model_id": model_id, "path": "c"})["path"]
    sampler = api.sampler(session, base_model=BASE_MODEL)
    sample = api.post(
        "asample",
        {
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
            "sampling_params": {"max_tokens": 2},
            "sampling_session_id": sampler,
            "seq_id": 0,
        },
    )["request_id"]
    api.result(sample)
    return {
        "session": session,
        "model": model_id,
        "path": path,
        "sampler": sampler,
        "sample": sample,
    }


def test_another_tenant_sees_none_of_it(client: TestClient[Any]) -> None:
    mine = Api(client)
    work = setup_work(mine)
    theirs = Api(client, {"X-API-Key": "tml-someone-else"})
    theirs.session(display_name="mine")
    target = {"sampling_session_id": work["sampler"]}
    theirs.post("join_sampling_session", target, status=404)
    theirs.post("retrieve_futures", {"target": target, "timeout": 0}, status=404)
    theirs.post("cancel_future", {"request_id": work["sample"]}, status=404)
    theirs.put(f"sessions/{work['session']}/project", {"project_id": "x"}, status=404)
    theirs.get(f"sessions/{work['session']}/trace_export", status=404)
    found = theirs.post("sessions/search", {"session_id": work["session"]})
    assert found["sessions"] == []
    assert [s["display_name"] for s in theirs.post("sessions/search", {})["sessions"]] == ["mine"]
    mine_urn = f"tml:user:{tenant_id('tml-test')}"
    owner = {"type": "user", "owner_urns": [mine_urn]}
    assert theirs.post("sessions/search", {"owner": owner})["sessions"] == []
    assert len(mine.post("sessions/search", {"owner": owner})["sessions"]) == 1
    audit = theirs.get("audit")["entries"]
    assert [e["event"] for e in audit] == ["session_create"]
    assert work["path"] not in json.dumps(audit)
    start, end = this_hour()
    window = f"starting_on={start.isoformat()}&ending_before={end.isoformat()}"
    usage = theirs.get("billing/usage/events?" + window.replace("+", "%2B"))
    assert usage["data"] == [] and usage["sessions"] == {}
    assert theirs.get("billing/usage/checkpoints/current")["data"] == []
    me = theirs.get("auth/apikey/me")
    assert me["user_urn"] != mine_urn


def test_bad_input_is_a_400_in_tinker_form(client: TestClient[Any]) -> None:
    api = Api(client)
    work = setup_work(api)
    target = {"sampling_session_id": work["sampler"]}
    session = work["session"]
    bad_posts: list[tuple[str, dict[str, Any]]] = [
        ("retrieve_futures", {}),
        ("retrieve_futures", {"target": {**target, "type": "training_run"}}),
        ("retrieve_futures", {"target": target, "prev_cursor": -1}),
        ("retrieve_futures", {"target": target, "timeout": -1}),
        ("retrieve_futures", {"target": {**target, "cloned_sampler_id": -1}}),
        ("retrieve_futures", {"target": target, "retrieved_request_ids": "x"}),
        ("join_sampling_session", {}),
        ("cancel_future", {}),
        ("sessions/search", {"limit": 0}),
        ("sessions/search", {"limit": 201}),
        ("sessions/search", {"display_name": " "}),
        ("sessions/search", {"statuses": []}),
        ("sessions/search", {"statuses": [{"type": "sleeping"}]}),
        ("sessions/search", {"statuses": [{"type": "client_finished", "reasons": ["bored"]}]}),
        ("sessions/search", {"owner": {"type": "user"}}),
        ("sessions/search", {"owner": {"type": "everyone"}}),
        ("sessions/search", {"cursor": {"last_created_at": "yesterday", "last_session_id": "s"}}),
        (f"sessions/{session}/finish", {"reason": {"type": "bored"}}),
    ]
    for path, body in bad_posts:
        answer = api.post(path, body, status=400)
        assert answer["category"] == "user" and answer["detail"], (path, body, answer)
    optim = api.post(
        "optim_step",
        {"model_id": work["model"], "adam_params": {"learning_rate": 0.01}},
    )["request_id"]
    refused = api.post("cancel_future", {"request_id": optim}, status=400)
    assert "only sampling requests" in refused["detail"]
    for project in ["", " padded ", "x" * 129, "tab\there"]:
        api.put(f"sessions/{session}/project", {"project_id": project}, status=400)
    api.put(f"sessions/{session}/project", {}, status=400)
    bad_gets = [
        "audit?event_type=everything",
        "audit?day=2025-13-01",
        "billing/usage/events",
        "billing/usage/events?starting_on=2025-01-01T00:00:00Z",
        "billing/usage/events?starting_on=2025-01-01T00:30:00Z&ending_before=2025-01-01T02:00:00Z",
        "billing/usage/events?starting_on=2025-01-01T00:00:00Z&ending_before=2025-01-20T00:00:00Z",
        "billing/usage/events?starting_on=2025-01-02T00:00:00Z&ending_before=2025-01-01T00:00:00Z",
        "billing/usage/events?starting_on=2999-01-01T00:00:00Z&ending_before=2999-01-02T00:00:00Z",
        "billing/usage/events?starting_on=soon&ending_before=later",
    ]
    for path in bad_gets:
        answer = api.get(path, status=400)
        assert answer["category"] == "user" and answer["detail"], (path, answer)
    # A trace link whose signature was tampered with: refused.
    url = api.get(f"sessions/{session}/trace_export")["url"]
    tampered = url[:-4] + ("0000" if not url.endswith("0000") else "1111")
    assert client.get(tampered).status_code == 403
    assert client.get(url.replace("expires=", "expires=1")).status_code == 403
