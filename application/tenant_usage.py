"""TenantUsage: each tenant's use of the inference faces today (UTC), for the console.

Counted per API request when it ends: the request, its prompt and completion tokens, and
whether it was refused with a 429 (a rate limit, or a full queue). Tenants are the keys
file's ids (``None``: a request without a key, on an open server). Kept in memory for the
current UTC day only (a new day starts from zero), at most ``max_tenants`` tenants (the
rest counted under :data:`OTHER`); lost on restart. Prometheus' ``infer:tenant_*`` counters
count the same since the process started.
"""

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

DAY_S = 24 * 3600
MAX_TENANTS = 1024
NO_TENANT = ""  # requests without a key (an open server)
OTHER = "other"  # tenants past ``max_tenants``


@dataclass(frozen=True, slots=True)
class UsageToday:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    rate_limited: int = 0  # requests answered 429
    errors: int = 0  # other requests answered 4xx / 5xx


class TenantUsage:
    def __init__(
        self, *, max_tenants: int = MAX_TENANTS, wall_clock: Callable[[], float] = time.time
    ) -> None:
        self._max_tenants = max_tenants
        self._clock = wall_clock
        self._day = self._today()
        self._usage: dict[str, UsageToday] = {}
        self._lock = threading.Lock()

    def _today(self) -> int:
        """The current UTC day's start (unix seconds)."""
        return int(self._clock() // DAY_S) * DAY_S

    def _roll(self) -> None:
        day = self._today()
        if day != self._day:
            self._day, self._usage = day, {}

    def record(
        self,
        tenant_id: str | None,
        status: int | None,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
    ) -> None:
        """One API request ended with ``status`` (None: it never answered)."""
        key = tenant_id or NO_TENANT
        with self._lock:
            self._roll()
            if key not in self._usage and len(self._usage) >= self._max_tenants:
                key = OTHER
            now = self._usage.get(key, UsageToday())
            self._usage[key] = replace(
                now,
                requests=now.requests + 1,
                prompt_tokens=now.prompt_tokens + max(0, prompt_tokens),
                completion_tokens=now.completion_tokens + max(0, completion_tokens),
                rate_limited=now.rate_limited + (status == 429),
                errors=now.errors + (status != 429 and (status is None or status >= 400)),
            )

    def today(self) -> tuple[float, dict[str, UsageToday]]:
        """The day's start (unix seconds, UTC) and each tenant's usage since."""
        with self._lock:
            self._roll()
            return float(self._day), dict(self._usage)
