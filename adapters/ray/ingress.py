"""What a fleet's ingress (``infer serve --replicas N``) reads from Ray: what a replica
measured on the model (:func:`describe_replicas`, in place of loading it) and the fleet's
registry (:class:`FleetView`: the replicas listed at ``/admin/replicas``, their ``/metrics``
expositions)."""

import asyncio
import contextlib
from typing import Any

from ray.serve.handle import DeploymentHandle

from adapters.ray.registry import REPORT_EVERY_S, registry

APP_NAME = "infer"  # the Ray Serve application
ENGINE = "engine"  # its deployment of engine replicas


def describe_replicas(timeout_s: float) -> dict[str, Any]:
    """What a replica measured on the model (:meth:`EngineReplica.describe`: its engine
    configuration with the KV pool sized there, the vocabulary, the pool's bytes)."""
    # Its own handle: Serve caches the one get_deployment_handle gives, which the calls'
    # handle initializes on the server's event loop (dispatch.loop_handle).
    handle: DeploymentHandle[Any] = DeploymentHandle(ENGINE, APP_NAME)
    try:
        described: dict[str, Any] = handle.describe.remote().result(timeout_s=timeout_s)
    finally:
        handle.shutdown()  # its router's thread and long poll: the calls use their own
    return described


class FleetView:
    """The fleet's registry as the ingress reads it: the replicas' last reports (listed as
    they are asked for) and their ``/metrics`` expositions, polled every
    :data:`REPORT_EVERY_S` from :meth:`start` (on the server's event loop) on."""

    def __init__(self) -> None:
        self._registry = registry()
        self._expositions: list[tuple[str, str]] = []
        self._joined: list[str] = []  # the running replicas, in the order they were seen
        self._poller: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Polls the replicas' expositions (a start-up hook: on the running loop)."""
        if self._poller is None:
            self._poller = asyncio.get_running_loop().create_task(self._poll())

    async def _poll(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                self._expositions = await self._registry.expositions.remote()
                rows = await self._registry.snapshot.remote()
                running = {r["id"] for r in rows if r.get("state") == "running"}
                kept = [r for r in self._joined if r in running]
                self._joined = kept + sorted(running - set(kept))
            await asyncio.sleep(REPORT_EVERY_S)

    def joined(self) -> list[str]:
        """The running replicas in the order this ingress first saw them (as last polled)."""
        return self._joined

    async def replicas(self) -> list[dict[str, Any]]:
        """Every replica as ``/admin/replicas`` lists it (id, pid, node, state, load)."""
        return list(await self._registry.snapshot.remote())

    def expositions(self) -> list[tuple[str, str]]:
        """Each live replica's ``/metrics`` exposition, by replica id, as last polled."""
        return self._expositions
