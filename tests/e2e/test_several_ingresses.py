"""Several ingresses, one fleet: ``infer serve --replicas 1 --ray-address ...`` started twice
against one Ray cluster; the second attaches to the fleet the first deployed. Clients run
against both through a retrying client (the other ingress on a refused or cut connection,
as a load balancer does): a Tinker run made through one ingress trains through the other;
``kill -9`` of one ingress loses nothing the client retried and does not touch the other
(nor the run); an ingress started again attaches again; an ingress that stops
leaves the application to the other, and the last one out stops the replicas. An ingress
asking for another fleet than the running one is refused, naming the flag."""

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.server import INFER, free_port
from tests.support.ray_cluster import (
    BASE_NAME,
    ENV,
    ray_cluster,
    ray_processes,
    running_replicas,
    start_server,
    stop_server,
    wait_for_replicas,
)
from tests.support.tinker_client import Api

pytestmark = pytest.mark.slow


def replica_processes() -> list[str]:
    return [line for line in ray_processes() if "ServeReplica" in line]


def serve_processes() -> list[str]:
    """The fleet's replicas and Serve's controller."""
    return [line for line in ray_processes() if "Serve" in line]


def start_ingress(log: Path, ray_port: int, *extra: str) -> tuple[str, subprocess.Popen]:
    port = free_port()
    process = start_server(
        log,
        port,
        *("--replicas", "1", "--threads", "1", "--replica-cpus", "1", "--usage-db", ":memory:"),
        *("--ray-address", f"127.0.0.1:{ray_port}", *extra),
    )
    return f"http://127.0.0.1:{port}", process


class RetryingClient:
    """Sends each completion to the next ingress in turn; on a refused or cut connection
    (or a 5xx) the same request goes to the other one, as a load balancer retries."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self.sent = self.answered = self.retried = 0
        self.answered_by: dict[str, int] = {url: 0 for url in urls}
        self.errors: list[str] = []
        self._lock = threading.Lock()

    def complete(self, i: int) -> None:
        with self._lock:
            self.sent += 1
        order = self.urls[i % 2 :] + self.urls[: i % 2]
        for attempt in range(6):
            url = order[attempt % 2]
            try:
                reply = httpx.post(
                    f"{url}/v1/completions",
                    json={"prompt": f"Count to {i}:", "max_tokens": 8},
                    timeout=120,
                )
            except httpx.TransportError as e:
                self.errors.append(f"{url}: {type(e).__name__}")
            else:
                if reply.status_code == 200:
                    with self._lock:
                        self.answered += 1
                        self.answered_by[url] += 1
                    return
                self.errors.append(f"{url}: {reply.status_code} {reply.text[:200]}")
            with self._lock:
                self.retried += 1
            time.sleep(0.2)


def test_two_ingresses_serve_one_fleet_and_survive_each_other(tmp_path: Path) -> None:
    with ray_cluster(num_cpus=2) as ray_port:
        several_ingresses(tmp_path, ray_port)
    assert not ray_processes()


def several_ingresses(tmp_path: Path, ray_port: int) -> None:
    processes: list[subprocess.Popen] = []
    try:
        url_a, a = start_ingress(tmp_path / "a.log", ray_port)
        processes.append(a)
        wait_for_replicas(url_a, a, tmp_path / "a.log", 1)
        url_b, b = start_ingress(tmp_path / "b.log", ray_port)
        processes.append(b)
        wait_for_replicas(url_b, b, tmp_path / "b.log", 1)
        assert "attaching to the fleet" in (tmp_path / "b.log").read_text()
        assert len(replica_processes()) == 1  # one fleet, not two

        # A third asking for another fleet (2 replicas) is refused, naming the flag.
        other = subprocess.run(
            [
                *(str(INFER), "serve", "--port", str(free_port()), "--replicas", "2"),
                *("--threads", "1", "--replica-cpus", "1", "--usage-db", ":memory:"),
                *("--ray-address", f"127.0.0.1:{ray_port}"),
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env=ENV,
        )
        assert other.returncode != 0
        assert "ray_address" in other.stderr or "--ray-address" in other.stderr, other.stderr
        assert running_replicas(url_a) and running_replicas(url_b)  # not disturbed

        # A Tinker run made through A trains through B (its ids name its replica).
        tinker_a = Api(httpx.Client(base_url=url_a, timeout=120), {"X-API-Key": "tml-x"})
        tinker_b = Api(httpx.Client(base_url=url_b, timeout=120), {"X-API-Key": "tml-x"})
        session = tinker_a.session()
        model_id = tinker_a.model(session, base_model=BASE_NAME)
        assert "error" not in tinker_b.result(tinker_b.forward_backward(model_id, 1))

        # Clients against both while A is killed outright.
        client = RetryingClient([url_a, url_b])
        threads = [threading.Thread(target=client.complete, args=(i,)) for i in range(40)]
        for n, thread in enumerate(threads):
            thread.start()
            if n == 10:
                os.kill(a.pid, signal.SIGKILL)
            time.sleep(0.05)
        for thread in threads:
            thread.join(timeout=300)
        assert client.sent == client.answered == 40, (client.answered, client.errors)
        assert client.retried > 0  # some went to A after it died
        b_errors = [e for e in client.errors if e.startswith(url_b)]
        assert not b_errors, b_errors  # the other ingress unaffected
        assert b.poll() is None and running_replicas(url_b)
        # the run lives on its replica, not on the ingress that made it
        assert "error" not in tinker_b.result(tinker_b.forward_backward(model_id, 2))
        tinker_b.post("session_heartbeat", {"session_id": session})

        # A started again attaches; then stopped, it leaves the fleet to B.
        url_a, a = start_ingress(tmp_path / "a2.log", ray_port)
        processes.append(a)
        wait_for_replicas(url_a, a, tmp_path / "a2.log", 1)
        assert "attaching to the fleet" in (tmp_path / "a2.log").read_text()
        assert stop_server(a) == 0
        assert "leaving the replicas to the other ingresses" in (tmp_path / "a2.log").read_text()
        reply = httpx.post(f"{url_b}/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert reply.status_code == 200, reply.text
        assert replica_processes()

        # B, the last one out, stops the replicas.
        assert stop_server(b) == 0
        assert "stopping the replicas" in (tmp_path / "b.log").read_text()
        deadline = time.monotonic() + 60
        while serve_processes() and time.monotonic() < deadline:
            time.sleep(1)
        assert not serve_processes()  # the cluster itself stays (the user started it)
    finally:
        for process in processes:
            stop_server(process)
