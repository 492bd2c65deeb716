"""LoRA adapters loaded at run time (``POST /v1/load_lora_adapter``), and the port that
keeps them beyond one process's memory (the usage ledger's database): a restart serves
them again, and every server sharing the database serves the same set."""

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class RuntimeAdapter:
    """A PEFT adapter folder (``path``, as the operator gave it) served as ``name``."""

    name: str
    path: str


class AdapterStore(Protocol):
    def load(self) -> list[RuntimeAdapter]:
        """Every stored adapter."""
        ...

    def save(self, adapter: RuntimeAdapter) -> None:
        """Store ``adapter`` (replacing the one of its name)."""
        ...

    def delete(self, name: str) -> None: ...

    def version(self) -> int:
        """A number that changes whenever an adapter is saved or deleted."""
        ...
