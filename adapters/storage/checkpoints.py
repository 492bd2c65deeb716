"""Runs and checkpoints as folders and JSON files under one root directory.

    <root>/runs/<run_id>.json
    <root>/checkpoints/<run_id>/<segment>/<name> -> @versions/<name>/<version>   (symlink)
    <root>/checkpoints/<run_id>/<segment>/@versions/<name>/<version>/  (files + metadata.json)
    <root>/.scratch/<host>-<pid>/<random>/         (checkpoints being written or deleted)
    <root>/url-secret                              (the key download links are signed with)

``<segment>`` is ``weights``, ``sampler_weights`` or ``external_weights``; ``@`` never
appears in a checkpoint name, so the ``@`` entries never clash with one.

Every save is a new version folder: written in scratch with its metadata.json inside, then
renamed into ``@versions``, then published by pointing the name's link at it — a new link
renamed over the old one, one atomic ``rename``. Only then is the old version removed. A
crash at any point leaves the name pointing at a complete checkpoint: the old one, or the
new one (never neither, never half of one). A delete first moves the version away, then
removes the link.

At start, leftovers of a crash are tidied: temporary links and dangling links (a delete
that was cut short) are removed with their versions; a name with versions but no link
(its first save, or the move from the old one-folder layout, was cut short) gets a link
to its newest version; versions no link points at are removed. Each process writes in a
scratch folder of its own, and empties at start those of processes gone from this host
(the replicas of a fleet share one root: one's start never touches another's save).
Checkpoints of the old layout (a plain folder per name) are moved into versions the
same way. Run files are replaced atomically too.
"""

import contextlib
import dataclasses
import io
import json
import os
import secrets
import shutil
import socket
import tarfile
import uuid
from pathlib import Path
from typing import Any

from domain.tinker.values import SEGMENTS, CheckpointKind, CheckpointRecord, LoraSpec, RunRecord

METADATA = "metadata.json"
VERSIONS = "@versions"
TMP_LINK = "@link-"
SECRET = "url-secret"
_SECRET_BYTES = 32


class FileCheckpointStorage:
    def __init__(self, root: Path) -> None:
        self.root = Path(root).expanduser()
        self._runs = self.root / "runs"
        self._checkpoints = self.root / "checkpoints"
        scratch_root = self.root / ".scratch"
        self._scratch = scratch_root / f"{socket.gethostname()}-{os.getpid()}"
        for folder in (self._runs, self._checkpoints, scratch_root):
            folder.mkdir(parents=True, exist_ok=True)
        for folder in scratch_root.iterdir():
            if folder == self._scratch or not _alive_here(folder.name):
                shutil.rmtree(folder, ignore_errors=True)
        self._scratch.mkdir(parents=True)
        self._secret: bytes | None = None
        for kind_dir in self._kind_dirs():
            _recover(kind_dir, self)

    def load_all(self) -> tuple[list[RunRecord], list[CheckpointRecord]]:
        runs = [_run(json.loads(p.read_text())) for p in sorted(self._runs.glob("*.json"))]
        checkpoints = []
        for kind_dir in self._kind_dirs():
            for link in sorted(kind_dir.iterdir()):
                if link.name.startswith("@") or not link.is_symlink():
                    continue
                with contextlib.suppress(FileNotFoundError):
                    record = _checkpoint(json.loads((link / METADATA).read_text()))
                    record.version = Path(os.readlink(link)).name
                    checkpoints.append(record)
        return runs, checkpoints

    def load(self, run_id: str, kind: CheckpointKind, name: str) -> CheckpointRecord | None:
        """One checkpoint's record as it is on disk now (None: there is none)."""
        if any(part in ("", ".", "..") or "/" in part for part in (run_id, name)):
            return None  # not a name this storage writes: never a path out of it
        link = self.folder(run_id, kind, name)
        try:
            record = _checkpoint(json.loads((link / METADATA).read_text()))
        except (FileNotFoundError, NotADirectoryError, ValueError):
            return None
        if link.is_symlink():
            record.version = Path(os.readlink(link)).name
        return record

    def save_run(self, run: RunRecord) -> None:
        _write_json(self._runs / f"{run.run_id}.json", dataclasses.asdict(run))

    def scratch(self) -> Path:
        folder = self._scratch / uuid.uuid4().hex
        folder.mkdir()
        return folder

    def commit(self, scratch: Path, record: CheckpointRecord, *, overwrite: bool) -> None:
        if not record.version:
            record.version = uuid.uuid4().hex
        _write_json(scratch / METADATA, dataclasses.asdict(record))
        link = self.folder(record.run_id, record.kind, record.name)
        link.parent.mkdir(parents=True, exist_ok=True)
        if _is_plain_folder(link):  # the old layout: into versions first
            _migrate(link, self)
        if os.path.lexists(link) and not overwrite:
            raise FileExistsError(link)
        old = _target(link)
        version = link.parent / VERSIONS / record.name / record.version
        version.parent.mkdir(parents=True, exist_ok=True)
        os.replace(scratch, version)
        _point(link, version)  # the atomic switch: before it the old one, after it the new
        if old is not None and old != version:
            self._remove(old)

    def discard(self, scratch: Path) -> None:
        shutil.rmtree(scratch, ignore_errors=True)

    def folder(self, run_id: str, kind: CheckpointKind, name: str) -> Path:
        return self._checkpoints / run_id / SEGMENTS[kind] / name

    def delete(self, record: CheckpointRecord) -> None:
        link = self.folder(record.run_id, record.kind, record.name)
        if _is_plain_folder(link):
            self._remove(link)
            return
        version = _target(link)
        if version is not None:  # the version goes first: a crash leaves a dangling link
            self._remove(version)
        with contextlib.suppress(FileNotFoundError):
            link.unlink()

    def update(self, record: CheckpointRecord) -> None:
        folder = self.folder(record.run_id, record.kind, record.name)
        _write_json(folder / METADATA, dataclasses.asdict(record))

    def files(self, record: CheckpointRecord) -> list[str]:
        folder = self.folder(record.run_id, record.kind, record.name)
        return sorted(f.name for f in folder.iterdir() if f.is_file() and f.name != METADATA)

    def read_file(self, record: CheckpointRecord, name: str) -> bytes | None:
        path = self.folder(record.run_id, record.kind, record.name) / name
        return path.read_bytes() if path.is_file() else None

    def archive(self, record: CheckpointRecord) -> bytes:
        folder = self.folder(record.run_id, record.kind, record.name)
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            for name in self.files(record):
                tar.add(folder / name, arcname=name)
        return buffer.getvalue()

    def secret(self) -> bytes:
        """The link-signing key: random, made once, file mode 0600."""
        if self._secret is None:
            self._secret = _read_or_create_secret(self.root / SECRET)
        return self._secret

    def _remove(self, folder: Path) -> None:
        """Move ``folder`` out of sight (one rename), then delete it."""
        if not folder.exists():
            return
        doomed = self.scratch()
        os.replace(folder, doomed / "doomed")
        shutil.rmtree(doomed, ignore_errors=True)

    def _kind_dirs(self) -> list[Path]:
        return sorted(p for p in self._checkpoints.glob("*/*") if p.is_dir())


