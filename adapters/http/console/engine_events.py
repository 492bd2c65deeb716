"""``GET /ui/api/engine/events``: the engine's statistics as server-sent events, for the
console's engine view. The first event (``"type": "history"``) carries the timeline's
window (one point per second, oldest first; :mod:`adapters.observability.timeline` says
what a point holds), the engine's sizes and, for a fleet, each replica's load; then every
``interval_s`` an ``"update"`` with the seconds finished since and the replicas again.

A fleet (``infer serve --replicas N``) runs its engines in other processes: their steps do
not reach this one's timeline (``"local": false``). Each replica reports its load every
second (running, waiting, KV usage, prefix hit rate: what ``/admin/replicas`` lists) with
its own timeline's newest point (``step``); every event carries that list, and the page
charts the fleet (the replicas' sum) and each replica from the moment it is opened.
"""

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import msgspec
from litestar import get
from litestar.handlers import HTTPRouteHandler
from litestar.response import ServerSentEvent
from litestar.response.sse import ServerSentEventMessage

from adapters.http.ownership import Draining
from domain.config import EngineConfig

INTERVAL_S = 1.0
_encoder = msgspec.json.Encoder()

Replicas = Callable[[], Awaitable[list[dict[str, Any]]]]


class Timeline(Protocol):
    """The engine's recent seconds (``adapters.observability.timeline.EngineTimeline``)."""

    @property
    def window_s(self) -> int: ...

    def points(self, since: int | None = None) -> list[dict[str, Any]]: ...


def engine_info(config: EngineConfig, model: str) -> dict[str, Any]:
    """The engine's sizes, as the page labels its counters."""
    return {
        "model": model,
        "max_num_seqs": config.max_num_seqs,
        "max_waiting_requests": config.max_waiting_requests,
        "max_model_len": config.max_model_len,
        "kv_blocks": config.kv_blocks,
        "kv_block_size": config.kv_block_size,
    }


def engine_handlers(
    timeline: Timeline | None,
    replicas: Replicas | None,
    draining: Draining,
    info: dict[str, Any],
    interval_s: float = INTERVAL_S,
) -> list[HTTPRouteHandler]:
    """The event stream's handler. ``timeline``: this process's engine (None: no steps
    seen here, a fleet's ingress); ``replicas``: a fleet's replicas (None: one process)."""

    async def replica_load() -> list[dict[str, Any]] | None:
        if replicas is None:
            return None
        try:
            listed = await replicas()
        except Exception:  # the registry unreachable: the page says "no replicas"
            return []
        return [{k: v for k, v in r.items() if k != "metrics"} for r in listed]

    def points(since: int | None) -> list[dict[str, Any]]:
        return [] if timeline is None else timeline.points(since)

    async def stream() -> AsyncIterator[ServerSentEventMessage]:
        history = points(None)
        last = history[-1]["t"] if history else None
        yield _event(
            {
                "type": "history",
                "window_s": timeline.window_s if timeline is not None else 0,
                "engine": info,
                "local": replicas is None,
                "points": history,
                "replicas": await replica_load(),
            }
        )
        while not draining.active:
            await asyncio.sleep(interval_s)
            new = points(last)
            if new:
                last = new[-1]["t"]
            yield _event({"type": "update", "points": new, "replicas": await replica_load()})

    @get("/ui/api/engine/events", include_in_schema=False)
    async def engine_events() -> ServerSentEvent:
        return ServerSentEvent(_closing(stream()))

    return [engine_events]


async def _closing(
    events: AsyncIterator[ServerSentEventMessage],
) -> AsyncIterator[ServerSentEventMessage]:
    """``events``, closed however the stream ends (a client gone cancels it)."""
    try:
        async for event in events:
            yield event
    finally:
        with contextlib.suppress(Exception):
            await events.aclose()  # type: ignore[attr-defined]


def _event(payload: dict[str, Any]) -> ServerSentEventMessage:
    return ServerSentEventMessage(data=_encoder.encode(payload).decode())
