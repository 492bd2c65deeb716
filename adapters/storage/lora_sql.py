"""The :class:`~domain.lora_adapters.AdapterStore` port in SQL, in the usage ledger's
database (``--usage-db``: SQLite or PostgreSQL): table ``infer_lora_adapters`` (a row per
adapter loaded at run time: its folder) and ``infer_lora_adapters_version`` (one row,
bumped in the same transaction as every change, which the servers poll)."""

from adapters.storage.sql import TableStore, dialect_for
from domain.lora_adapters import RuntimeAdapter


def open_adapter_store(target: str) -> TableStore[RuntimeAdapter]:
    """The runtime adapters kept in the database ``target`` names (``--usage-db``'s)."""
    return TableStore(
        dialect_for(target),
        "infer_lora_adapters",
        "path",
        lambda adapter: adapter.name,
        lambda adapter: adapter.path,
        RuntimeAdapter,
    )
