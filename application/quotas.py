"""Per-tenant limits: requests per second and per minute, tokens per minute, concurrent
streams, counted on the :class:`RateLimitCounters` port (memory or Redis).

Tokens are reserved when a request is admitted (its prompt tokens + ``max_tokens`` for
every choice) and settled when it ends: the unused part is given back, if the window it was
taken in has not reset yet, and use beyond the reservation is counted. A refused request
counts nothing.
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

MINUTE, SECOND = 60, 1


@dataclass
class Admission:
    """What one API request holds: its token reservation and stream slot, and the window
    states for the ``x-ratelimit-*`` headers."""

    tenant: Tenant
    requests: WindowState | None = None
    tokens: WindowState | None = None
    reserved_tokens: int = 0
    reserved_until: float = 0.0  # the wall time the token window resets
    stream: bool = False
    settled: bool = field(default=False, repr=False)


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
        """Count one request (per second, per minute); raises :class:`RateLimitedError`
        (:class:`LimitsUnavailableError` when the counters cannot be reached)."""
        try:
            return await self._admit(tenant)
        except (RateLimitedError, LimitsUnavailableError):
            raise
        except Exception as e:
            raise LimitsUnavailableError(f"rate limits cannot be checked now: {e}") from e

    async def reserve(self, admission: Admission, tokens: int, *, stream: bool = True) -> None:
        """Reserve ``tokens`` for the request and take a stream slot (``stream`` False:
        work that holds none); raises :class:`RateLimitedError` (nothing held then)."""
        try:
            await self._reserve(admission, tokens, stream)
        except (RateLimitedError, LimitsUnavailableError):
            raise
        except Exception as e:
            raise LimitsUnavailableError(f"rate limits cannot be checked now: {e}") from e

    async def _admit(self, tenant: Tenant) -> Admission:
        limits, admission = tenant.limits, Admission(tenant)
        for amount, window, unit in (
            (limits.requests_per_second, SECOND, "second"),
            (limits.requests_per_minute, MINUTE, "minute"),
        ):
            if amount is None:
                continue
            ok, state = await self.counters.take(
                f"requests/{window}:{tenant.id}", 1, amount, window
            )
            if not ok:
                raise self._refused(
                    tenant,
                    "requests",
                    f"rate limit reached: {amount} requests per {unit} for this key; retry "
                    f"in {state.reset_s:.1f} s",
                    state,
                )
            if admission.requests is None or state.remaining < admission.requests.remaining:
                admission.requests = state
        return admission

    async def _reserve(self, admission: Admission, tokens: int, stream: bool) -> None:
        tenant, limits = admission.tenant, admission.tenant.limits
        if limits.tokens_per_minute is not None:
            if tokens > limits.tokens_per_minute:
                raise self._refused(
                    tenant,
                    "tokens",
                    f"this request needs {tokens} tokens (prompt + max_tokens), more than "
                    f"the {limits.tokens_per_minute} tokens per minute this key may use; "
                    "lower max_tokens",
                    WindowState(limits.tokens_per_minute, 0, MINUTE),
                )
            ok, state = await self.counters.take(
                f"tokens:{tenant.id}", tokens, limits.tokens_per_minute, MINUTE
            )
            if not ok:
                raise self._refused(
                    tenant,
                    "tokens",
                    f"rate limit reached: {limits.tokens_per_minute} tokens per minute for "
                    f"this key ({state.remaining} left, this request needs {tokens}); retry "
                    f"in {state.reset_s:.1f} s",
                    state,
                )
            admission.tokens = state
            admission.reserved_tokens = tokens
            admission.reserved_until = self.clock() + state.reset_s
        if stream and limits.max_concurrent_streams is not None:
            if not await self.counters.enter(f"streams:{tenant.id}", limits.max_concurrent_streams):
                await self._give_back(admission, admission.reserved_tokens)
                admission.reserved_tokens = 0
                raise self._refused(
                    tenant,
                    "streams",
                    f"too many requests in progress: {limits.max_concurrent_streams} at once "
                    "for this key",
                    WindowState(limits.max_concurrent_streams, 0, 1.0),
                )
            admission.stream = True

    async def settle(self, admission: Admission, used_tokens: int) -> None:
        """The request ended having used ``used_tokens``: give back the rest of its
        reservation (or count what it used beyond it) and its stream slot. Idempotent."""
        if admission.settled:
            return
        admission.settled = True
        limit = admission.tenant.limits.tokens_per_minute
        if limit is not None and admission.tokens is not None:
            extra = used_tokens - admission.reserved_tokens
            if extra > 0:
                await self.counters.charge(f"tokens:{admission.tenant.id}", extra, limit, MINUTE)
            else:
                await self._give_back(admission, -extra)
        if admission.stream:
            await self.counters.leave(f"streams:{admission.tenant.id}")

    async def _give_back(self, admission: Admission, tokens: int) -> None:
        limit = admission.tenant.limits.tokens_per_minute
        if tokens and limit is not None and self.clock() < admission.reserved_until:
            await self.counters.give_back(f"tokens:{admission.tenant.id}", tokens, limit, MINUTE)
