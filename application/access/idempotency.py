"""Idempotency keys: a POST repeated with the same ``Idempotency-Key`` and
the same body within the retention gets the stored reply without running again.

A key is scoped to the caller (a hash of its API key) and bound to a fingerprint of the
body: the same key with another body is a conflict, and so is a duplicate that arrives
while the first is still running (409: retry once it is done; the client learns at once
rather than holding a connection). Replies of 5xx, or requests that failed or were cut
off, are not stored: the key is free again for a retry.
"""

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from domain.idempotency import Begin, StoredReply

DEFAULT_TTL_S = 24 * 3600.0


@dataclass
class _Entry:
    fingerprint: str
    expires_at: float
    reply: StoredReply | None = None


class MemoryIdempotencyStore:
    """In this process, at most ``max_entries`` keys (the oldest go first)."""

    def __init__(
        self, max_entries: int = 10_000, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_entries, self.clock = max_entries, clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    async def begin(self, key: str, fingerprint: str, ttl_s: float) -> Begin:
        now = self.clock()
        entry = self._entries.get(key)
        if entry is not None and entry.expires_at <= now:
            del self._entries[key]
            entry = None
        if entry is None:
            self._entries[key] = _Entry(fingerprint, now + ttl_s)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
            return "new"
        if entry.fingerprint != fingerprint:
            return "conflict"
        return entry.reply if entry.reply is not None else "running"

    async def finish(self, key: str, fingerprint: str, reply: StoredReply, ttl_s: float) -> None:
        self._entries[key] = _Entry(fingerprint, self.clock() + ttl_s, reply)

    async def abandon(self, key: str) -> None:
        self._entries.pop(key, None)
