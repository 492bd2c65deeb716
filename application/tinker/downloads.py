"""Checkpoint downloads: signed links to a checkpoint's files, and its files as one archive.

A link is signed (HMAC-SHA256) with a key kept with the checkpoints, so links outlive a
restart, over the checkpoint's version, so a link never serves another save under the
same name (after a delete and a save, or an overwrite, old links are refused). A link
needs no API key: the signature is the permission.
"""

import hashlib
import hmac
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from application.tinker.checkpoints import CheckpointStore
from domain.tinker.checks import check_checkpoint_name
from domain.tinker.errors import NotFoundError, TrainingError
from domain.tinker.ports import CheckpointStorage
from domain.tinker.values import CheckpointRecord, CheckpointRef, checkpoint_id

URL_TTL_S = 3600
# Files never offered as links: the catalog's own, and the optimizer state (not weights).
UNLISTED = frozenset({"metadata.json", "optimizer.safetensors"})


class CheckpointFiles(Protocol):
    """Reading a checkpoint's files (the storage adapter implements it with
    :class:`~domain.tinker.ports.CheckpointStorage`)."""

    def files(self, record: CheckpointRecord) -> list[str]:
        """The names of the files ``record`` holds, sorted (its metadata file left out)."""
        ...

    def read_file(self, record: CheckpointRecord, name: str) -> bytes | None:
        """One file's bytes; None when ``record`` has no such file."""
        ...

    def archive(self, record: CheckpointRecord) -> bytes:
        """The checkpoint's files (its metadata file left out) as one uncompressed tar."""
        ...


class DownloadableStorage(CheckpointStorage, CheckpointFiles, Protocol):
    """The storage a :class:`~application.tinker.service.TinkerService` needs."""


class LinkRefusedError(TrainingError):
    """A download link's signature does not match, or the link expired (HTTP 403)."""


@dataclass(frozen=True, slots=True)
class SignedFile:
    name: str
    signature: str


@dataclass(frozen=True, slots=True)
class DownloadLinks:
    """What a client needs to fetch a checkpoint's files without its API key."""

    record: CheckpointRecord
    expires: int  # unix time
    files: list[SignedFile]


class CheckpointDownloads:
    def __init__(
        self,
        checkpoints: CheckpointStore,
        storage: DownloadableStorage,
        *,
        ttl_s: int = URL_TTL_S,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._checkpoints = checkpoints
        self._storage = storage
        self._ttl_s = ttl_s
        self._clock = wall_clock

    def links(self, owner: str, ref: CheckpointRef) -> DownloadLinks:
        """Signed links to the checkpoint's weight files, valid for ``ttl_s``."""
        record = self._checkpoints.get(owner, ref)
        expires = int(self._clock()) + self._ttl_s
        files = [
            SignedFile(name, self._sign(record, name, expires))
            for name in self._storage.files(record)
            if name not in UNLISTED
        ]
        return DownloadLinks(record, expires, files)

    def read(self, ref: CheckpointRef, name: str, expires: int, signature: str) -> bytes:
        """The file a signed link names (whoever owns the checkpoint: the server signed it)."""
        cid = checkpoint_id(ref.kind, ref.name)
        record = self._checkpoints.lookup(ref)
        if record is None:
            raise NotFoundError(f"no checkpoint {cid} (deleted?)")
        expected = self._sign(record, name, expires)
        if not hmac.compare_digest(signature, expected) or expires < self._clock():
            raise LinkRefusedError("download link invalid or expired: ask for new urls")
        check_checkpoint_name(name)
        data = self._storage.read_file(record, name)
        if data is None:
            raise NotFoundError(f"no file {name!r} in checkpoint {cid}")
        return data

    def archive(self, owner: str, ref: CheckpointRef) -> tuple[str, bytes]:
        """A file name for the archive, and the archive."""
        record = self._checkpoints.get(owner, ref)
        name = f"{record.run_id}-{record.name}.tar".replace(":", "_")
        return name, self._storage.archive(record)

    def _sign(self, record: CheckpointRecord, name: str, expires: int) -> str:
        ident = (record.run_id, record.checkpoint_id, record.version, name, str(expires))
        message = "\n".join(ident).encode()
        return hmac.new(self._storage.secret(), message, hashlib.sha256).hexdigest()
