"""Streaming helpers of the faces: merging output streams, watching for a client that
leaves, and Server-Sent Events."""

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

import msgspec
from litestar import Request
from litestar.response import ServerSentEvent
from litestar.response.sse import ServerSentEventMessage

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
