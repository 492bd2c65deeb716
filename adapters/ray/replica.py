"""An engine replica of ``infer serve --replicas N`` (a Ray Serve deployment): it builds
its container from the server's one configuration (through the entrypoint's composition
root, handed in), runs its :class:`~application.engine.async_engine.AsyncEngine` on the
replica's own event loop with the same :class:`~application.lifecycle.Lifecycle` as one
process, with the ``--lora-modules`` loaded. A call (``generate``) queues one
:class:`~domain.request.AdmitCall` and streams its outputs back in batches
(:func:`~application.engine.remote_engine.serve_call`); a Tinker call the ingress forwards
(``tinker_http``) is answered by the replica's own Tinker face. Every second it reports its
load to the fleet registry and, through ``record_routing_stats``, to the request router
(with the LoRA adapters it holds)."""

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from ray import serve

from adapters.ray.forward import HttpCall, HttpReply, lost_future_reply, run_asgi
from adapters.ray.registry import REPORT_EVERY_S, registry
from application.engine.remote_engine import serve_call
from application.lifecycle import Lifecycle
from domain.errors import QueueFullError
from domain.request import AdmitCall, StepOutput
from domain.routing import RouteRequest

# What a call gets from a replica the fault hook made fail (an engine step's failure's words).
FAULT_ERROR = "internal error: the engine step failed (injected fault)"


