"""What a server serves from a store other servers share (the rollouts, the runtime LoRA
adapters in the records database): the store's version polled, and on a change what it
holds served here."""

import asyncio
from typing import Generic, Protocol, TypeVar

import structlog

log = structlog.get_logger("infer.audit")
T = TypeVar("T")
DEFAULT_WATCH_S = 2.0


class VersionedStore(Protocol[T]):
    def load(self) -> list[T]: ...

    def version(self) -> int:
        """A number that changes whenever the store's content does."""
        ...


class StoreSync(Generic[T]):
    """A mixin: ``store`` (None: nothing shared), ``_seen`` (the version served), and
    ``_serve`` (serve what the store holds) are the subclass's; ``what`` names it in logs."""

    store: VersionedStore[T] | None
    _seen: int | None
    what = "the store's content"

    def _serve(self, stored: list[T]) -> None:
        raise NotImplementedError

    def sync(self) -> bool:
        """Serve the store's content if another server changed it; whether it did."""
        if self.store is None:
            return False
        version = self.store.version()
        if version == self._seen:
            return False
        self._serve(self.store.load())
        self._seen = version
        return True

    async def watch(self, every_s: float = DEFAULT_WATCH_S) -> None:
        """Poll the store for other servers' changes until cancelled."""
        while True:
            await asyncio.sleep(every_s)
            try:
                await asyncio.to_thread(self.sync)
            except Exception as e:
                log.error(f"{self.what} not read from the store", error=str(e))
