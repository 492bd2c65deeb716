"""What the composition root builds on the storage adapters: access (keys and the quotas'
counters, in Redis or in memory), the idempotent replies' store, and the Tinker service
over its checkpoint folders."""

from collections.abc import Callable, Sequence
from pathlib import Path

from adapters.storage.checkpoints import FileCheckpointStorage
from adapters.storage.idempotency import RedisIdempotencyStore
from adapters.storage.rate_limits import LimitsCounters
from application.access import Access
from application.idempotency import IdempotencyStore, MemoryIdempotencyStore
from application.keys import Keyring
from application.quotas import Quotas
from application.tinker.service import TinkerService
from domain.observer import TrainingObserver
from domain.tenancy import Tenant
from domain.training import SamplingBackend, TinkerLimits, TrainingBackend

DEFAULT_CHECKPOINT_DIR = "~/.cache/infer/tinker"


def build_access(
    keyring: Keyring | None,
    redis_url: str | None,
    *,
    on_refused: Callable[[str, str], None] | None = None,
    on_tenants: Callable[[Sequence[Tenant]], None] | None = None,
) -> Access:
    """Keys and limits (none without a keyring: an open server): the quotas' counters in
    Redis with ``redis_url``, else in memory; ``on_refused``: told of each refusal;
    ``on_tenants``: told the tenants (their weights) whenever the keyring is placed."""
    quotas = None
    if keyring is not None:
        quotas = Quotas(LimitsCounters(redis_url), on_refused=on_refused)
    return Access(keyring, quotas, on_tenants=on_tenants)


def build_idempotency(ttl: float, redis_url: str | None, max_keys: int) -> IdempotencyStore | None:
    """Replies to Idempotency-Key requests: in Redis with ``redis_url``, else in memory
    (``max_keys`` at most); ``ttl`` 0: off."""
    if ttl == 0:
        return None
    if redis_url is not None:
        return RedisIdempotencyStore(redis_url)
    return MemoryIdempotencyStore(max_keys)


def build_tinker(
    enabled: bool,
    checkpoint_dir: str | None,
    limits: TinkerLimits,
    backend: Callable[[], TrainingBackend],
    sampler: Callable[[], SamplingBackend | None],
    observer: TrainingObserver | None = None,
    track_pending: Callable[[Callable[[], int]], None] | None = None,
    id_tag: str = "",
) -> TinkerService | None:
    """The Tinker service when ``enabled`` (None otherwise): training on ``backend()``,
    samples from ``sampler()`` (None: nothing samples here, as LoRA training on the fake
    runner: no Tinker API either), checkpoints as folders under ``checkpoint_dir``;
    ``observer``: told of every operation; ``track_pending``: given the count of pending
    futures (a gauge); ``id_tag``: in its session and future ids (a fleet's replica id).
    The backends are built only when the service is."""
    if not enabled:
        return None
    sampling = sampler()
    if sampling is None:
        return None
    storage = FileCheckpointStorage(Path(checkpoint_dir or DEFAULT_CHECKPOINT_DIR))
    service = TinkerService(
        backend(), sampling, storage, limits=limits, observer=observer, id_tag=id_tag
    )
    if track_pending is not None:
        track_pending(service.pending_futures)
    return service
