"""Ray for the fleet's end-to-end tests and the chaos run: the Ray processes running here,
a fleet server started and stopped (``start_fleet``, ``stop_fleet``) and its replicas
waited for (``wait_for_replicas``),
a throwaway cluster on 127.0.0.1 (``ray start --head``, without Ray's token auth: a
cluster a user starts keeps it, its token in ~/.ray reaching ``infer serve`` on the same
machine), and a server process stopped as an operator would (SIGTERM, then SIGKILL of its
group), Ray's own processes waited for."""

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from tests.e2e.server import INFER, free_port

RAY = Path(INFER).with_name("ray")
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled"}
START_TIMEOUT_S = 420
BASE_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the default model's served name


def ray_processes() -> list[str]:
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return [
        line
        for line in out.splitlines()
        if ("ray::" in line or "raylet" in line or "gcs_server" in line)
        and "<defunct>" not in line  # ended, not yet reaped by its parent
    ]


def wait_for_no_ray(seconds: int = 30) -> list[str]:
    """Until Ray's processes are gone (they end shortly after their driver); those left."""
    for _ in range(seconds):
        if not ray_processes():
            break
        time.sleep(1)
    return ray_processes()


@contextlib.contextmanager
def ray_cluster(num_cpus: int, num_gpus: int = 0) -> Iterator[int]:
    """A head node on 127.0.0.1; yields its port; ``ray stop --force`` at the end."""
    assert not ray_processes(), "a Ray cluster is already running here"
    port = free_port()
    subprocess.run(
        [
            *(str(RAY), "start", "--head", "--port", str(port), "--num-cpus", str(num_cpus)),
            *(("--num-gpus", str(num_gpus)) if num_gpus else ()),
            *("--node-ip-address", "127.0.0.1", "--disable-usage-stats"),
            *("--include-dashboard", "false"),
        ],
        check=True,
        capture_output=True,
        timeout=120,
        env=ENV,
    )
    try:
        yield port
    finally:
        subprocess.run([str(RAY), "stop", "--force"], check=False, capture_output=True, env=ENV)
        wait_for_no_ray()


def start_server(
    log: Path, port: int, *flags: str, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """``infer serve --port PORT FLAGS...`` in a session of its own, its output in ``log``
    (``env``: the environment, default :data:`ENV`)."""
    with log.open("w") as out:
        return subprocess.Popen(
            [str(INFER), "serve", "--port", str(port), *flags],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=ENV if env is None else env,
        )


def stop_server(process: subprocess.Popen, timeout_s: float = 120) -> int | None:
    """SIGTERM, then its whole group killed after ``timeout_s`` (with Ray's processes:
    ``ray stop --force``); its exit code, None where it had to be killed."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        subprocess.run([str(RAY), "stop", "--force"], check=False, capture_output=True, env=ENV)
        return None


def running_replicas(url: str) -> list[dict]:
    try:
        listed = httpx.get(f"{url}/admin/replicas", timeout=5).json()["data"]
    except (httpx.TransportError, ValueError, KeyError):
        return []
    return [r for r in listed if r["state"] == "running"]


def wait_for_replicas(url: str, process: subprocess.Popen, log: Path, count: int) -> None:
    """Until ``count`` replicas run behind ``url`` (the server's log in the failure)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while len(running_replicas(url)) < count:
        assert process.poll() is None, log.read_text()[-4000:]
        assert time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(1)


def start_fleet(
    log: Path, *flags: str, env: dict[str, str] | None = None
) -> tuple[str, subprocess.Popen]:
    """``infer serve --port <a free one> FLAGS`` in a session of its own, its output in
    ``log``: its URL and its process."""
    port = free_port()
    return f"http://127.0.0.1:{port}", start_server(log, port, *flags, env=env)


def stop_fleet(process: subprocess.Popen) -> list[str]:
    """SIGTERM the server (past 120 s killed, Ray's processes stopped: a failure); the Ray
    processes still running 30 s after it ended (stopped then: the caller asserts there
    were none)."""
    assert stop_server(process) is not None, "the server did not stop within 120 s"
    left = wait_for_no_ray()
    if left:
        subprocess.run([str(RAY), "stop", "--force"], check=False)
    return left
