"""Who may call, and how much: the keyring (None: an open local server), the quotas
counted per tenant, and what tenants' weights the scheduler shares by."""

from collections.abc import Callable, Sequence
from typing import Any

import structlog

from application.access.audit import Audit
from application.access.keys import Keyring
from application.access.quotas import Quotas, RateLimitCounters
from domain.tenancy import Tenant

log = structlog.get_logger("infer.audit")


class Access:
    def __init__(
        self,
        keyring: Keyring | None = None,
        quotas: Quotas | None = None,
        *,
        on_tenants: Callable[[Sequence[Tenant]], None] | None = None,
    ) -> None:
        """``on_tenants``: told the tenants whenever the keyring is (re)placed (the
        scheduler's weights)."""
        self.keyring, self.quotas, self.on_tenants = keyring, quotas, on_tenants
        self.audit: Audit | None = None  # where reloads are recorded (besides the log)
        if keyring is not None and on_tenants is not None:
            on_tenants(keyring.tenants)

    @classmethod
    def for_keyring(
        cls,
        keyring: Keyring | None,
        counters: Callable[[], RateLimitCounters],
        *,
        on_refused: Callable[[str, str], None] | None = None,
        on_tenants: Callable[[Sequence[Tenant]], None] | None = None,
    ) -> "Access":
        """Keys and limits (none without a keyring: an open server): quotas counted on
        ``counters()`` (built only with a keyring); ``on_refused``: told of each refusal;
        ``on_tenants``: told the tenants (their weights) whenever the keyring is placed."""
        quotas = None
        if keyring is not None:
            quotas = Quotas(counters(), on_refused=on_refused)
        return cls(keyring, quotas, on_tenants=on_tenants)

    @property
    def open(self) -> bool:
        """No keys: anyone who reaches the port may call, without limits."""
        return self.keyring is None

    def tenant(self, key: str) -> Tenant | None:
        return None if self.keyring is None else self.keyring.tenant(key)

    def replace(self, keyring: Keyring, source: str, *, audited: bool = True) -> None:
        """Swap the keyring at once (key rotation); an audit line says what changed
        (``audited`` False: the caller audits the change itself, as the admin API does)."""
        before = set() if self.keyring is None else {t.id for t in self.keyring.tenants}
        self.keyring = keyring
        after = {t.id for t in keyring.tenants}
        if self.on_tenants is not None:
            self.on_tenants(keyring.tenants)
        details: dict[str, Any] = {
            "source": source,
            "tenants": len(after),
            "keys": len(keyring),
            "added": sorted(after - before),
            "removed": sorted(before - after),
        }
        if not audited:
            return
        if self.audit is not None:
            self.audit.record("api keys reloaded", actor=None, subject="keys", **details)
        else:
            log.info("api keys reloaded", **details)
