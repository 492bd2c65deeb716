"""The API keys file (``--api-keys-file``): tenants, their hashed keys, scopes and limits,
in TOML or JSON (by suffix: ``.json`` is JSON, anything else TOML).

```toml
[[tenants]]
id = "acme"
keys = ["sha256:5e884898da28047151d0e56f8dc6292773603d0d6aabbdd62a11ef721d1542d8"]
faces = ["openai", "tinker"]        # default; "admin" too for an admin key (the console's
                                    # tenants page, every tenant's training runs)
models = ["HuggingFaceTB/SmolLM2-135M-Instruct"]   # default: every served model
weight = 2.0                        # fair-scheduling share (default 1)
requests_per_second = 5             # limits: absent = unlimited
requests_per_minute = 100
tokens_per_minute = 20000
max_concurrent_streams = 4
requests_per_day = 10000            # daily quotas: fixed windows of 86400 s from the
tokens_per_day = 2000000            # tenant's first counted request (not midnight)
```
"""

import contextlib
import fcntl
import json
import os
import tempfile
import threading
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from application.access.keys import Keyring
from domain.tenancy import DEFAULT_FACES, FACES, Tenant, TenantEntry, TenantLimits

_LIMITS = (
    "requests_per_second",
    "requests_per_minute",
    "tokens_per_minute",
    "max_concurrent_streams",
    "requests_per_day",
    "tokens_per_day",
    "max_output_tokens",
)
_FIELDS = {"id", "keys", "faces", "models", "weight", *_LIMITS}


class KeysFileError(ValueError):
    """The keys file cannot be used; the message names the file, tenant and field."""


def load_entries(path: Path) -> list[TenantEntry]:
    """The tenants of the keys file at ``path`` with their key digests, checked."""
    try:
        text = path.read_text()
        data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (OSError, ValueError) as e:
        raise KeysFileError(f"{path}: {e}") from e
    tenants = data.get("tenants") if isinstance(data, dict) else None
    if not isinstance(tenants, list):
        raise KeysFileError(f"{path}: expected a list of tenants under `tenants`")
    entries, seen = [], set()
    for i, raw in enumerate(tenants):
        tenant, keys = _tenant(path, i, raw)
        if tenant.id in seen:
            raise KeysFileError(f"{path}: tenant {tenant.id!r} is listed twice")
        seen.add(tenant.id)
        entries.append(TenantEntry(tenant, tuple(keys)))
    keyring_of(entries, path)  # keys well formed, none listed twice
    return entries


def keyring_of(entries: list[TenantEntry], path: Path | str = "keys") -> Keyring:
    try:
        return Keyring([(key, e.tenant) for e in entries for key in e.keys])
    except ValueError as e:
        raise KeysFileError(f"{path}: {e}") from e


def load_keyring(path: Path) -> Keyring:
    return keyring_of(load_entries(path), path)


def dump_entries(entries: list[TenantEntry], *, as_json: bool) -> str:
    """The keys file's text for ``entries`` (TOML, or JSON)."""
    tables = [_table(e) for e in entries]
    if as_json:
        return json.dumps({"tenants": tables}, indent=2) + "\n"
    lines = [
        "# infer's API keys file (--api-keys-file): tenants, their hashed keys, scopes and",
        "# limits. Written by the admin API (/admin/tenants); edits by hand apply too.",
    ]
    for table in tables:
        lines += ["", "[[tenants]]"]
        lines += [f"{name} = {_toml(value)}" for name, value in table.items()]
    return "\n".join(lines) + "\n"


def _table(entry: TenantEntry) -> dict[str, Any]:
    tenant = entry.tenant
    table: dict[str, Any] = {"id": tenant.id, "keys": list(entry.keys)}
    table["faces"] = sorted(tenant.faces)
    if tenant.models is not None:
        table["models"] = sorted(tenant.models)
    table["weight"] = tenant.weight
    for name in _LIMITS:
        if (value := getattr(tenant.limits, name)) is not None:
            table[name] = value
    return table


def _toml(value: Any) -> str:
    if isinstance(value, str):  # JSON's escapes are TOML's; TOML also escapes DEL
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return repr(value)


class KeysFileStore:
    """The :class:`~domain.tenancy.TenantStore` port on the keys file: changes are made
    under an exclusive ``flock`` on ``<file>.lock`` (other processes' changes wait), read
    fresh from the file, written to a temporary file beside it and renamed over it
    (readers see the old file or the new one, never half of one); :meth:`changed` compares
    the file's identity (device, inode, size, mtime) with the last one seen."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._seen: tuple[int, ...] | None = None
        self._lock = threading.Lock()

    def _identity(self) -> tuple[int, ...] | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def _remove_stale_temporaries(self) -> None:
        """Temporary files of a writer killed before its rename (under the lock: none is
        being written now)."""
        for stale in self.path.parent.glob(f".{self.path.name}.tmp-*"):
            with contextlib.suppress(OSError):
                stale.unlink()

    def load(self) -> list[TenantEntry]:
        seen = self._identity()
        entries = load_entries(self.path)
        self._seen = seen
        return entries

    def changed(self) -> bool:
        return self._identity() != self._seen

    def update(self, change: Callable[[list[TenantEntry]], list[TenantEntry]]) -> list[TenantEntry]:
        lock_path = self.path.with_name(self.path.name + ".lock")
        with self._lock, open(lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            entries = change(load_entries(self.path))
            keyring_of(entries, self.path)
            text = dump_entries(entries, as_json=self.path.suffix == ".json")
            self._remove_stale_temporaries()
            fd, temp = tempfile.mkstemp(prefix=f".{self.path.name}.tmp-", dir=self.path.parent)
            try:
                with os.fdopen(fd, "w") as out:
                    out.write(text)
                    out.flush()
                    os.fsync(out.fileno())
                os.chmod(temp, self.path.stat().st_mode & 0o777)
                os.replace(temp, self.path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(temp)
                raise
            self._seen = self._identity()
            return entries


def _tenant(path: Path, index: int, raw: Any) -> tuple[Tenant, list[str]]:
    where = f"{path}: tenants[{index}]"
    if not isinstance(raw, dict):
        raise KeysFileError(f"{where}: expected a table")
    if unknown := sorted(set(raw) - _FIELDS):
        raise KeysFileError(f"{where}: unknown field {unknown[0]!r}")
    tenant_id = raw.get("id")
    if not isinstance(tenant_id, str) or not tenant_id:
        raise KeysFileError(f"{where}: `id` must be a non-empty string")
    where = f"{path}: tenant {tenant_id!r}"
    keys = raw.get("keys", [])  # none: a tenant nobody can call as yet (the admin API's)
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise KeysFileError(f"{where}: `keys` must be a list of sha256:<hex> strings")
    faces = raw.get("faces", sorted(DEFAULT_FACES))
    if not isinstance(faces, list) or not set(faces) <= set(FACES):
        raise KeysFileError(f"{where}: `faces` must be a list of {', '.join(FACES)}")
    models = raw.get("models")
    if models is not None and (
        not isinstance(models, list) or not all(isinstance(m, str) for m in models)
    ):
        raise KeysFileError(f"{where}: `models` must be a list of model names")
    weight = raw.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, int | float) or weight <= 0:
        raise KeysFileError(f"{where}: `weight` must be a positive number")
    limits = {}
    for name in _LIMITS:
        value = raw.get(name)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise KeysFileError(f"{where}: `{name}` must be a positive integer")
        limits[name] = value
    tenant = Tenant(
        tenant_id,
        frozenset(faces),
        None if models is None else frozenset(models),
        float(weight),
        TenantLimits(**limits),
    )
    return tenant, keys
