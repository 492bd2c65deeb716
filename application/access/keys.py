"""API keys -> tenants. Keys are stored hashed (``sha256:<hex>``); a presented key is
hashed and compared in constant time. The keyring can be replaced whole (key rotation on
SIGHUP) while requests are served."""

import hashlib
import hmac
import secrets
from collections.abc import Iterable

from domain.tenancy import Tenant

HASH_PREFIX = "sha256:"
KEY_PREFIX = "sk-infer-"


def hash_key(key: str) -> str:
    """A key's stored form."""
    return HASH_PREFIX + hashlib.sha256(key.encode()).hexdigest()


KEY_ID_PREFIX = "key_"


def key_id(digest: str) -> str:
    """A stored key's public name (its digest's first 16 hex digits): safe to show, log,
    record in the usage ledger and pass back to revoke the key."""
    return KEY_ID_PREFIX + digest.removeprefix(HASH_PREFIX)[:16]


def new_key() -> str:
    """A new random API key (32 random bytes)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


class Keyring:
    def __init__(self, entries: Iterable[tuple[str, Tenant]] = ()) -> None:
        """``entries``: (hashed key, its tenant) pairs; a hash given twice is an error."""
        self._tenants: dict[str, Tenant] = {}
        for hashed, tenant in entries:
            if not hashed.startswith(HASH_PREFIX) or len(hashed) != len(HASH_PREFIX) + 64:
                raise ValueError(f"tenant {tenant.id!r}: keys are stored as sha256:<64 hex>")
            if hashed in self._tenants:
                raise ValueError(f"tenant {tenant.id!r}: a key is listed twice")
            self._tenants[hashed] = tenant

    def __len__(self) -> int:
        return len(self._tenants)

    @property
    def tenants(self) -> list[Tenant]:
        return list({t.id: t for t in self._tenants.values()}.values())

    def tenant(self, key: str) -> Tenant | None:
        """The tenant ``key`` stands for, or None."""
        hashed = hash_key(key)
        found = self._tenants.get(hashed)
        # The lookup is by digest; the final comparison is constant-time regardless.
        stored = hashed if found is not None else HASH_PREFIX + "0" * 64
        if found is None or not hmac.compare_digest(stored, hashed):
            return None
        return found
