"""The keys file's request limits on the Tinker API: work-submitting calls count, polls and
heartbeats do not; a refused call is a 429 in Tinker's error format."""

from pathlib import Path

from litestar import Litestar
from litestar.testing import TestClient

from adapters.http.tinker import tinker_router
from adapters.storage.rate_limits import LimitsCounters
from application.access import Access
from application.keys import Keyring, hash_key
from application.quotas import Quotas
from domain.tenancy import Tenant, TenantLimits
from tests.support.tinker_server import toy_service

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
