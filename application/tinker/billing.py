"""UsageMeter: each tenant's usage in hourly buckets, for ``/billing/usage/events``.

What the service already counts, per UTC hour, base model and session: tokens trained
(forward and forward/backward passes), prompt tokens prefilled and tokens sampled
(samples), checkpoints saved. No prices: this server bills nothing. The prefix cache's
savings are not known here, so every prefill token is reported uncached. Kept in memory:
``retention_s`` of buckets (the oldest dropped first, and past ``max_buckets`` per
tenant), lost on restart.
"""

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from domain.observer import TrainingOpStats
from domain.tinker.errors import InvalidTrainingRequest
from domain.tinker.values import RunRecord

UsageKind = Literal["training", "sampling_prefill", "sampling_sample", "checkpoint"]

HOUR_S = 3600
MAX_WINDOW_S = 14 * 24 * HOUR_S  # the widest window one query may ask for
RETENTION_S = 35 * 24 * HOUR_S
MAX_BUCKETS = 100_000  # per tenant: (hour, kind, base model, session) rows
MAX_TENANTS = 1024
TRAINING_OPS = frozenset({"ForwardBackward", "Forward"})


@dataclass(frozen=True, slots=True)
class UsageKey:
    hour: int  # unix seconds of the bucket's start
    kind: UsageKind
    base_model: str | None
    session_id: str | None


@dataclass(frozen=True, slots=True)
class UsageEvent:
    key: UsageKey
    quantity: int  # tokens, or checkpoints


@dataclass(eq=False)
class _Buckets:
    """One tenant's rows by hour (oldest first)."""

    hours: OrderedDict[int, dict[UsageKey, int]] = field(default_factory=OrderedDict)
    rows: int = 0


class UsageMeter:
    def __init__(
        self,
        run_of: Callable[[str], RunRecord | None],
        *,
        retention_s: float = RETENTION_S,
        max_buckets: int = MAX_BUCKETS,
        max_tenants: int = MAX_TENANTS,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        """``run_of``: a training run by id (its base model and session), None if unknown."""
        self._run_of = run_of
        self._retention_s = retention_s
        self._max_buckets = max_buckets
        self._max_tenants = max_tenants
        self._clock = wall_clock
        self._tenants: OrderedDict[str, _Buckets] = OrderedDict()
        self._lock = threading.Lock()  # checkpoints are saved from worker threads

    def add(
        self,
        owner: str,
        kind: UsageKind,
        quantity: int,
        *,
        base_model: str | None,
        session_id: str | None,
    ) -> None:
        if quantity <= 0:
            return
        now = self._clock()
        hour = int(now // HOUR_S) * HOUR_S
        key = UsageKey(hour, kind, base_model, session_id)
        with self._lock:
            tenant = self._tenants.get(owner)
            if tenant is None:
                tenant = self._tenants[owner] = _Buckets()
                while len(self._tenants) > self._max_tenants:
                    self._tenants.popitem(last=False)
            else:
                self._tenants.move_to_end(owner)
            rows = tenant.hours.setdefault(hour, {})
            tenant.rows += key not in rows
            rows[key] = rows.get(key, 0) + quantity
            # The oldest hours go first: past the retention, or past the cap.
            cutoff = now - self._retention_s
            while len(tenant.hours) > 1:
                oldest = next(iter(tenant.hours))
                if oldest >= cutoff and tenant.rows <= self._max_buckets:
                    break
                tenant.rows -= len(tenant.hours.pop(oldest))

    # --- what is counted --------------------------------------------------------------

    def on_training_op(self, stats: TrainingOpStats) -> None:
        """The service's observer: the tokens of forward and forward/backward passes."""
        if stats.op not in TRAINING_OPS or not stats.ok:
            return
        run = self._run_of(stats.run_id) if stats.run_id is not None else None
        self.add(
            stats.tenant_id,
            "training",
            stats.tokens,
            base_model=run.base_model if run is not None else None,
            session_id=stats.session_id,
        )

    def sampled(
        self,
        owner: str,
        *,
        base_model: str,
        session_id: str | None,
        prompt_tokens: int,
        sampled_tokens: int,
    ) -> None:
        self.add(
            owner, "sampling_prefill", prompt_tokens, base_model=base_model, session_id=session_id
        )
        self.add(
            owner, "sampling_sample", sampled_tokens, base_model=base_model, session_id=session_id
        )

    def checkpoint_saved(self, owner: str, *, base_model: str, session_id: str | None) -> None:
        self.add(owner, "checkpoint", 1, base_model=base_model, session_id=session_id)

    # --- queries ----------------------------------------------------------------------

    def events(self, owner: str, start: float, end: float) -> list[UsageEvent]:
        """``owner``'s buckets in ``[start, end)`` (unix seconds, on hour boundaries; at
        most 14 days; not starting in the future), by hour then largest first."""
        check_window(start, end, self._clock())
        with self._lock:
            tenant = self._tenants.get(owner)
            hours = list(tenant.hours.items()) if tenant is not None else []
        found = [
            UsageEvent(k, q) for hour, rows in hours if start <= hour < end for k, q in rows.items()
        ]
        return sorted(found, key=lambda e: (e.key.hour, -e.quantity, e.key.kind))


def check_window(start: float, end: float, now: float) -> None:
    for name, value in (("starting_on", start), ("ending_before", end)):
        if value % HOUR_S:
            raise InvalidTrainingRequest(f"{name} must be on a UTC hour boundary")
    if end <= start:
        raise InvalidTrainingRequest("ending_before must be after starting_on")
    if end - start > MAX_WINDOW_S:
        raise InvalidTrainingRequest("the window may span at most 14 days")
    if start > now:
        raise InvalidTrainingRequest("starting_on must not be in the future")
