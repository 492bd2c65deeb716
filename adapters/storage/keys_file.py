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

import json
import tomllib
from pathlib import Path
from typing import Any

from application.keys import Keyring
from domain.tenancy import DEFAULT_FACES, FACES, Tenant, TenantLimits

_LIMITS = (
    "requests_per_second",
    "requests_per_minute",
    "tokens_per_minute",
    "max_concurrent_streams",
    "requests_per_day",
    "tokens_per_day",
)
_FIELDS = {"id", "keys", "faces", "models", "weight", *_LIMITS}


class KeysFileError(ValueError):
    """The keys file cannot be used; the message names the file, tenant and field."""


def load_keyring(path: Path) -> Keyring:
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
        entries += [(key, tenant) for key in keys]
    try:
        return Keyring(entries)
    except ValueError as e:
        raise KeysFileError(f"{path}: {e}") from e


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
    keys = raw.get("keys")
    if not isinstance(keys, list) or not keys or not all(isinstance(k, str) for k in keys):
        raise KeysFileError(f"{where}: `keys` must be a non-empty list of sha256:<hex> strings")
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
