"""Tenants, their scopes and limits, and the errors and port of per-tenant rate limiting.

A tenant is who an API key stands for: which faces (``openai``: the OpenAI endpoints and
``/v1/generate``; ``tinker``: the fine-tuning API; ``admin``) and models it may use, its
weight under fair scheduling, and its limits. Limits are counted in fixed windows by a
:class:`RateLimitCounters` port (in memory, or in Redis shared by replicas).
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from domain.errors import InferError, InvalidParameterError

FACES = ("openai", "tinker", "admin")
DEFAULT_FACES = frozenset({"openai", "tinker"})


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """None: unlimited. Requests are counted per second, per minute and per day; tokens
    per minute and per day (prompt + ``max_tokens`` reserved at admission in each, the
    unused part given back at the end); streams are requests in progress at once.

    The daily quotas (``requests_per_day``, ``tokens_per_day``) are fixed windows of
    86400 s starting at the tenant's first counted request, not at midnight.
    ``max_output_tokens``: the tokens one request may generate (a request asking more, or
    none, gets this many), in place of the server's ``--max-output-tokens``."""

    requests_per_second: int | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent_streams: int | None = None
    requests_per_day: int | None = None
    tokens_per_day: int | None = None
    max_output_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class Tenant:
    """``models``: the served model names it may use (None: all)."""

    id: str
    faces: frozenset[str] = DEFAULT_FACES
    models: frozenset[str] | None = None
    weight: float = 1.0
    limits: TenantLimits = field(default_factory=TenantLimits)

    def allows_face(self, face: str) -> bool:
        return face in self.faces

    def allows_model(self, model: str) -> bool:
        return self.models is None or model in self.models


LIMIT_FIELDS = tuple(TenantLimits.__dataclass_fields__)
MAX_TENANT_ID = 128


def checked_tenant(
    tenant_id: str,
    faces: frozenset[str] = DEFAULT_FACES,
    models: frozenset[str] | None = None,
    weight: float = 1.0,
    limits: TenantLimits | None = None,
) -> Tenant:
    """A tenant from values a caller sent (the admin API): ``InvalidParameterError``
    naming the field unless the id is 1 to 128 printable characters without '/', the faces
    known, the weight positive and finite and each limit None or a positive integer."""
    if not 0 < len(tenant_id) <= MAX_TENANT_ID or not tenant_id.isprintable() or "/" in tenant_id:
        raise InvalidParameterError(
            "id", f"a tenant id is 1 to {MAX_TENANT_ID} printable characters, no '/'"
        )
    if unknown := sorted(faces - set(FACES)):
        raise InvalidParameterError("faces", f"unknown face {unknown[0]!r}: {', '.join(FACES)}")
    if not 0 < weight < float("inf"):
        raise InvalidParameterError("weight", "must be a positive number")
    limits = limits or TenantLimits()
    for name in LIMIT_FIELDS:
        value = getattr(limits, name)
        if value is not None and (isinstance(value, bool) or value < 1):
            raise InvalidParameterError(name, "must be a positive integer (or null: unlimited)")
    return Tenant(tenant_id, faces, models, float(weight), limits)


@dataclass(frozen=True, slots=True)
class TenantEntry:
    """A tenant and its keys as stored (``sha256:<hex>`` digests, never the keys)."""

    tenant: Tenant
    keys: tuple[str, ...]


class TenantStore(Protocol):
    """Where tenants and their key digests are kept (the keys file), changed by the admin
    API and read back by every process that serves them."""

    def load(self) -> list[TenantEntry]:
        """The tenants now (``InvalidParameterError``: the store cannot be read)."""
        ...

    def update(self, change: Callable[[list[TenantEntry]], list[TenantEntry]]) -> list[TenantEntry]:
        """Apply ``change`` to the tenants under the store's lock (against other processes
        too) and store the result whole, or nothing if ``change`` raises; the result."""
        ...

    def changed(self) -> bool:
        """Whether the store changed since this process last loaded or updated it."""
        ...


class AuthenticationError(InferError):
    """No API key, or one nobody has (HTTP 401)."""


class PermissionDeniedError(InferError):
    """The key's tenant may not use this face or model (HTTP 403)."""


@dataclass(frozen=True, slots=True)
class WindowState:
    """One limit after a request was counted (or refused): its size, what is left in the
    current window and the seconds until the window resets."""

    limit: int
    remaining: int
    reset_s: float


class RateLimitedError(InferError):
    """A tenant is over one of its limits (HTTP 429): ``limit`` names it (``requests``,
    ``tokens``, ``streams``), ``state`` says when to retry."""

    def __init__(self, limit: str, message: str, state: WindowState) -> None:
        super().__init__(message)
        self.limit, self.state = limit, state

    @property
    def retry_after_s(self) -> int:
        return max(1, int(self.state.reset_s + 0.999))


class LimitsUnavailableError(InferError):
    """The rate-limit counters cannot be reached (HTTP 503): nothing is served unchecked."""


class RateLimitCounters(Protocol):
    """Counters in fixed windows, keyed by name (e.g. ``tokens:<tenant>``,
    ``tokens/day:<tenant>``)."""

    async def take(
        self, name: str, amount: int, limit: int, window_s: int
    ) -> tuple[bool, WindowState]:
        """Count ``amount`` in the current window if the window stays within ``limit``;
        nothing is counted when it would not (False)."""
        ...

    async def give_back(self, name: str, amount: int, limit: int, window_s: int) -> None:
        """Uncount ``amount`` taken in the current window (callers give back only before
        the window they took it in resets)."""
        ...

    async def charge(self, name: str, amount: int, limit: int, window_s: int) -> None:
        """Count ``amount`` in the current window whatever the limit (use beyond a
        reservation)."""
        ...

    async def enter(self, name: str, limit: int) -> bool:
        """One more holder of a concurrency slot if fewer than ``limit`` hold one."""
        ...

    async def leave(self, name: str) -> None: ...
