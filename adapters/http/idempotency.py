"""``Idempotency-Key`` on the generation endpoints (an ASGI middleware).

A POST with the header is run once per caller, key and body: a repeat gets the stored
reply (status, body — a stream's whole event stream — and content type) with
``Idempotent-Replayed: true``; the same key with another body, or while the first is still
running, is a 409. A body with ``"store": false`` is never stored (the key is ignored).
Replies of 5xx, failed or cut-off requests and replies over ``max_reply_bytes`` are not
stored. Keys are scoped to the caller's API key (a hash of it).
"""

import hashlib
from collections.abc import Iterable
from typing import Any

import msgspec
import structlog

from adapters.http.errors import anthropic_error_body, is_anthropic
from adapters.http.schemas import ErrorDetail, ErrorResponse
from application.access.idempotency import DEFAULT_TTL_S
from domain.idempotency import IdempotencyStore, StoredReply

log = structlog.get_logger(__name__)
HEADER = b"idempotency-key"
_KEPT_HEADERS = (b"content-type", b"cache-control")
_encoder = msgspec.json.Encoder()


class IdempotencyMiddleware:
    def __init__(
        self,
        app: Any,
        store: IdempotencyStore,
        paths: Iterable[str],
        *,
        ttl_s: float = DEFAULT_TTL_S,
        max_reply_bytes: int = 8 << 20,
    ) -> None:
        self.app, self.store, self.paths = app, store, frozenset(paths)
        self.ttl_s, self.max_reply_bytes = ttl_s, max_reply_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        headers = dict(scope.get("headers", ())) if scope["type"] == "http" else {}
        given = headers.get(HEADER)
        if given is None or scope["method"] != "POST" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        try:
            key = given.decode("ascii")
        except UnicodeDecodeError:
            key = ""
        if not 1 <= len(key) <= 255 or not key.isprintable():
            await _error(
                send, 400, "Idempotency-Key must be 1 to 255 printable ASCII characters", scope
            )
            return
        body, receive = await _buffer(receive)
        if _not_stored(body):
            await self.app(scope, receive, send)
            return
        caller = headers.get(b"authorization") or headers.get(b"x-api-key") or b""
        scoped = hashlib.sha256(caller + b"\0" + scope["path"].encode() + b"\0" + given).hexdigest()
        fingerprint = hashlib.sha256(body).hexdigest()
        found = await self.store.begin(scoped, fingerprint, self.ttl_s)
        if isinstance(found, StoredReply):
            await _replay(send, found)
        elif found == "conflict":
            await _error(
                send, 409, "this Idempotency-Key was used with another request body", scope
            )
        elif found == "running":
            await _error(
                send,
                409,
                "a request with this Idempotency-Key is in progress; retry when it ends",
                scope,
            )
        else:
            await self._run(scope, receive, send, scoped, fingerprint)

    async def _run(
        self, scope: dict[str, Any], receive: Any, send: Any, key: str, fingerprint: str
    ) -> None:
        status, size, complete = 500, 0, False
        kept: list[tuple[str, str]] = []
        chunks: list[bytes] = []

        async def capture(message: dict[str, Any]) -> None:
            nonlocal status, size, complete
            if message["type"] == "http.response.start":
                status = message["status"]
                kept.extend(
                    (k.decode("latin-1"), v.decode("latin-1"))
                    for k, v in message.get("headers", ())
                    if k.lower() in _KEPT_HEADERS
                )
            elif message["type"] == "http.response.body":
                chunk = message.get("body", b"")
                size += len(chunk)
                if size <= self.max_reply_bytes:
                    chunks.append(chunk)
                complete = not message.get("more_body", False)
            await send(message)

        stored = False
        try:
            await self.app(scope, receive, capture)
            if complete and status < 500 and size <= self.max_reply_bytes:
                reply = StoredReply(status, tuple(kept), b"".join(chunks))
                await self.store.finish(key, fingerprint, reply, self.ttl_s)
                stored = True
        finally:
            if not stored:
                try:
                    await self.store.abandon(key)
                except Exception:  # the store is down: the key expires on its own
                    log.exception("freeing an idempotency key failed")


async def _buffer(receive: Any) -> tuple[bytes, Any]:
    """The whole request body, and a ``receive`` that gives it to the app again."""
    parts: list[bytes] = []
    first: dict[str, Any] | None = None
    while first is None:
        message = await receive()
        if message["type"] != "http.request":  # a disconnect while the body came
            first = dict(message)
        else:
            parts.append(message.get("body", b""))
            if not message.get("more_body", False):
                first = {"type": "http.request", "body": b"".join(parts), "more_body": False}
    body = b"".join(parts)

    async def replay() -> dict[str, Any]:
        nonlocal first
        if first is not None:
            message, first = first, None
            return message
        return dict(await receive())

    return body, replay


def _not_stored(body: bytes) -> bool:
    """The body asks not to be stored (``"store": false``)."""
    try:
        data = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return False
    return isinstance(data, dict) and data.get("store") is False


async def _replay(send: Any, reply: StoredReply) -> None:
    headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in reply.headers]
    headers.append((b"idempotent-replayed", b"true"))
    await send({"type": "http.response.start", "status": reply.status, "headers": headers})
    await send({"type": "http.response.body", "body": reply.body})


async def _error(send: Any, status: int, message: str, scope: dict[str, Any]) -> None:
    code = "idempotency_key_conflict" if status == 409 else "invalid_idempotency_key"
    body = _encoder.encode(
        ErrorResponse(ErrorDetail(message, "invalid_request_error", "Idempotency-Key", code))
    )
    if is_anthropic(scope["path"]):  # the Messages face's format
        body = anthropic_error_body(message, "invalid_request_error")
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
