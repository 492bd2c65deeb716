"""``--replica-gpus``: each replica asks Ray for GPUs, and Ray shows it the ones it got
(``CUDA_VISIBLE_DEVICES``). This machine has none: a Ray cluster started with
``--num-gpus 2`` only counts them, which is what placement needs; each replica reports the
devices Ray gave it at ``/admin/replicas``."""

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.server import INFER, free_port
from tests.e2e.test_replicas_server import ray_processes, running_replicas, wait_for_replicas

pytestmark = pytest.mark.slow
RAY = Path(INFER).with_name("ray")


def test_each_replica_gets_its_own_gpu_from_the_cluster(tmp_path: Path) -> None:
    assert not ray_processes(), "a Ray cluster is already running here"
    ray_port = free_port()
    # A throwaway cluster on 127.0.0.1 only, without Ray's token auth (a cluster a user
    # starts keeps it: its token in ~/.ray reaches `infer serve` on the same machine).
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    subprocess.run(
        [
            *(str(RAY), "start", "--head", "--port", str(ray_port), "--num-gpus", "2"),
            *("--num-cpus", "2", "--node-ip-address", "127.0.0.1", "--disable-usage-stats"),
            *("--include-dashboard", "false"),
        ],
        check=True,
        capture_output=True,
        timeout=120,
        env=env,
    )
    log = tmp_path / "serve.log"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = None
    try:
        with log.open("w") as out:
            process = subprocess.Popen(
                [
                    *(str(INFER), "serve", "--port", str(port), "--replicas", "2"),
                    *("--threads", "1", "--ray-address", f"127.0.0.1:{ray_port}"),
                    *("--replica-gpus", "1", "--replica-cpus", "1", "--usage-db", ":memory:"),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
            )
        wait_for_replicas(url, process, log, 2)
        devices = sorted(r["cuda_visible_devices"] for r in running_replicas(url))
        assert devices == ["0", "1"], devices  # one GPU each, not the same one
        assert "1 GPU each" in log.read_text()
        reply = httpx.post(
            f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=120
        )
        assert reply.status_code == 200, reply.text  # no GPU behind them: the CPU serves
    finally:
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
        subprocess.run([str(RAY), "stop", "--force"], check=False, capture_output=True, env=env)
        for _ in range(30):
            if not ray_processes():
                break
            time.sleep(1)
    assert not ray_processes()
