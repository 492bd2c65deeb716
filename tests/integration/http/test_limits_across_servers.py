"""A tenant's limits hold across several HTTP fronts (ingresses, or servers behind one load
balancer) sharing Redis and the usage ledger, and across a restart of any of them: the
daily quota and the per-minute token limit count every front's requests once, concurrent
requests at the edge of a quota never overshoot it, and a restarted front neither forgets
the day (counters in Redis; without Redis, seeded from the ledger) nor counts it twice
(with Redis the ledger is not seeded again)."""

import json
import threading
from pathlib import Path
from typing import Any

from litestar.testing import TestClient

from adapters.fake import ByteTokenizer
from adapters.fake.runner import FakeModelRunner, reply_script
from application.access.keys import hash_key
from entrypoints.config.access import AccessSettings
from tests.fakes import fake_container


def front(tmp_path: Path, tenants: dict[str, dict[str, Any]], redis_url: str) -> TestClient:
    """One HTTP front on the fake engine, its keys file, Redis and usage ledger shared."""
    keys = tmp_path / "keys.json"
    if not keys.exists():
        rows = [{"id": t, "keys": [hash_key(f"sk-{t}")], **limits} for t, limits in tenants.items()]
        keys.write_text(json.dumps({"tenants": rows}))
    runner = FakeModelRunner(script=reply_script(ByteTokenizer(), "ok" * 10))
    access = AccessSettings(
        api_keys_file=str(keys), redis_url=redis_url, usage_db=str(tmp_path / "usage.sqlite3")
    )
    return TestClient(app=fake_container(runner, cache_dir=str(tmp_path), access=access).http_app())


def complete(client: TestClient, tenant: str, max_tokens: int = 4) -> Any:
    return client.post(
        "/v1/completions",
        json={"model": "fake", "prompt": "Hello", "max_tokens": max_tokens},
        headers={"Authorization": f"Bearer sk-{tenant}"},
    )


def test_a_daily_quota_counts_every_fronts_requests_once(tmp_path: Path, redis_url: str) -> None:
    tenants = {"day-a": {"requests_per_day": 4}}
    with front(tmp_path, tenants, redis_url) as one, front(tmp_path, tenants, redis_url) as two:
        codes = [complete(client, "day-a").status_code for client in (one, two, one, two, one, two)]
        assert codes == [200, 200, 200, 200, 429, 429]
        refused = complete(two, "day-a")
        assert refused.status_code == 429
        assert "4 requests per day" in refused.json()["error"]["message"]


def test_a_token_rate_limit_is_shared(tmp_path: Path, redis_url: str) -> None:
    # a request reserves its prompt (6 tokens) + max_tokens 15 = 21, settled to what it used
    # (the fake replies to the length: 21 again): two fit in 60 a minute, from either front
    tenants = {"tokens-b": {"tokens_per_minute": 60}}
    with front(tmp_path, tenants, redis_url) as one, front(tmp_path, tenants, redis_url) as two:
        codes = [complete(c, "tokens-b", max_tokens=15).status_code for c in (one, two, one, two)]
        assert codes == [200, 200, 429, 429]
        assert "tokens per minute" in complete(one, "tokens-b", 15).json()["error"]["message"]


def test_concurrent_requests_through_two_fronts_never_overshoot(
    tmp_path: Path, redis_url: str
) -> None:
    tenants = {"race-c": {"requests_per_day": 5}}
    codes: list[int] = []
    lock = threading.Lock()
    with front(tmp_path, tenants, redis_url) as one, front(tmp_path, tenants, redis_url) as two:

        def send(client: TestClient) -> None:
            code = complete(client, "race-c").status_code
            with lock:
                codes.append(code)

        threads = [threading.Thread(target=send, args=(c,)) for c in [one, two] * 8]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
    assert len(codes) == 16
    assert codes.count(200) == 5, codes
    assert codes.count(429) == 11, codes


def test_a_restarted_front_neither_forgets_the_day_nor_counts_it_twice(
    tmp_path: Path, redis_url: str
) -> None:
    tenants = {"restart-d": {"requests_per_day": 4}}
    with front(tmp_path, tenants, redis_url) as one, front(tmp_path, tenants, redis_url) as two:
        assert complete(one, "restart-d").status_code == 200
        assert complete(two, "restart-d").status_code == 200
    # Both fronts restarted (the ledger holds 2 requests, Redis counts 2): 2 more, not 0
    # (seeded again on top of Redis) and not 4 (forgotten).
    with front(tmp_path, tenants, redis_url) as one, front(tmp_path, tenants, redis_url) as two:
        codes = [complete(c, "restart-d").status_code for c in (two, one, two, one)]
    assert codes == [200, 200, 429, 429]
