"""Streaming helpers of the faces: merging output streams, watching for a client that
leaves, Server-Sent Events, and their heartbeat."""

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

import msgspec
from litestar import Request
from litestar.middleware import DefineMiddleware
from litestar.response import ServerSentEvent
from litestar.response.sse import ServerSentEventMessage
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from adapters.http.errors import HTTPError

T = TypeVar("T")
_encoder = msgspec.json.Encoder()


async def merge_streams(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several streams as they come, tagged with the stream's index; closing the
    merged stream closes every stream."""
    queue: asyncio.Queue[tuple[int, T] | None] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((index, item))
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            entry = await queue.get()
            if entry is None:
                remaining -= 1
            else:
                yield entry
    finally:
        # Stop the pumps first: a stream cannot be closed while a pump is iterating it.
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()  # type: ignore[attr-defined]


class ClientDisconnected(HTTPError):
    """The client left before its non-streamed reply was ready (nobody reads the answer;
    499 is nginx's "client closed request")."""

    def __init__(self) -> None:
        super().__init__(499, "client disconnected", "invalid_request_error")


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` (collecting a non-streamed reply); if the client disconnects first,
    cancel it — the streams' cleanup aborts the requests, freeing their KV slots — as a
    disconnect mid-stream does, and raise :class:`ClientDisconnected`."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected(request))
    try:
        done, _ = await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, watcher):
            pending.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task in done:
        return task.result()  # raises what the work raised
    raise ClientDisconnected()


async def disconnected(request: Request) -> None:
    """Return when the client disconnects (the body was read: nothing else can arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def sse(chunks: AsyncIterator[bytes]) -> ServerSentEvent:
    """A stream of unnamed events, one per chunk of (JSON) bytes."""

    async def messages() -> AsyncIterator[ServerSentEventMessage]:
        async for data in chunks:
            yield ServerSentEventMessage(data=data.decode())

    return ServerSentEvent(messages())


def sse_event(kind: str, payload: msgspec.Struct) -> ServerSentEventMessage:
    """A named event with a JSON payload."""
    return ServerSentEventMessage(data=_encoder.encode(payload).decode(), event=kind)


# An SSE comment: clients (the openai SDK's parser included) ignore it; proxies and load
# balancers see traffic on a stream that waits.
PING = b": ping\n\n"
DEFAULT_HEARTBEAT_S = 15.0
# A route's ``opt`` key: the bytes its streams' heartbeat sends instead of :data:`PING`
# (the Messages face's ``event: ping``).
SSE_PING = "sse_ping"


def heartbeat_middleware(interval_s: float) -> DefineMiddleware:
    """Every event stream silent for ``interval_s`` seconds gets a :data:`PING`."""
    return DefineMiddleware(HeartbeatMiddleware, interval_s=interval_s)


class HeartbeatMiddleware:
    def __init__(self, app: ASGIApp, interval_s: float) -> None:
        self.app, self.interval_s = app, interval_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        handler = scope.get("route_handler")
        ping = PING if handler is None else handler.opt.get(SSE_PING, PING)
        heartbeat = Heartbeat(send, self.interval_s, ping)
        try:
            await self.app(scope, receive, heartbeat.send)
        finally:
            heartbeat.stop()


class Heartbeat:
    """The ``send`` of one response, with a ping between events while an event stream is
    silent. Per event it notes the time; one timer per stream checks once per interval
    (events are whole SSE frames, so a ping never splits one)."""

    def __init__(self, send: Send, interval_s: float, ping: bytes = PING) -> None:
        self._send, self.interval_s, self.ping = send, interval_s, ping
        self._loop = asyncio.get_running_loop()
        self._last = 0.0
        self._sending = False
        self._timer: asyncio.TimerHandle | None = None
        self._pings: set[asyncio.Task[None]] = set()

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start" and _is_event_stream(message):
            self._last = self._loop.time()
            self._timer = self._loop.call_at(self._last + self.interval_s, self._check)
        elif self._timer is not None:
            self._last = self._loop.time()
            if not message.get("more_body", False):
                self.stop()
        self._sending = True
        try:
            await self._send(message)
        finally:
            self._sending = False

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check(self) -> None:
        now = self._loop.time()
        if now - self._last >= self.interval_s:
            # No ping while an event (or a ping) is on its way: the socket is busy anyway.
            if not self._sending and not self._pings:
                ping = self._loop.create_task(self._ping())
                self._pings.add(ping)
                ping.add_done_callback(self._pings.discard)
            self._last = now
        self._timer = self._loop.call_at(self._last + self.interval_s, self._check)

    async def _ping(self) -> None:
        # The stream may end (or its client leave) while the ping waits for the socket.
        with contextlib.suppress(Exception):
            await self._send({"type": "http.response.body", "body": self.ping, "more_body": True})


def _is_event_stream(message: Message) -> bool:
    headers: list[tuple[bytes, bytes]] = message.get("headers", [])  # type: ignore[assignment]
    for name, value in headers:
        if name.lower() == b"content-type":
            return bytes(value).startswith(b"text/event-stream")
    return False
