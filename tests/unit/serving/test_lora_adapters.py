"""Runtime LoRA adapters (fake adapters, the SQLite store): two servers sharing the records
database serve the same set, a restart serves it again, a stored folder that no longer
loads is skipped, and an unload while requests run leaves them their pin."""

from pathlib import Path

import pytest

from adapters.storage.lora_sql import open_adapter_store
from application.serving.lora_adapters import AdapterBook
from application.serving.served_models import ServedModels
from domain.errors import InvalidParameterError, ModelNotFoundError
from tests.unit.serving.test_served_models import FakeAdapters, peft_folder


def server(db: str) -> tuple[AdapterBook, FakeAdapters]:
    adapters = FakeAdapters()
    book = AdapterBook(ServedModels(["base"], "w", adapters=adapters), open_adapter_store(db))
    book.start()
    return book, adapters


def test_two_servers_sharing_the_store_serve_the_same_adapters(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'records.db'}"
    a, _ = server(db)
    b, b_adapters = server(db)
    folder = peft_folder(tmp_path, "sql")
    a.load("sql", str(folder), actor="ops")
    assert a.models.resolve("sql").parent == "base"
    with pytest.raises(ModelNotFoundError):
        b.models.resolve("sql")
    assert b.sync() and not b.sync()  # applied once
    assert b.models.resolve("sql").adapter_id in b_adapters.loaded
    restarted, _ = server(db)
    assert [x.name for x in restarted.adapters()] == ["sql"]
    b.unload("sql")
    assert a.sync()
    with pytest.raises(ModelNotFoundError):
        a.models.resolve("sql")


def test_a_stored_folder_that_no_longer_loads_is_skipped(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'records.db'}"
    book, _ = server(db)
    book.load("good", str(peft_folder(tmp_path, "good")))
    book.load("bad", str(peft_folder(tmp_path, "bad")))
    (tmp_path / "bad" / "adapter_model.safetensors").write_text("not lora")
    restarted, _ = server(db)
    assert [x.name for x in restarted.adapters()] == ["good"]


def test_an_unload_keeps_the_weights_for_the_requests_running_on_them(tmp_path: Path) -> None:
    adapters = FakeAdapters()
    book = AdapterBook(ServedModels(["base"], "w", adapters=adapters))
    entry = book.load("sql", str(peft_folder(tmp_path, "sql")))
    with book.models.use(entry):  # a request running on it
        book.unload("sql")  # the weights go at the last unpin (test_lora_serving.py)
        assert adapters.pins[entry.adapter_id] == 1  # the request's pin, the server's gone
        with pytest.raises(ModelNotFoundError):
            book.models.resolve("sql")
    with pytest.raises(ModelNotFoundError):
        book.unload("sql")
    with pytest.raises(InvalidParameterError, match="is served"):
        book.load("base", str(tmp_path / "sql"))
