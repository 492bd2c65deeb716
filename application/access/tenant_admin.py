"""TenantAdmin: tenants and their API keys changed at run time (the admin API), and the
keys file watched so that every process serving it applies a change within seconds.

Every change goes through the :class:`~domain.tenancy.TenantStore` (the keys file, locked
and replaced whole), is applied to this process's :class:`~application.access.access.Access` at
once and written as an audit line (logger ``infer.audit``: what changed, by which admin
tenant). A new key is returned once and stored only as its SHA-256 digest; keys are named
by ``key_`` + the first 16 hex digits of that digest. No change may leave the file without
an admin key (the operator would be locked out of the admin API).
"""

import asyncio
from collections.abc import Callable
from dataclasses import asdict, replace

import structlog

from application.access.access import Access
from application.access.audit import Audit
from application.access.keys import Keyring, hash_key, key_id, new_key
from domain.errors import InferError, InvalidParameterError
from domain.tenancy import Tenant, TenantEntry, TenantStore

audit = structlog.get_logger("infer.audit")
ADMIN = "admin"
MAX_KEYS_PER_TENANT = 64
DEFAULT_WATCH_S = 2.0


class TenantNotFoundError(InferError):
    """No tenant (or key) of that id (HTTP 404)."""


def keyring(entries: list[TenantEntry]) -> Keyring:
    return Keyring([(key, e.tenant) for e in entries for key in e.keys])


class TenantAdmin:
    def __init__(
        self,
        store: TenantStore,
        access: Access,
        *,
        source: str = "admin API",
        audit: Audit | None = None,
    ) -> None:
        self.store, self.access, self.source = store, access, source
        self.audit = audit or Audit()

    # --- reading ------------------------------------------------------------------------

    def entries(self) -> list[TenantEntry]:
        return self.store.load()

    def entry(self, tenant_id: str) -> TenantEntry:
        return _find(self.store.load(), tenant_id)

    # --- changing -----------------------------------------------------------------------

    def put(self, tenant: Tenant, actor: str | None) -> tuple[TenantEntry, bool]:
        """Create ``tenant`` (no keys yet) or replace its settings (its keys kept); the
        entry, and whether it was created."""
        created = False

        def change(entries: list[TenantEntry]) -> list[TenantEntry]:
            nonlocal created
            for i, entry in enumerate(entries):
                if entry.tenant.id == tenant.id:
                    return [*entries[:i], replace(entry, tenant=tenant), *entries[i + 1 :]]
            created = True
            return [*entries, TenantEntry(tenant, ())]

        entries = self._update(change)
        entry = _find(entries, tenant.id)
        self.audit.record(
            "tenant created" if created else "tenant updated",
            actor=actor,
            subject=f"tenant:{tenant.id}",
            tenant=tenant.id,
            faces=sorted(tenant.faces),
            models=None if tenant.models is None else sorted(tenant.models),
            weight=tenant.weight,
            limits={k: v for k, v in _limits(tenant).items() if v is not None},
        )
        return entry, created

    def delete(self, tenant_id: str, actor: str | None) -> None:
        def change(entries: list[TenantEntry]) -> list[TenantEntry]:
            _find(entries, tenant_id)
            return [e for e in entries if e.tenant.id != tenant_id]

        self._update(change)
        self.audit.record(
            "tenant deleted", actor=actor, subject=f"tenant:{tenant_id}", tenant=tenant_id
        )

    def add_key(self, tenant_id: str, actor: str | None) -> tuple[str, str]:
        """A new key for the tenant: (its id, the key itself: shown this once)."""
        key = new_key()
        digest = hash_key(key)

        def change(entries: list[TenantEntry]) -> list[TenantEntry]:
            entry = _find(entries, tenant_id)
            if len(entry.keys) >= MAX_KEYS_PER_TENANT:
                raise InvalidParameterError(
                    "keys", f"tenant {tenant_id!r} has {MAX_KEYS_PER_TENANT} keys: revoke one"
                )
            return _replaced(entries, replace(entry, keys=(*entry.keys, digest)))

        self._update(change)
        self.audit.record(
            "api key created",
            actor=actor,
            subject=f"tenant:{tenant_id}",
            tenant=tenant_id,
            key_id=key_id(digest),
        )
        return key_id(digest), key

    def revoke_key(self, tenant_id: str, revoked: str, actor: str | None) -> None:
        def change(entries: list[TenantEntry]) -> list[TenantEntry]:
            entry = _find(entries, tenant_id)
            kept = tuple(k for k in entry.keys if key_id(k) != revoked)
            if len(kept) == len(entry.keys):
                raise TenantNotFoundError(f"tenant {tenant_id!r} has no key {revoked!r}")
            return _replaced(entries, replace(entry, keys=kept))

        self._update(change)
        self.audit.record(
            "api key revoked",
            actor=actor,
            subject=f"tenant:{tenant_id}",
            tenant=tenant_id,
            key_id=revoked,
        )

    def _update(
        self, change: Callable[[list[TenantEntry]], list[TenantEntry]]
    ) -> list[TenantEntry]:
        def checked(entries: list[TenantEntry]) -> list[TenantEntry]:
            changed = change(entries)
            if any(e.keys for e in entries if e.tenant.allows_face(ADMIN)) and not any(
                e.keys for e in changed if e.tenant.allows_face(ADMIN)
            ):
                raise InvalidParameterError(
                    "tenant", "this would leave no admin key: every admin would be locked out"
                )
            return changed

        entries = self.store.update(checked)
        self.access.replace(keyring(entries), self.source, audited=False)
        return entries

    # --- watching -----------------------------------------------------------------------

    def reload_if_changed(self) -> bool:
        """Apply the store's tenants if another process (or a hand edit) changed it; a
        store that cannot be read is logged and the keys in use stay."""
        if not self.store.changed():
            return False
        try:
            self.access.replace(keyring(self.store.load()), "keys file changed")
        except Exception as e:
            audit.error("api keys reload failed; the old keys stay", error=str(e))
        return True

    async def watch(self, interval_s: float = DEFAULT_WATCH_S) -> None:
        """Reload the keys whenever the store changes (checked every ``interval_s``)."""
        while True:
            await asyncio.sleep(interval_s)
            await asyncio.to_thread(self.reload_if_changed)


def _find(entries: list[TenantEntry], tenant_id: str) -> TenantEntry:
    for entry in entries:
        if entry.tenant.id == tenant_id:
            return entry
    raise TenantNotFoundError(f"no tenant {tenant_id!r}")


def _replaced(entries: list[TenantEntry], new: TenantEntry) -> list[TenantEntry]:
    return [new if e.tenant.id == new.tenant.id else e for e in entries]


def _limits(tenant: Tenant) -> dict[str, int | None]:
    return asdict(tenant.limits)
