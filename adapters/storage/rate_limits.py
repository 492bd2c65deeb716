"""The :class:`RateLimitCounters` port on the ``limits`` library: fixed windows in memory
(one process) or in Redis (``redis://host:port/db``: replicas share their counts).

``limits`` counts a refused hit in a fixed window; this adapter takes it back at once, so a
refused request costs nothing. Concurrency slots are counters without a window (a day's
expiry, so slots held by a crashed replica do not stay taken for ever).
"""

import time
from typing import cast

from limits import RateLimitItem, RateLimitItemPerMinute, RateLimitItemPerSecond
from limits.aio.storage import Storage
from limits.aio.strategies import FixedWindowRateLimiter
from limits.storage import storage_from_string

from domain.tenancy import WindowState

_SLOT_EXPIRY_S = 24 * 3600


def storage_uri(redis_url: str | None) -> str:
    """The ``limits`` storage for a Redis URL (None: this process's memory)."""
    if redis_url is None:
        return "async+memory://"
    if not redis_url.startswith(("redis://", "rediss://")):
        raise ValueError(f"a Redis URL starts with redis:// or rediss://, got {redis_url!r}")
    return "async+" + redis_url


class LimitsCounters:
    def __init__(self, redis_url: str | None = None, *, prefix: str = "infer") -> None:
        uri = storage_uri(redis_url)
        # redis-py (a dependency) rather than limits' default coredis.
        options = {"implementation": "redispy", "key_prefix": prefix} if redis_url else {}
        self.storage = cast(Storage, storage_from_string(uri, **options))
        self.limiter = FixedWindowRateLimiter(self.storage)

    async def take(
        self, name: str, amount: int, limit: int, window_s: int
    ) -> tuple[bool, WindowState]:
        item = _item(limit, window_s)
        ok = await self.limiter.hit(item, name, cost=amount)
        if not ok:  # uncount the refused hit
            await self.storage.incr(item.key_for(name), item.get_expiry(), amount=-amount)
        stats = await self.limiter.get_window_stats(item, name)
        reset_s = max(0.0, stats.reset_time - time.time())
        return ok, WindowState(limit, stats.remaining, reset_s)

    async def give_back(self, name: str, amount: int, limit: int, window_s: int) -> None:
        item = _item(limit, window_s)
        await self.storage.incr(item.key_for(name), item.get_expiry(), amount=-amount)

    async def charge(self, name: str, amount: int, limit: int, window_s: int) -> None:
        item = _item(limit, window_s)
        await self.storage.incr(item.key_for(name), item.get_expiry(), amount=amount)

    async def enter(self, name: str, limit: int) -> bool:
        key = f"slots/{name}"
        if await self.storage.incr(key, _SLOT_EXPIRY_S, 1) <= limit:
            return True
        await self.storage.incr(key, _SLOT_EXPIRY_S, -1)
        return False

    async def leave(self, name: str) -> None:
        await self.storage.incr(f"slots/{name}", _SLOT_EXPIRY_S, -1)

    async def check(self) -> None:
        """Raise if the storage cannot be reached (start-up check)."""
        if not await self.storage.check():
            raise ConnectionError("the rate-limit storage does not answer")


def _item(limit: int, window_s: int) -> RateLimitItem:
    if window_s % 60 == 0:
        return RateLimitItemPerMinute(limit, window_s // 60)
    return RateLimitItemPerSecond(limit, window_s)
