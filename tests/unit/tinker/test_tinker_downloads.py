"""Checkpoint downloads (application/tinker/downloads.py over FileCheckpointStorage):
signed links bound to a checkpoint's version, their expiry, and archives."""

import io
import tarfile
import time
from pathlib import Path

import pytest

from adapters.storage.checkpoints import FileCheckpointStorage
from application.tinker.checkpoints import CheckpointStore
from application.tinker.downloads import CheckpointDownloads, LinkRefusedError
from domain.tinker.errors import InvalidTrainingRequest, NotFoundError
from domain.tinker.values import CheckpointRef, LoraSpec, RunRecord
from tests.fakes import ManualClock

RUN = RunRecord("s:train:0", "me", "s", "base", LoraSpec(4), 1.0, 1.0)
REF = CheckpointRef("s:train:0", "training", "ck")


def save(store: CheckpointStore, *, overwrite: bool = False) -> None:
    def write(folder: Path) -> None:
        (folder / "adapter_model.safetensors").write_bytes(b"weights")
        (folder / "optimizer.safetensors").write_bytes(b"adam")
        (folder / "adapter_config.json").write_text("{}")

    store.reserve(RUN, "training", "ck", overwrite=overwrite)
    store.write(RUN, "training", "ck", write, ttl_seconds=None, user_metadata=None,
                overwrite=overwrite)  # fmt: skip


@pytest.fixture
def setup(tmp_path: Path) -> tuple[CheckpointStore, CheckpointDownloads, ManualClock]:
    storage = FileCheckpointStorage(tmp_path)
    store = CheckpointStore(storage)
    store.save_run(RUN)
    save(store)
    clock = ManualClock(time.time())
    return store, CheckpointDownloads(store, storage, ttl_s=60, wall_clock=clock), clock


def test_links_cover_the_weight_files_and_read_back(
    setup: tuple[CheckpointStore, CheckpointDownloads, ManualClock],
) -> None:
    _, downloads, clock = setup
    links = downloads.links("me", REF)
    assert [f.name for f in links.files] == ["adapter_config.json", "adapter_model.safetensors"]
    assert links.expires == int(clock.now) + 60
    signed = {f.name: f.signature for f in links.files}
    got = downloads.read(
        REF, "adapter_model.safetensors", links.expires, signed["adapter_model.safetensors"]
    )
    assert got == b"weights"
    with pytest.raises(NotFoundError):
        downloads.links("someone else", REF)


def test_a_link_is_refused_when_tampered_expired_or_for_another_version(
    setup: tuple[CheckpointStore, CheckpointDownloads, ManualClock],
) -> None:
    store, downloads, clock = setup
    links = downloads.links("me", REF)
    name, sig = links.files[1].name, links.files[1].signature
    with pytest.raises(LinkRefusedError):
        downloads.read(REF, "adapter_config.json", links.expires, sig)  # another file
    with pytest.raises(LinkRefusedError):
        downloads.read(REF, name, links.expires + 1, sig)  # another expiry
    clock.now += 61
    with pytest.raises(LinkRefusedError):
        downloads.read(REF, name, links.expires, sig)
    clock.now -= 61
    save(store, overwrite=True)  # a new version under the same name
    with pytest.raises(LinkRefusedError):
        downloads.read(REF, name, links.expires, sig)
    store.delete("me", REF)
    with pytest.raises(NotFoundError):
        downloads.read(REF, name, links.expires, sig)


def test_a_signed_name_outside_the_checkpoint_is_still_refused(
    setup: tuple[CheckpointStore, CheckpointDownloads, ManualClock],
) -> None:
    _, downloads, _ = setup
    sign = downloads._sign  # a link the server would never make
    record = downloads.links("me", REF).record
    expires = int(time.time()) + 30
    with pytest.raises(InvalidTrainingRequest):
        downloads.read(REF, "../x", expires, sign(record, "../x", expires))
    with pytest.raises(NotFoundError):
        downloads.read(REF, "missing.bin", expires, sign(record, "missing.bin", expires))


def test_the_archive_holds_every_file_but_the_metadata(
    setup: tuple[CheckpointStore, CheckpointDownloads, ManualClock],
) -> None:
    _, downloads, _ = setup
    name, data = downloads.archive("me", REF)
    assert name == "s_train_0-ck.tar"
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        assert sorted(tar.getnames()) == [
            "adapter_config.json",
            "adapter_model.safetensors",
            "optimizer.safetensors",
        ]