def _alive_here(scratch_name: str) -> bool:
    """Whether a scratch folder (``<host>-<pid>``) belongs to a live process, or to
    another host (not ours to judge); a name of another form is stale."""
    host, _, pid = scratch_name.rpartition("-")
    if not host or not pid.isdigit():
        return False
    if host != socket.gethostname():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


# --- versions and links -----------------------------------------------------------------


def _is_plain_folder(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink()


def _target(link: Path) -> Path | None:
    """The version folder ``link`` points at (None: no link)."""
    if not link.is_symlink():
        return None
    return link.parent / os.readlink(link)


def _point(link: Path, version: Path) -> None:
    """Make ``link`` point at ``version`` atomically (a new link renamed over it)."""
    tmp = link.parent / f"{TMP_LINK}{uuid.uuid4().hex}"
    os.symlink(version.relative_to(link.parent), tmp)
    os.replace(tmp, link)


def _migrate(folder: Path, storage: FileCheckpointStorage) -> None:
    """A checkpoint of the old layout (a plain folder) into a version and a link; a crash
    between the two steps is repaired by :func:`_recover` (a version without a link)."""
    version = folder.parent / VERSIONS / folder.name / f"v-{uuid.uuid4().hex}"
    version.parent.mkdir(parents=True, exist_ok=True)
    os.replace(folder, version)
    _point(folder, version)


def _recover(kind_dir: Path, storage: FileCheckpointStorage) -> None:
    """Tidy what a crash left in one ``<run>/<segment>`` folder (see the module doc)."""
    versions_dir = kind_dir / VERSIONS
    for entry in list(kind_dir.iterdir()):
        if entry.name.startswith(TMP_LINK):
            entry.unlink()
        elif entry.name.startswith("@"):
            continue
        elif entry.is_symlink():
            target = _target(entry)
            if target is None or not target.is_dir():  # a delete cut short
                entry.unlink()
                storage._remove(versions_dir / entry.name)
        elif entry.is_dir() and (entry / METADATA).is_file():
            _migrate(entry, storage)
    if not versions_dir.is_dir():
        return
    for name_dir in list(versions_dir.iterdir()):
        if not name_dir.is_dir():
            continue
        link = kind_dir / name_dir.name
        versions = [v for v in name_dir.iterdir() if (v / METADATA).is_file()]
        current = _target(link)
        if current is None and versions:  # a first save or a migration cut short
            current = max(versions, key=_created_at)
            _point(link, current)
        for version in list(name_dir.iterdir()):
            if current is None or version.name != current.name:
                storage._remove(version)
        with contextlib.suppress(OSError):
            name_dir.rmdir()  # only if empty


def _created_at(version: Path) -> float:
    try:
        return float(json.loads((version / METADATA).read_text()).get("created_at", 0.0))
    except (OSError, ValueError):
        return 0.0


def _read_or_create_secret(path: Path) -> bytes:
    with contextlib.suppress(FileNotFoundError):
        existing = path.read_bytes()
        if len(existing) >= _SECRET_BYTES:
            return existing
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, secrets.token_bytes(_SECRET_BYTES))
        os.fsync(fd)
    finally:
        os.close(fd)
    try:  # complete or absent, never a short key; a concurrent start's key wins if first
        os.link(tmp, path)
    except FileExistsError:
        if len(path.read_bytes()) < _SECRET_BYTES:
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path.read_bytes()


# --- files ------------------------------------------------------------------------------


def _write_json(path: Path, value: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    tmp.write_text(json.dumps(value, indent=1, sort_keys=True))
    os.replace(tmp, path)


def _run(d: dict[str, Any]) -> RunRecord:
    return RunRecord(**{**d, "lora": LoraSpec(**d["lora"])})


def _checkpoint(d: dict[str, Any]) -> CheckpointRecord:
    return CheckpointRecord(**{**d, "lora": LoraSpec(**d["lora"])})
