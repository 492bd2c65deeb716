"""The fleet's registry (a detached Ray actor, named in its own namespace so that every
ingress and replica finds it): what every engine replica last reported (its load, its pid
and node, its ``/metrics`` exposition), which an ingress lists at ``/admin/replicas`` and
merges into its own ``/metrics``; and the fleet's ingresses (several ``infer serve
--replicas N --ray-address ...`` on one cluster): which are alive (each beats every
second), what the fleet was deployed with (an ingress asking for another fleet is
refused), and so who is the last one out (it stops the application)."""

import time
from typing import Any

import ray

REGISTRY_NAME = "infer-fleet-registry"
NAMESPACE = "infer"  # the registry's Ray namespace: every driver's and replica's the same
REPORT_EVERY_S = 1.0  # how often each replica reports
# A replica not heard from for this long is listed as unreachable, and then dropped.
STALE_AFTER_S = 5.0
FORGET_AFTER_S = 60.0
# An ingress not heard from for this long (killed) no longer keeps the application up.
INGRESS_STALE_AFTER_S = 5.0


def join_action(running: str | None, asked: str, deployed: bool, others_alive: bool) -> str:
    """What an ingress asking for the fleet ``asked`` (a fingerprint) does: ``attach`` to
    the running application deployed as ``running``; ``refuse`` where another fleet runs
    and other ingresses serve it; else ``deploy`` (Serve replaces what runs: a fleet whose
    ingresses were all killed, or one this registry does not know, blocks no next start)."""
    if deployed and running == asked:
        return "attach"
    if deployed and running is not None and others_alive:
        return "refuse"
    return "deploy"


def registry() -> Any:
    """The running registry's handle (from any driver or replica of the cluster)."""
    return ray.get_actor(REGISTRY_NAME, namespace=NAMESPACE)


def registry_or_new() -> Any:
    """The registry, created where none runs yet: detached (it outlives the ingress that
    made it; the last ingress out kills it)."""
    options = {"name": REGISTRY_NAME, "namespace": NAMESPACE, "lifetime": "detached"}
    return FleetRegistry.options(**options, get_if_exists=True).remote()  # type: ignore[attr-defined]


@ray.remote(num_cpus=0)
class FleetRegistry:
    """What every engine replica last reported (its load, its pid and node): the ingress
    lists them at ``/admin/replicas``."""

    def __init__(self) -> None:
        self._reports: dict[str, dict[str, Any]] = {}
        self._ingresses: dict[str, float] = {}  # ingress id -> when it last beat
        self._fingerprint: str | None = None  # what the running fleet was deployed with

    def join(self, ingress_id: str, fingerprint: str, deployed: bool) -> str:
        """Count an ingress in; what it does (:func:`join_action`). ``deployed``: the
        application runs; ``fingerprint``: the fleet the ingress asks for. A refused one is
        not counted."""
        action = join_action(self._fingerprint, fingerprint, deployed, bool(self.ingresses()))
        if action != "refuse":
            self._fingerprint = fingerprint
            self._ingresses[ingress_id] = time.time()
        return action

    def beat(self, ingress_id: str) -> None:
        self._ingresses[ingress_id] = time.time()

    def leave(self, ingress_id: str) -> list[str]:
        """Count an ingress out; the ingresses still alive (none: it was the last one)."""
        self._ingresses.pop(ingress_id, None)
        return self.ingresses()

    def ingresses(self) -> list[str]:
        """The ingresses alive (heard from within :data:`INGRESS_STALE_AFTER_S`)."""
        now = time.time()
        for ingress_id, beat in list(self._ingresses.items()):
            if now - beat > INGRESS_STALE_AFTER_S:
                del self._ingresses[ingress_id]
        return sorted(self._ingresses)

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
