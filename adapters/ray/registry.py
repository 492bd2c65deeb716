"""The fleet's registry (a Ray actor): what every engine replica last reported (its load,
its pid and node, its ``/metrics`` exposition), which the ingress lists at
``/admin/replicas`` and merges into its own ``/metrics``."""

import time
from typing import Any

import ray

REGISTRY_NAME = "infer-fleet-registry"
REPORT_EVERY_S = 1.0  # how often each replica reports
# A replica not heard from for this long is listed as unreachable, and then dropped.
STALE_AFTER_S = 5.0
FORGET_AFTER_S = 60.0


@ray.remote(num_cpus=0)
class FleetRegistry:
    """What every engine replica last reported (its load, its pid and node): the ingress
    lists them at ``/admin/replicas``."""

    def __init__(self) -> None:
        self._reports: dict[str, dict[str, Any]] = {}

    def report(self, replica_id: str, stats: dict[str, Any]) -> None:
        self._reports[replica_id] = {**stats, "reported_at": time.time()}

    def forget(self, replica_id: str) -> None:
        self._reports.pop(replica_id, None)

    def expositions(self) -> list[tuple[str, str]]:
        """Each live replica's ``/metrics`` exposition, by replica id."""
        now = time.time()
        return [
            (replica_id, stats["metrics"])
            for replica_id, stats in sorted(self._reports.items())
            if stats.get("metrics") and now - stats["reported_at"] < STALE_AFTER_S
        ]

    def snapshot(self) -> list[dict[str, Any]]:
        now = time.time()
        for replica_id, stats in list(self._reports.items()):
            if now - stats["reported_at"] > FORGET_AFTER_S:  # dead, replaced by Ray
                del self._reports[replica_id]
        return [
            {
                "id": replica_id,
                **{k: v for k, v in stats.items() if k != "metrics"},
                "state": "running" if now - stats["reported_at"] < STALE_AFTER_S else "unreachable",
            }
            for replica_id, stats in sorted(self._reports.items())
        ]
