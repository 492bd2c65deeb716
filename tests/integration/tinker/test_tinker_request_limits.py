"""The keys file's limits on the Tinker API: work-submitting calls count against the
request limits, polls and heartbeats do not; samples reserve tokens and a stream until they
finish, forward/backward is charged its tokens; a refused call is a 429 in Tinker's error
format (a 400 for work larger than the whole minute)."""

import asyncio
import time
from pathlib import Path

from litestar import Litestar
from litestar.testing import TestClient

from adapters.fake.toy_backend import ToyBackend
from adapters.http.tinker import tinker_router
from adapters.storage.checkpoints import FileCheckpointStorage
from adapters.storage.rate_limits import LimitsCounters
from application.access.access import Access
from application.access.keys import Keyring, hash_key
from application.access.quotas import Quotas
from application.tinker.service import TinkerService
from domain.tenancy import Tenant, TenantLimits
from tests.support.tinker_client import SEQ, Api, forward_backward_proto, post_proto, sample_body
from tests.support.tinker_server import BASE_MODEL, GatedSampler, tinker_app, toy_service

Counters = LimitsCounters

KEY, OTHER = "tml-limited", "tml-free"


def test_work_calls_count_against_the_keys_request_limit(tmp_path: Path) -> None:
    limited = Tenant("limited", limits=TenantLimits(requests_per_minute=3))
    keyring = Keyring([(hash_key(KEY), limited), (hash_key(OTHER), Tenant("free"))])
    access = Access(keyring, Quotas(LimitsCounters()))
    app = Litestar(route_handlers=[tinker_router(toy_service(tmp_path), access=access)])
    with TestClient(app) as client:
        headers = {"X-API-Key": KEY}
        session = client.post("/api/v1/create_session", json={}, headers=headers)
        assert session.status_code == 200, session.text
        session_id = session.json()["session_id"]
        for _ in range(5):  # heartbeats and polls are free
            beat = {"session_id": session_id}
            assert client.post("/api/v1/session_heartbeat", json=beat, headers=headers).is_success
            poll = {"request_id": "req-none"}
            assert (
                client.post("/api/v1/retrieve_future", json=poll, headers=headers).status_code
                == 404
            )
        for _ in range(2):
            assert client.post("/api/v1/create_session", json={}, headers=headers).is_success
        refused = client.post("/api/v1/create_session", json={}, headers=headers)
        assert refused.status_code == 429
        assert refused.json()["category"] == "user"
        assert "3 requests per minute" in refused.json()["detail"]
        assert refused.headers["x-ratelimit-limit-requests"] == "3"
        # Another key has its own (no) limits.
        other = client.post("/api/v1/create_session", json={}, headers={"X-API-Key": OTHER})
        assert other.is_success


def limited_app(tmp_path: Path, limits: TenantLimits) -> tuple[Litestar, GatedSampler, Counters]:
    """A Tinker app whose key ``KEY`` has ``limits``, sampling through a gate."""
    backend = ToyBackend(BASE_MODEL)
    gate = GatedSampler(backend)
    service = TinkerService(backend, gate, FileCheckpointStorage(tmp_path))
    counters = LimitsCounters()
    access = Access(Keyring([(hash_key(KEY), Tenant("limited", limits=limits))]), Quotas(counters))
    return tinker_app(service, access=access), gate, counters


def tokens_left(counters: Counters, per_minute: int) -> int:
    """What is left of the key's tokens this minute (taking none)."""
    _, state = asyncio.run(counters.take("tokens:limited", 0, per_minute, 60))
    return state.remaining


def test_samples_reserve_tokens_and_a_stream_until_they_finish(tmp_path: Path) -> None:
    app, gate, counters = limited_app(
        tmp_path, TenantLimits(tokens_per_minute=100, max_concurrent_streams=1)
    )
    with TestClient(app) as client:
        api = Api(client, {"X-API-Key": KEY})
        prompt = [3, 14, 15]
        # More than the whole minute: a 400 (the SDK would retry a 429 for ever).
        too_big = sample_body(prompt, sampling_params={"max_tokens": 200})
        refused = api.post("asample", too_big, status=400)
        assert "100 tokens per minute" in refused["detail"], refused
        assert tokens_left(counters, 100) == 100  # nothing kept of it
        # Prompt + max_tokens for each of 2 samples are reserved while it runs ...
        body = sample_body(prompt, sampling_params={"max_tokens": 10, "seed": 1}, num_samples=2)
        first = api.post("asample", body)["request_id"]
        assert gate.started.wait(30)
        assert tokens_left(counters, 100) == 100 - (3 + 2 * 10)
        # ... with the key's one stream: a second sample waits for it (429, retried).
        busy = client.post("/api/v1/asample", json=body, headers=api.headers)
        assert busy.status_code == 429, busy.text
        assert "1 at once" in busy.json()["detail"]
        assert tokens_left(counters, 100) == 100 - (3 + 2 * 10)  # the refused one kept none
        # Once it finishes, what it did not use is given back and the stream is free.
        gate.open.set()
        result = api.result(first)
        used = 3 + sum(len(s["tokens"]) for s in result["sequences"])
        deadline = time.monotonic() + 10
        while tokens_left(counters, 100) != 100 - used and time.monotonic() < deadline:
            time.sleep(0.01)
        assert tokens_left(counters, 100) == 100 - used
        assert api.result(api.post("asample", body)["request_id"])["sequences"]


def test_forward_backward_is_charged_its_data_tokens(tmp_path: Path) -> None:
    app, _, counters = limited_app(tmp_path, TenantLimits(tokens_per_minute=20))
    with TestClient(app) as client:
        api = Api(client, {"X-API-Key": KEY})
        model = api.model(api.session())
        assert tokens_left(counters, 20) == 20  # sessions and models cost no tokens
        api.result(api.forward_backward(model, 1))
        assert tokens_left(counters, 20) == 20 - (len(SEQ) - 1)
        api.result(api.forward_backward(model, 2))
        refused = post_proto(client, forward_backward_proto(model, 3), api.headers)
        assert refused.status_code == 429, refused.text
        assert "20 tokens per minute" in refused.json()["detail"]
        assert tokens_left(counters, 20) == 20 - 2 * (len(SEQ) - 1)


def test_work_larger_than_the_whole_day_is_a_400(tmp_path: Path) -> None:
    app, _, _ = limited_app(tmp_path, TenantLimits(tokens_per_day=50))
    with TestClient(app) as client:
        api = Api(client, {"X-API-Key": KEY})
        too_big = sample_body([3, 14, 15], sampling_params={"max_tokens": 60})
        refused = api.post("asample", too_big, status=400)
        assert "50 tokens per day" in refused["detail"], refused
