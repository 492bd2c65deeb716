"""What the composition root builds on the storage adapters: the idempotent replies' store
and the stored responses (in Redis or in memory), Tinker's checkpoint folders, and the
usage ledger (SQLite, PostgreSQL or memory)."""

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import structlog

from adapters.storage.audit_sql import open_audit_trail
from adapters.storage.checkpoints import FileCheckpointStorage
from adapters.storage.idempotency import RedisIdempotencyStore
from adapters.storage.keys_file import KeysFileStore
from adapters.storage.lora_sql import open_adapter_store
from adapters.storage.responses import RedisResponseStore
from adapters.storage.rollouts_sql import open_rollout_store
from adapters.storage.usage_sql import DEFAULT_USAGE_DB, open_ledger
from application.access.access import Access
from application.access.audit import Audit, MemoryAuditTrail
from application.access.idempotency import MemoryIdempotencyStore
from application.access.tenant_admin import TenantAdmin
from application.access.usage_ledger import DAY_S, MemoryUsageLedger, UsageRecorder
from application.serving.lora_adapters import AdapterBook
from application.serving.responses import MemoryResponseStore
from application.serving.rollouts import RolloutBook
from application.serving.served_models import ServedModels
from domain.audit import AuditTrail
from domain.errors import InvalidParameterError
from domain.idempotency import IdempotencyStore
from domain.responses import ResponseStore

DEFAULT_CHECKPOINT_DIR = "~/.cache/infer/tinker"
T = TypeVar("T")
log = structlog.get_logger(__name__)


def build_idempotency(ttl: float, redis_url: str | None, max_keys: int) -> IdempotencyStore | None:
    """Replies to Idempotency-Key requests: in Redis with ``redis_url``, else in memory
    (``max_keys`` at most); ``ttl`` 0: off."""
    if ttl == 0:
        return None
    if redis_url is not None:
        return RedisIdempotencyStore(redis_url)
    return MemoryIdempotencyStore(max_keys)


def build_response_store(
    ttl: float, redis_url: str | None, max_stored: int
) -> ResponseStore | None:
    """Where ``/v1/responses`` keeps finished responses, each ``ttl`` seconds: in Redis
    with ``redis_url``, else in memory (``max_stored`` at most); ``ttl`` 0: none are kept."""
    if ttl == 0:
        return None
    if redis_url is not None:
        return RedisResponseStore(redis_url, ttl)
    return MemoryResponseStore(max_stored, ttl)


def checkpoint_storage(checkpoint_dir: str | None) -> FileCheckpointStorage:
    """Tinker's checkpoints as folders under ``checkpoint_dir`` (None: the default)."""
    return FileCheckpointStorage(Path(checkpoint_dir or DEFAULT_CHECKPOINT_DIR))


def build_usage_recorder(
    target: str | None,
    retention_days: float,
    track: Callable[[UsageRecorder], None] | None = None,
) -> UsageRecorder:
    """The usage ledger ``target`` names (None: this process's memory), records kept
    ``retention_days`` (0: for ever). The default file that cannot be opened (a read-only
    home) falls back to memory with a warning; another target is an error naming
    ``--usage-db``. ``track``: told the recorder (the metrics' gauges)."""
    retention = None if retention_days == 0 else retention_days * DAY_S
    recorder = UsageRecorder(
        _database(target, open_ledger, MemoryUsageLedger), retention_s=retention
    )
    if track is not None:
        track(recorder)
    return recorder


def _database(target: str | None, open_it: Callable[[str], T], memory: Callable[[], T]) -> T:
    if target is None:
        return memory()
    try:
        return open_it(target)
    except Exception as e:
        if target == DEFAULT_USAGE_DB:
            log.warning(
                "the usage database cannot be opened; usage and rollouts kept in memory",
                database=target,
                error=str(e),
            )
            return memory()
        raise InvalidParameterError("usage_db", f"{target!r} cannot be opened: {e}") from e


def build_audit(target: str | None, access: Access) -> Audit:
    """The audit trail in the database ``target`` names (``--usage-db``; None: memory),
    which ``access`` records its keys' reloads in too."""

    def sql(where: str) -> AuditTrail:
        return open_audit_trail(where)

    def memory() -> AuditTrail:
        return MemoryAuditTrail()

    audit = Audit(_database(target, sql, memory))
    access.audit = audit
    return audit


def build_tenant_admin(keys_file: str | None, access: Access, audit: Audit) -> TenantAdmin | None:
    """The admin API's tenants over the keys file (None: no keys file to keep them in)."""
    if keys_file is None:
        return None
    store = KeysFileStore(Path(keys_file).expanduser())
    store.load()  # what this process serves now: later changes are told apart
    return TenantAdmin(store, access, source=keys_file, audit=audit)


def build_adapter_book(models: ServedModels, target: str | None, audit: Audit) -> AdapterBook:
    """``models``' LoRA adapters loaded at run time, kept in the database ``target`` names
    (``--usage-db``; None: in memory only), the stored ones loaded now."""
    store = _database(target, open_adapter_store, lambda: None)
    book = AdapterBook(models, store, audit)
    book.start()
    return book


def build_rollout_book(models: ServedModels, target: str | None, audit: Audit) -> RolloutBook:
    """``models``' rollouts kept in the database ``target`` names (``--usage-db``; None:
    in memory only), the stored ones served from now on."""
    store = _database(target, open_rollout_store, lambda: None)
    book = RolloutBook(models, store, audit)
    book.start()
    return book
