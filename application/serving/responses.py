"""Stored responses (the Responses API's ``store``): each finished response kept per
tenant, so a later request continues it (``previous_response_id``), and it can be read back
or deleted.

A stored response is plain JSON data: the response object as it was answered, and the
conversation it answered (the items before its output: a previous response's items, then
its own input; never its ``instructions``, which a continuation does not inherit). A
continuation's conversation is its previous response's conversation, that response's
output, then its own input, so every stored response stands alone: one expiring or being
deleted never breaks another.

The store is a port (:class:`domain.responses.ResponseStore`): in this process
(:class:`MemoryResponseStore`, bounded in count, the oldest dropped first), or in Redis
(``adapters/storage/responses.py``) when replicas share it. Each entry expires ``ttl_s``
after it was stored. Ids are scoped to the tenant that made them: another tenant's id reads
as unknown.
"""

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from domain.responses import StoredResponse

DEFAULT_RESPONSES_TTL_S = 24 * 3600.0
DEFAULT_MAX_STORED_RESPONSES = 10_000
# The tenant of an open server's callers (no API keys).
OPEN_TENANT = ""


@dataclass(slots=True)
class _Entry:
    stored: StoredResponse
    expires_at: float


class MemoryResponseStore:
    """In this process: at most ``max_entries`` responses (the oldest stored go first),
    each for ``ttl_s`` seconds."""

    def __init__(
        self,
        max_entries: int = DEFAULT_MAX_STORED_RESPONSES,
        ttl_s: float = DEFAULT_RESPONSES_TTL_S,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_entries, self.ttl_s, self.clock = max_entries, ttl_s, clock
        self._entries: OrderedDict[tuple[str, str], _Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    async def put(self, tenant: str, response_id: str, stored: StoredResponse) -> None:
        key = (tenant, response_id)
        self._entries.pop(key, None)
        self._entries[key] = _Entry(stored, self.clock() + self.ttl_s)
        self._expire()
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        entry = self._entries.get((tenant, response_id))
        if entry is None:
            return None
        if entry.expires_at <= self.clock():
            del self._entries[(tenant, response_id)]
            return None
        return entry.stored

    async def delete(self, tenant: str, response_id: str) -> bool:
        return await self.get(tenant, response_id) is not None and bool(
            self._entries.pop((tenant, response_id), None)
        )

    def _expire(self) -> None:
        """Drop the expired entries at the front (entries are kept in the order stored,
        all with the same lifetime, so the expired ones are the oldest)."""
        now = self.clock()
        while self._entries:
            key, entry = next(iter(self._entries.items()))
            if entry.expires_at > now:
                break
            del self._entries[key]
