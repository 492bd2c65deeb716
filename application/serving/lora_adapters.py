"""AdapterBook: the LoRA adapters loaded at run time (vLLM's ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter``) served by :class:`~application.serving.served_models.
ServedModels` and kept in an :class:`~domain.lora_adapters.AdapterStore` — the usage
ledger's database — so that a restart serves them again and every server sharing the
database serves the same set.

At start the stored adapters are loaded (one whose folder is gone or no longer loads is
logged and skipped: the others serve). Every load and unload through the API is applied,
stored, then audited; each server polls the store's version and applies what another one
changed. A store that cannot be reached is logged; the adapters in memory keep serving.
"""

import threading
from pathlib import Path

import structlog

from application.access.audit import Audit
from application.serving.served_models import LoraModule, ModelEntry, ServedModels
from application.serving.store_sync import StoreSync
from domain.errors import InferError
from domain.lora_adapters import AdapterStore, RuntimeAdapter

log = structlog.get_logger("infer.audit")


class AdapterBook(StoreSync[RuntimeAdapter]):
    what = "runtime LoRA adapters"
    store: AdapterStore | None

    def __init__(
        self, models: ServedModels, store: AdapterStore | None = None, audit: Audit | None = None
    ) -> None:
        self.models, self.store, self.audit = models, store, audit or Audit()
        self._served: dict[str, str] = {}  # name -> path: the runtime ones served here
        self._seen: int | None = None
        self._lock = threading.Lock()  # loads, unloads and syncs one at a time

    def start(self) -> None:
        """Load the stored adapters."""
        if self.store is None:
            return
        try:
            self._seen = self.store.version()
            self._serve(self.store.load())
        except Exception as e:
            log.error("runtime LoRA adapters not read from the store", error=str(e))

    def adapters(self) -> list[RuntimeAdapter]:
        """The adapters loaded at run time and served here, by name."""
        with self._lock:
            return [RuntimeAdapter(n, p) for n, p in sorted(self._served.items())]

    def load(self, name: str, path: str, actor: str | None = None) -> ModelEntry:
        """Serve the folder ``path`` as the model ``name`` (checked and loaded first: an
        ``InvalidParameterError`` naming the problem), store it, audit it (by ``actor``).
        Blocking: call it off the event loop."""
        with self._lock:
            entry = self.models.add_lora(LoraModule(name, Path(path).expanduser()))
            self._served[name] = path
            if self.store is not None:
                try:
                    self.store.save(RuntimeAdapter(name, path))
                    self._seen = self.store.version()
                except Exception:
                    self.models.remove_lora(name)  # not kept: not served either
                    del self._served[name]
                    raise
        self.audit.record("lora adapter loaded", actor=actor, subject=f"model:{name}", path=path)
        return entry

    def unload(self, name: str, actor: str | None = None) -> ModelEntry:
        """Stop serving the adapter ``name`` (``ModelNotFoundError``: none of that name;
        requests running on it finish), remove it from the store, audit it."""
        with self._lock:
            entry = self.models.remove_lora(name)
            self._served.pop(name, None)
            if self.store is not None:
                self.store.delete(name)
                self._seen = self.store.version()
        self.audit.record("lora adapter unloaded", actor=actor, subject=f"model:{name}")
        return entry

    # --- other servers' changes (StoreSync: sync, watch) ---------------------------------

    def _serve(self, stored: list[RuntimeAdapter]) -> None:
        wanted = {a.name: a.path for a in stored}
        with self._lock:
            for name in [n for n, p in self._served.items() if wanted.get(n) != p]:
                try:
                    self.models.remove_lora(name)
                except InferError as e:  # a rollout still sends requests to it
                    log.warning("a stored unload is not applied here", model=name, error=str(e))
                    continue
                del self._served[name]
            for name, path in wanted.items():
                if name in self._served:
                    continue
                try:
                    self.models.add_lora(LoraModule(name, Path(path).expanduser()))
                except InferError as e:  # its folder gone, another base model, a name taken
                    log.error("a stored LoRA adapter is not served", model=name, error=str(e))
                    continue
                self._served[name] = path
