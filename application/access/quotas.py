"""Per-tenant limits: requests per second, per minute and per day, tokens per minute and
per day, concurrent streams, counted on the :class:`RateLimitCounters` port (memory or
Redis).

Tokens are reserved when a request is admitted (its prompt tokens + ``max_tokens`` for
every choice), in each token window the tenant has (minute, day), and settled when it
ends: in each window, the unused part is given back if that window has not reset since it
was taken, and use beyond the reservation is counted. A refused request counts nothing:
what it took in the windows checked before the one that refused it is given back.

Daily quotas are fixed windows of 86400 s starting at the tenant's first counted request
(not at midnight). :meth:`Quotas.seed` counts usage recorded elsewhere into them, so that
they survive a restart when the counters live in memory.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from domain.tenancy import (
    LimitsUnavailableError,
    RateLimitCounters,
    RateLimitedError,
    Tenant,
    WindowState,
)

SECOND, MINUTE, DAY = 1, 60, 86400


@dataclass
class Reservation:
    """What one request took in one window (its tokens; or its one request, while the
    others are checked): the counter, its limit and window, and the wall time that window
    resets (what is not used is given back only before then)."""

    name: str
    limit: int
    window_s: int
    tokens: int
    until: float


@dataclass
class Admission:
    """What one API request holds: its token reservations (one per token window) and
    stream slot, and the window states for the ``x-ratelimit-*`` headers (each the
    tightest of its windows: the least remaining)."""

    tenant: Tenant
    requests: WindowState | None = None
    tokens: WindowState | None = None
    reservations: list[Reservation] = field(default_factory=list)
    stream: bool = False
    settled: bool = field(default=False, repr=False)

    @property
    def reserved_tokens(self) -> int:
        """The tokens reserved for the request (the same in every window)."""
        return max((r.tokens for r in self.reservations), default=0)


def _tighter(old: WindowState | None, new: WindowState) -> WindowState:
    return new if old is None or new.remaining < old.remaining else old


class Quotas:
    def __init__(
        self,
        counters: RateLimitCounters,
        *,
        clock: Callable[[], float] = time.time,
        on_refused: Callable[[str, str], None] | None = None,
    ) -> None:
        """``on_refused(tenant_id, limit)``: told of every refusal (a metric)."""
        self.counters, self.clock, self.on_refused = counters, clock, on_refused

    def _refused(self, tenant: Tenant, limit: str, message: str, state: WindowState) -> Exception:
        if self.on_refused is not None:
            self.on_refused(tenant.id, limit)
        return RateLimitedError(limit, message, state)

    async def admit(self, tenant: Tenant) -> Admission:
        """Count one request (per second, per minute, per day); raises
        :class:`RateLimitedError` (:class:`LimitsUnavailableError` when the counters
        cannot be reached)."""
        try:
            return await self._admit(tenant)
        except (RateLimitedError, LimitsUnavailableError):
            raise
        except Exception as e:
            raise LimitsUnavailableError(f"rate limits cannot be checked now: {e}") from e

    async def reserve(self, admission: Admission, tokens: int, *, stream: bool = True) -> None:
        """Reserve ``tokens`` for the request in each token window and take a stream slot
        (``stream`` False: work that holds none); raises :class:`RateLimitedError`
        (nothing held then)."""
        try:
            await self._reserve(admission, tokens, stream)
        except (RateLimitedError, LimitsUnavailableError):
            raise
        except Exception as e:
            raise LimitsUnavailableError(f"rate limits cannot be checked now: {e}") from e

    async def seed(self, tenant: Tenant, requests: int, tokens: int) -> None:
        """Count ``requests`` and ``tokens`` the tenant already used (read from a usage
        ledger, say) into its daily windows, whatever their limits; nothing for a limit it
        does not have. Used at start-up so that daily quotas survive a restart when the
        counters live in memory (counters in Redis survive it themselves: seeding them
        would count the usage twice)."""
        limits = tenant.limits
        if limits.requests_per_day is not None and requests > 0:
            await self.counters.charge(
                f"requests/{DAY}:{tenant.id}", requests, limits.requests_per_day, DAY
            )
        if limits.tokens_per_day is not None and tokens > 0:
            await self.counters.charge(
                f"tokens/day:{tenant.id}", tokens, limits.tokens_per_day, DAY
            )

    async def _admit(self, tenant: Tenant) -> Admission:
        limits, admission = tenant.limits, Admission(tenant)
        taken: list[Reservation] = []
        for amount, window, unit in (
            (limits.requests_per_second, SECOND, "second"),
            (limits.requests_per_minute, MINUTE, "minute"),
            (limits.requests_per_day, DAY, "day"),
        ):
            if amount is None:
                continue
            name = f"requests/{window}:{tenant.id}"
            ok, state = await self.counters.take(name, 1, amount, window)
            if not ok:
                await self._give_back_all(taken)  # a refused request counts nothing
                what = "daily quota" if window == DAY else "rate limit"
                raise self._refused(
                    tenant,
                    "requests",
                    f"{what} reached: {amount} requests per {unit} for this key; retry "
                    f"in {state.reset_s:.1f} s",
                    state,
                )
            taken.append(Reservation(name, amount, window, 1, self.clock() + state.reset_s))
            admission.requests = _tighter(admission.requests, state)
        return admission

    async def _reserve(self, admission: Admission, tokens: int, stream: bool) -> None:
        tenant, limits = admission.tenant, admission.tenant.limits
        windows = [
            (limit, name, window, unit)
            for limit, name, window, unit in (
                (limits.tokens_per_minute, f"tokens:{tenant.id}", MINUTE, "minute"),
                (limits.tokens_per_day, f"tokens/day:{tenant.id}", DAY, "day"),
            )
            if limit is not None
        ]
        for limit, _, window, unit in windows:  # what could never fit, before taking any
            if tokens > limit:
                raise self._refused(
                    tenant,
                    "tokens",
                    f"this request needs {tokens} tokens (prompt + max_tokens), more than "
                    f"the {limit} tokens per {unit} this key may use; lower max_tokens",
                    WindowState(limit, 0, window),
                )
        taken: list[Reservation] = []
        state: WindowState | None = None
        for limit, name, window, unit in windows:
            ok, window_state = await self.counters.take(name, tokens, limit, window)
            if not ok:
                await self._give_back_all(taken)
                what = "daily quota" if window == DAY else "rate limit"
                raise self._refused(
                    tenant,
                    "tokens",
                    f"{what} reached: {limit} tokens per {unit} for this key "
                    f"({window_state.remaining} left, this request needs {tokens}); retry "
                    f"in {window_state.reset_s:.1f} s",
                    window_state,
                )
            taken.append(
                Reservation(name, limit, window, tokens, self.clock() + window_state.reset_s)
            )
            state = _tighter(state, window_state)
        if state is not None:
            admission.tokens = state
        if stream and limits.max_concurrent_streams is not None:
            if not await self.counters.enter(f"streams:{tenant.id}", limits.max_concurrent_streams):
                await self._give_back_all(taken)
                raise self._refused(
                    tenant,
                    "streams",
                    f"too many requests in progress: {limits.max_concurrent_streams} at once "
                    "for this key",
                    WindowState(limits.max_concurrent_streams, 0, 1.0),
                )
            admission.stream = True
        for reservation in taken:  # a second reservation adds to the first
            held = next((r for r in admission.reservations if r.name == reservation.name), None)
            if held is None:
                admission.reservations.append(reservation)
            else:
                held.tokens += reservation.tokens
                held.until = min(held.until, reservation.until)

    async def settle(self, admission: Admission, used_tokens: int) -> None:
        """The request ended having used ``used_tokens``: in each token window, give back
        the rest of its reservation (or count what it used beyond it), and give back its
        stream slot. Idempotent."""
        if admission.settled:
            return
        admission.settled = True
        for reservation in admission.reservations:
            extra = used_tokens - reservation.tokens
            if extra > 0:
                await self.counters.charge(
                    reservation.name, extra, reservation.limit, reservation.window_s
                )
            else:
                await self._give_back(reservation, -extra)
        if admission.stream:
            await self.counters.leave(f"streams:{admission.tenant.id}")

    async def _give_back_all(self, taken: list[Reservation]) -> None:
        for reservation in taken:
            await self._give_back(reservation, reservation.tokens)

    async def _give_back(self, reservation: Reservation, amount: int) -> None:
        """Uncount ``amount`` of ``reservation`` if its window has not reset since."""
        if amount and self.clock() < reservation.until:
            await self.counters.give_back(
                reservation.name, amount, reservation.limit, reservation.window_s
            )
