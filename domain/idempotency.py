"""Idempotency keys' store as a port: a key held while its request runs, then its reply kept
for replays; implemented in this process
(:class:`application.access.idempotency.MemoryIdempotencyStore`) and in Redis
(``adapters/storage/idempotency.py``)."""

from dataclasses import dataclass
from typing import Literal, Protocol


@dataclass(frozen=True, slots=True)
class StoredReply:
    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes


Begin = StoredReply | Literal["new", "running", "conflict"]


class IdempotencyStore(Protocol):
    async def begin(self, key: str, fingerprint: str, ttl_s: float) -> Begin:
        """``new``: the key was free and is now held (running) for ``fingerprint``;
        ``running``: held by a request with the same body; ``conflict``: used with
        another body; a :class:`StoredReply`: done, replay it."""
        ...

    async def finish(self, key: str, fingerprint: str, reply: StoredReply, ttl_s: float) -> None:
        """Store the reply of the request holding ``key``."""
        ...

    async def abandon(self, key: str) -> None:
        """Free ``key`` (the request failed or was cut off: a retry may run)."""
        ...
