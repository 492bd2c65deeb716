"""``--replica-gpus``: each replica asks Ray for GPUs, and Ray shows it the ones it got
(``CUDA_VISIBLE_DEVICES``). This machine has none: a Ray cluster started with
``--num-gpus 2`` only counts them, which is what placement needs; each replica reports the
devices Ray gave it at ``/admin/replicas``."""

from pathlib import Path

import httpx
import pytest

from tests.e2e.server import free_port
from tests.support import ray_cluster as fleet

pytestmark = pytest.mark.slow


def test_each_replica_gets_its_own_gpu_from_the_cluster(tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with fleet.ray_cluster(num_cpus=2, num_gpus=2) as ray_port:
        process = fleet.start_server(
            log,
            port,
            *("--replicas", "2", "--threads", "1", "--ray-address", f"127.0.0.1:{ray_port}"),
            *("--replica-gpus", "1", "--replica-cpus", "1", "--usage-db", ":memory:"),
        )
        try:
            fleet.wait_for_replicas(url, process, log, 2)
            devices = sorted(r["cuda_visible_devices"] for r in fleet.running_replicas(url))
            assert devices == ["0", "1"], devices  # one GPU each, not the same one
            assert "1 GPU each" in log.read_text()
            reply = httpx.post(
                f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=120
            )
            assert reply.status_code == 200, reply.text  # no GPU behind them: the CPU serves
        finally:
            fleet.stop_server(process)
    assert not fleet.ray_processes()
