"""CheckpointStore: the catalog of saved checkpoints over the durable CheckpointStorage port.

The catalog is read from storage at start (checkpoints survive restarts) and kept in
memory; every change goes to storage first. Checkpoints belong to the API key (owner) that
made them: another key gets ``NotFoundError``, as if they did not exist.
"""

import time
import uuid
from collections.abc import Callable
from pathlib import Path

import structlog

from domain.tinker.errors import InvalidTrainingRequest, NotFoundError
from domain.tinker.ports import CheckpointStorage
from domain.tinker.values import (
    CheckpointKind,
    CheckpointRecord,
    CheckpointRef,
    RunRecord,
    checkpoint_id,
)

log = structlog.get_logger(__name__)
audit = structlog.get_logger("infer.audit")


class CheckpointStore:
    def __init__(
        self, storage: CheckpointStorage, *, wall_clock: Callable[[], float] = time.time
    ) -> None:
        self._storage = storage
        self._clock = wall_clock
        runs, checkpoints = storage.load_all()
        self.runs: dict[str, RunRecord] = {r.run_id: r for r in runs}
        self._checkpoints: dict[tuple[str, str], CheckpointRecord] = {
            (c.run_id, c.checkpoint_id): c for c in checkpoints
        }
        self._reserved: set[tuple[str, str]] = set()

    # --- runs -------------------------------------------------------------------------

    def save_run(self, run: RunRecord) -> None:
        self._storage.save_run(run)
        self.runs[run.run_id] = run

    def run(self, owner: str, run_id: str) -> RunRecord:
        run = self.runs.get(run_id)
        if run is None or run.owner != owner:
            raise NotFoundError(f"no training run {run_id!r}")
        return run

    def runs_of(self, owner: str) -> list[RunRecord]:
        return sorted(
            (r for r in self.runs.values() if r.owner == owner), key=lambda r: r.created_at
        )

    # --- checkpoints ------------------------------------------------------------------

    def lookup(self, ref: CheckpointRef) -> CheckpointRecord | None:
        """The checkpoint at ``ref`` whoever owns it (for links signed by the server)."""
        return self._stored(ref)

    def _stored(self, ref: CheckpointRef) -> CheckpointRecord | None:
        """The checkpoint at ``ref``: as this process knows it, else as the storage has it
        now — another process sharing the storage (a fleet's replica) may have saved it."""
        key = (ref.run_id, checkpoint_id(ref.kind, ref.name))
        record = self._checkpoints.get(key)
        if record is None:
            record = self._storage.load(ref.run_id, ref.kind, ref.name)
            if record is not None:
                self._checkpoints[key] = record
        return record

    def get(self, owner: str, ref: CheckpointRef) -> CheckpointRecord:
        record = self._stored(ref)
        if record is None or (record.owner != owner and not record.public):
            raise NotFoundError(
                f"no checkpoint tinker://{ref.run_id}/{checkpoint_id(ref.kind, ref.name)}"
            )
        return record

    def resolve(self, owner: str, path: str) -> tuple[CheckpointRecord, Path]:
        """The checkpoint at a ``tinker://`` path and its folder."""
        record = self.get(owner, CheckpointRef.parse(path))
        return record, self._storage.folder(record.run_id, record.kind, record.name)

    def folder(self, record: CheckpointRecord) -> Path:
        return self._storage.folder(record.run_id, record.kind, record.name)

    def find(self, owner: str, run_id: str | None = None) -> list[CheckpointRecord]:
        return sorted(
            (
                c
                for c in self._checkpoints.values()
                if c.owner == owner and (run_id is None or c.run_id == run_id)
            ),
            key=lambda c: c.created_at,
        )

    def latest(self, run_id: str, kind: CheckpointKind) -> CheckpointRecord | None:
        found = [c for c in self._checkpoints.values() if c.run_id == run_id and c.kind == kind]
        return max(found, key=lambda c: c.created_at) if found else None

    def reserve(self, run: RunRecord, kind: CheckpointKind, name: str, *, overwrite: bool) -> None:
        """Claim a name before writing (two saves of one name cannot race)."""
        key = (run.run_id, checkpoint_id(kind, name))
        if key in self._reserved or (key in self._checkpoints and not overwrite):
            raise InvalidTrainingRequest(
                f"checkpoint tinker://{run.run_id}/{key[1]} exists (save with overwrite=True "
                "or choose another name)"
            )
        self._reserved.add(key)

    def release_reservation(self, run: RunRecord, kind: CheckpointKind, name: str) -> None:
        self._reserved.discard((run.run_id, checkpoint_id(kind, name)))

    def write(
        self,
        run: RunRecord,
        kind: CheckpointKind,
        name: str,
        writer: Callable[[Path], None],
        *,
        ttl_seconds: int | None,
        user_metadata: dict[str, str] | None,
        overwrite: bool,
    ) -> CheckpointRecord:
        """Write a reserved checkpoint with ``writer(folder)`` and publish it atomically.

        Blocking (a worker thread calls it); the name is released whatever happens.
        """
        key = (run.run_id, checkpoint_id(kind, name))
        scratch = self._storage.scratch()
        try:
            writer(scratch)
            now = self._clock()
            record = CheckpointRecord(
                run_id=run.run_id,
                kind=kind,
                name=name,
                owner=run.owner,
                base_model=run.base_model,
                lora=run.lora,
                created_at=now,
                size_bytes=sum(f.stat().st_size for f in scratch.rglob("*") if f.is_file()),
                user_metadata=dict(user_metadata or {}),
                expires_at=now + ttl_seconds if ttl_seconds else None,
                version=uuid.uuid4().hex,
                optimizer=run.optimizer,
            )
            self._storage.commit(scratch, record, overwrite=overwrite)
        except BaseException:
            self._storage.discard(scratch)
            raise
        finally:
            self._reserved.discard(key)
        self._checkpoints[key] = record
        log.info("tinker_checkpoint_saved", path=record.tinker_path, bytes=record.size_bytes)
        return record

    def delete(self, owner: str, ref: CheckpointRef) -> None:
        record = self.get(owner, ref)
        if record.owner != owner:  # a public checkpoint of another key
            raise NotFoundError(f"no checkpoint {record.tinker_path}")
        self._storage.delete(record)
        del self._checkpoints[(record.run_id, record.checkpoint_id)]
        audit.info("tinker checkpoint deleted", tenant_id=owner, path=record.tinker_path)

    def set_ttl(self, owner: str, ref: CheckpointRef, ttl_seconds: int | None) -> None:
        """``ttl_seconds`` from now (None: kept until deleted)."""
        if ttl_seconds is not None and ttl_seconds <= 0:
            raise InvalidTrainingRequest("ttl_seconds must be positive (or null for none)")
        record = self._own(owner, ref)
        record.expires_at = self._clock() + ttl_seconds if ttl_seconds else None
        self._storage.update(record)

    def set_public(self, owner: str, ref: CheckpointRef, public: bool) -> None:
        record = self._own(owner, ref)
        record.public = public
        self._storage.update(record)
        audit.info(
            "tinker checkpoint published" if public else "tinker checkpoint unpublished",
            tenant_id=owner,
            path=record.tinker_path,
        )

    def delete_expired(self) -> list[CheckpointRecord]:
        now = self._clock()
        expired = [
            c
            for c in self._checkpoints.values()
            if c.expires_at is not None and c.expires_at <= now
        ]
        for record in expired:
            self._storage.delete(record)
            del self._checkpoints[(record.run_id, record.checkpoint_id)]
            log.info("tinker_checkpoint_expired", path=record.tinker_path)
        return expired

    def _own(self, owner: str, ref: CheckpointRef) -> CheckpointRecord:
        record = self.get(owner, ref)
        if record.owner != owner:
            raise NotFoundError(f"no checkpoint {record.tinker_path}")
        return record
