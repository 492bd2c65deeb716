"""``--standby-replicas``: a warm replica beside the serving one, routed to only while a
circuit breaker keeps the serving one out. One replica serving, one standby on a local Ray
cluster; the fault hook makes the serving one fail every call: every call is answered (the
failed ones ran again on the standby), and once its breaker opens the standby serves."""

import os
import time
from pathlib import Path

import httpx
import pytest

from tests.support import ray_cluster as fleet

pytestmark = pytest.mark.slow


def test_the_standby_serves_while_the_serving_replicas_breaker_is_open(tmp_path: Path) -> None:
    assert not fleet.ray_processes(), "a Ray cluster is already running here"
    log = tmp_path / "serve.log"
    url, process = fleet.start_fleet(
        log,
        *("--replicas", "1", "--standby-replicas", "1", "--threads", "1"),
        *("--usage-db", ":memory:", "--cb-failure-threshold", "2"),
        *("--cb-timeout-duration-secs", "600"),
        env={**os.environ, "INFER_FAULT_INJECTION": "1"},
    )
    try:
        fleet.wait_for_replicas(url, process, log, 2)
        time.sleep(2)  # the ingress has polled both replicas (the order they joined)
        roles = {r["id"]: r["role"] for r in fleet.running_replicas(url)}
        assert sorted(roles.values()) == ["serving", "standby"], roles
        serving = next(r for r, role in roles.items() if role == "serving")
        spare = next(r for r, role in roles.items() if role == "standby")

        def call(i: int) -> str:
            reply = httpx.post(
                f"{url}/v1/completions",
                json={"prompt": f"{i}: the weather", "max_tokens": 2},
                timeout=120,
            )
            assert reply.status_code == 200, reply.text  # 0 lost
            return reply.headers["x-infer-replica"]

        assert {call(i) for i in range(4)} == {serving}  # the standby idles
        hooked = httpx.post(f"{url}/admin/replicas/{serving}/fault", json={"fail": True})
        assert hooked.status_code == 200, hooked.text
        for i in range(4, 7):
            call(i)  # each failed call ran again on the standby
        rows = {r["id"]: r for r in fleet.running_replicas(url)}
        assert rows[serving]["breaker"] == "open" and rows[spare]["role"] == "serving"
        assert {call(i) for i in range(7, 11)} == {spare}
    finally:
        left = fleet.stop_fleet(process)
    assert not left
