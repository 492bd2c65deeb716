"""``x-infer-replica``: which engine replica served a response, when the engine is a fleet
(:class:`~application.engine.remote_engine.RemoteEngine`). An ASGI wrapper gives each HTTP request
a :class:`ReplicaNote` (in :data:`CURRENT_NOTE`, which the engine's calls fill as they are
routed) and, when the response starts, waits for the calls sent so far to be routed (a few
milliseconds; at most ``wait_s``) and names their replicas, comma-separated. A replica id
is Ray Serve's, never a pid or an address."""

import asyncio
import contextlib
from typing import Any

from application.engine.remote_engine import CURRENT_NOTE, ReplicaNote

HEADER = b"x-infer-replica"


class ReplicaHeader:
    def __init__(self, app: Any, wait_s: float = 5.0) -> None:
        self.app, self.wait_s = app, wait_s

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        note = ReplicaNote()
        token = CURRENT_NOTE.set(note)

        async def named(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                if note.pending > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(note.routed.wait(), self.wait_s)
                headers = list(message.get("headers", ()))
                if note.replicas:
                    headers.append((HEADER, ",".join(note.replicas).encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, named)
        finally:
            CURRENT_NOTE.reset(token)