class EngineReplica:
    """One engine replica (a Ray Serve deployment, see the module)."""

    async def __init__(  # type: ignore[misc]
        self, config_json: bytes, build: Callable[[bytes, str, int | None], Any]
    ) -> None:
        """``build``: the replica's container from the server's configuration (JSON), its
        replica id and its rank (Ray Serve's: 0 to the replicas less one, a restarted
        replica taking the rank its predecessor freed; the entrypoint's composition root,
        handed in by reference)."""
        context = serve.get_replica_context()
        self.replica_id = str(context.replica_id.unique_id)
        self.rank: int | None = getattr(context.rank, "rank", None)
        self.container = build(config_json, self.replica_id, self.rank)
        config = self.container.config()
        self.engine = self.container.async_engine()
        # The replica's own app answers the Tinker calls the ingress forwards here (run
        # without a lifespan: the same Lifecycle is started here, on the replica's event
        # loop, the thread that loaded the model).
        self.app = self.container.http_app() if config.tinker.enabled else None
        admin = self.container.tenant_admin()
        self.tinker = self.container.tinker()
        self.lifecycle = Lifecycle(
            self.engine,
            self.container.usage(),
            tinker=self.tinker,
            # its Tinker face checks keys: the admin API's changes too
            watches=[admin.watch] if admin is not None else [],
        )
        await self.lifecycle.start()
        self.container.served_models()  # the --lora-modules folders loaded (kept loaded)
        self.lora = self.container.backend.lora_serving()  # a call's checkpoint loads here
        self.node = socket.gethostname()
        self._registry = registry()
        self._reporter = asyncio.create_task(self._report_forever())
        self._reports = 0
        self.failing = False  # set by the fault hook: every call fails

    async def describe(self) -> dict[str, Any]:
        """What the ingress builds its checks from: the engine's configuration (the KV pool
        sized here, on the model) and the model's vocabulary."""
        backend = self.container.backend
        return {
            "engine_config": backend.engine_config(),
            "vocab_size": backend.vocab_size(),
            "kv_cache_bytes": backend.kv_cache_bytes(),
            "replica_id": self.replica_id,
        }

    async def generate(
        self, route: RouteRequest, call: AdmitCall, avoid: frozenset[str]
    ) -> AsyncIterator[Any]:
        """One call: this replica's id with the first batch of outputs (or the refusal
        that stopped the call: the ingress tries another replica), then the other batches.
        ``route`` and ``avoid`` are the router's (:mod:`adapters.ray.router`)."""
        del route, avoid
        if self.failing:  # the fault hook: as an engine whose every step fails
            error = FAULT_ERROR
            yield (
                self.replica_id,
                [StepOutput(r, None, "", True, error=error) for r in call.request_ids],
            )
            return
        outputs = serve_call(self.engine, call, self.lora)
        try:
            first: list[StepOutput] | Exception = await anext(outputs, [])
        except QueueFullError as e:
            first = e
        yield (self.replica_id, first)
        async for batch in outputs:
            yield batch

    async def set_fault(self, route: RouteRequest, fail: bool, avoid: frozenset[str]) -> str:
        """The fault hook (``INFER_FAULT_INJECTION=1`` at the ingress; tests and chaos
        runs): from now on fail every call (``fail``) or serve again; this replica's id.
        Refused when ``route`` names another replica (that one is gone)."""
        del avoid
        if route.replica != self.replica_id:
            raise LookupError(f"no replica {route.replica!r} (this is {self.replica_id!r})")
        self.failing = fail
        return self.replica_id

    async def tinker_http(
        self, route: RouteRequest, call: HttpCall, avoid: frozenset[str]
    ) -> HttpReply:
        """A Tinker call the ingress forwarded (:mod:`adapters.ray.forward`),
        answered by this replica's Tinker face."""
        del route, avoid
        lost = lost_future_reply(call, self.replica_id)
        if lost is not None:
            return lost
        if self.app is None:
            return HttpReply(404, (), b'{"detail":"Tinker is off (--no-tinker)"}', self.replica_id)
        status, headers, body = await run_asgi(self.app, call)
        return HttpReply(status, headers, body, self.replica_id)

    def stats(self) -> dict[str, Any]:
        load = self.engine.load()
        hit = (
            load.prefix_hit_tokens / load.prefix_queried_tokens
            if load.prefix_queried_tokens
            else 0.0
        )
        return {
            "pid": os.getpid(),
            "node": self.node,
            "rank": self.rank,  # its KV events' port offset and data_parallel_rank
            # The GPUs Ray gave this replica (--replica-gpus; None: none, every GPU hidden).
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES") or None,
            "running": load.running,
            "waiting": load.waiting,
            "kv_usage": round(load.kv_usage, 4),
            "prefix_queried_tokens": load.prefix_queried_tokens,
            "prefix_hit_tokens": load.prefix_hit_tokens,
            "prefix_hit_rate": round(hit, 4),
            "healthy": self.engine.healthy,
            "step": self._latest_second(),
        }

    def _latest_second(self) -> dict[str, Any] | None:
        """This engine's newest finished second (the web console's timeline; None with
        ``--no-ui``, or before the first)."""
        timeline = self.container.timeline()
        if timeline is None:
            return None
        recent = timeline.points(int(time.time()) - 3)
        return recent[-1] if recent else None

    def record_routing_stats(self) -> dict[str, Any]:
        load = self.engine.load()
        self._reports += 1  # the router counts its calls since the last report
        return {
            "running": load.running,
            "waiting": load.waiting,
            "kv_usage": load.kv_usage,
            "report": self._reports,
            "evicted": self.engine.take_evicted(),
            # the LoRA adapters it holds (the router prefers it for calls on them)
            "adapters": self.lora.loaded() if self.lora is not None else [],
        }

    def check_health(self) -> None:
        if not self.engine.healthy:
            raise RuntimeError("the engine loop stopped")

    async def _report_forever(self) -> None:
        metrics = self.container.metrics()
        while True:
            report = self.stats()
            if metrics is not None:
                report["metrics"] = metrics.render()[0].decode()
            with contextlib.suppress(Exception):  # the registry gone: the server is stopping
                await self._registry.report.remote(self.replica_id, report)
            await asyncio.sleep(REPORT_EVERY_S)

    async def __del__(self) -> None:
        lifecycle = getattr(self, "lifecycle", None)  # none when its start failed
        if lifecycle is not None:
            await lifecycle.stop()
