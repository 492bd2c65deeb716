"""The Tinker API of a fleet: the ingress forwards every request under ``/api/v1/`` whole
(method, path, headers, body) to an engine replica, which answers it with its own Tinker
face, and sends the reply back with ``x-infer-replica``.

A training run lives on one replica (its weights, optimizer state and futures are there),
so each call goes to the replica that holds it. No table is needed for that: a replica's
Tinker service puts its replica id in the ids it hands out (``session-<replica>-<hex>``;
runs ``<session>:train:<n>`` and samplers ``<session>:sample:<n>`` carry their session's;
futures ``req-<replica>-<n>``), and :func:`owner_of` reads it back from the request's path
or body (JSON or protobuf: ids are plain bytes in both). Any ingress routes any call, and
nothing is kept here. A call naming no replica (a new session, sampling from a saved
checkpoint, which every replica reads from the shared ``--checkpoint-dir``) goes where the
routing policy sends it.

When the replica holding a run is gone (killed; Ray starts a new one, with a new id), its
calls are routed by the policy, and the replica they reach answers as Tinker does for what
it does not hold; a future of the dead replica is answered as failed
(:func:`lost_future_reply`: category ``server``), never left to poll forever.
"""

import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from application.engine.remote_engine import ReplicaLostError
from domain.routing import RouteRequest
from domain.tinker.errors import error_payload

PREFIX = "/api/v1/"
MAX_BODY_BYTES = 64 * 1024 * 1024
_OWNER = re.compile(rb"(?:session|req)-([a-z0-9]{4,32})-")
_SCAN_BYTES = 64 * 1024  # ids come first in the SDK's bodies (protobuf field 1, JSON keys)
HEADER = b"x-infer-replica"


@dataclass(frozen=True, slots=True)
class HttpCall:
    """One HTTP request, whole (plain data: it travels to a replica)."""

    method: str
    path: str
    query_string: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes


@dataclass(frozen=True, slots=True)
class HttpReply:
    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    replica_id: str = ""


Forward = Callable[[RouteRequest, HttpCall], Awaitable[HttpReply]]


def owner_of(path: str, body: bytes) -> str | None:
    """The replica named by the first Tinker id in the path, else in the body."""
    for text in (path.encode(), body[:_SCAN_BYTES]):
        found = _OWNER.search(text)
        if found is not None:
            return found.group(1).decode()
    return None


def lost_future_reply(call: HttpCall, replica_id: str) -> HttpReply | None:
    """A ``retrieve_future`` of a future this replica (``replica_id``) did not issue: its
    replica is gone, and with it the future's work. Answered as a failed future (category
    ``server``: the SDK raises, it does not poll on); None for any other call."""
    if call.path != PREFIX + "retrieve_future":
        return None
    owner = owner_of("", call.body)
    if owner is None or owner == replica_id:
        return None
    try:
        request_id = json.loads(call.body).get("request_id", "?")
    except (ValueError, AttributeError):
        request_id = "?"
    body = json.dumps(
        {
            "error": f"the replica that ran request {request_id} stopped; its work is lost "
            "(resume from your last checkpoint)",
            "category": "server",
        }
    ).encode()
    return HttpReply(200, _json_headers(body), body, replica_id)


async def run_asgi(app: Any, call: HttpCall) -> tuple[int, tuple[tuple[bytes, bytes], ...], bytes]:
    """``call`` through the ASGI ``app`` in this process: its status, headers and body."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": call.method,
        "scheme": "http",
        "path": call.path,
        "raw_path": call.path.encode(),
        "query_string": call.query_string,
        "root_path": "",
        "headers": list(call.headers),
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
    }
    sent = False
    status, headers, chunks = 500, (), []

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": call.body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status, headers
        if message["type"] == "http.response.start":
            status, headers = message["status"], tuple(message.get("headers", ()))
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    return status, headers, b"".join(chunks)


class TinkerForwarder:
    """ASGI: requests under ``/api/v1/`` to ``forward`` (see the module), the rest to
    ``app``."""

    def __init__(self, app: Any, forward: Forward, max_body_bytes: int = MAX_BODY_BYTES):
        self.app, self.forward, self.max_body_bytes = app, forward, max_body_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PREFIX):
            await self.app(scope, receive, send)
            return
        body = await _body(receive, self.max_body_bytes)
        if body is None:
            await _reply(send, _error(413, f"the body exceeds {self.max_body_bytes} bytes"))
            return
        call = HttpCall(
            scope["method"],
            scope["path"],
            scope.get("query_string", b""),
            tuple((k, v) for k, v in scope["headers"] if k.lower() != HEADER),
            body,
        )
        try:
            reply = await self.forward(RouteRequest(replica=owner_of(call.path, body)), call)
        except ReplicaLostError:  # transient: the SDK retries, and reaches a live replica
            reply = _error(503, "the engine replica serving this call stopped; retry")
        await _reply(send, reply)


async def _body(receive: Any, limit: int) -> bytes | None:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _reply(send: Any, reply: HttpReply) -> None:
    headers = [h for h in reply.headers if h[0].lower() != b"content-length"]
    headers.append((b"content-length", str(len(reply.body)).encode()))
    if reply.replica_id:
        headers.append((HEADER, reply.replica_id.encode()))
    await send({"type": "http.response.start", "status": reply.status, "headers": headers})
    await send({"type": "http.response.body", "body": reply.body})


def _error(status: int, message: str) -> HttpReply:
    body = msgspec.json.encode(error_payload(message, "server" if status >= 500 else "user"))
    return HttpReply(status, _json_headers(body), body)


def _json_headers(body: bytes) -> tuple[tuple[bytes, bytes], ...]:
    return ((b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()))
