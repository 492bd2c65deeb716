"""Runs and checkpoints as folders and JSON files under one root directory.

    <root>/runs/<run_id>.json
    <root>/checkpoints/<run_id>/weights/<name>/          (files + metadata.json)
    <root>/checkpoints/<run_id>/sampler_weights/<name>/   (and external_weights/<name>/)
    <root>/.scratch/<random>/                            (checkpoints being written)

A checkpoint is written into a scratch folder and renamed into place with its
metadata.json already inside (one ``rename``: readers never see half a checkpoint); run
files are replaced the same way. Leftover scratch folders of a crashed server are removed
at start.
"""

import dataclasses
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from domain.training import SEGMENTS, CheckpointKind, CheckpointRecord, LoraSpec, RunRecord

METADATA = "metadata.json"


class FileCheckpointStorage:
    def __init__(self, root: Path) -> None:
        self.root = Path(root).expanduser()
        self._runs = self.root / "runs"
        self._checkpoints = self.root / "checkpoints"
        self._scratch = self.root / ".scratch"
        for folder in (self._runs, self._checkpoints):
            folder.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self._scratch, ignore_errors=True)
        self._scratch.mkdir(parents=True)

    def load_all(self) -> tuple[list[RunRecord], list[CheckpointRecord]]:
        runs = [_run(json.loads(p.read_text())) for p in sorted(self._runs.glob("*.json"))]
        checkpoints = [
            _checkpoint(json.loads(p.read_text()))
            for p in sorted(self._checkpoints.glob(f"*/*/*/{METADATA}"))
        ]
        return runs, checkpoints

    def save_run(self, run: RunRecord) -> None:
        _write_json(self._runs / f"{run.run_id}.json", dataclasses.asdict(run))

    def scratch(self) -> Path:
        folder = self._scratch / uuid.uuid4().hex
        folder.mkdir()
        return folder

    def commit(self, scratch: Path, record: CheckpointRecord, *, overwrite: bool) -> None:
        _write_json(scratch / METADATA, dataclasses.asdict(record))
        final = self.folder(record.run_id, record.kind, record.name)
        final.parent.mkdir(parents=True, exist_ok=True)
        if final.exists():
            if not overwrite:
                raise FileExistsError(final)
            old = self.scratch()
            os.replace(final, old / "old")
            os.replace(scratch, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(scratch, final)

    def discard(self, scratch: Path) -> None:
        shutil.rmtree(scratch, ignore_errors=True)

    def folder(self, run_id: str, kind: CheckpointKind, name: str) -> Path:
        return self._checkpoints / run_id / SEGMENTS[kind] / name

    def delete(self, record: CheckpointRecord) -> None:
        folder = self.folder(record.run_id, record.kind, record.name)
        if folder.exists():  # rename first: a reader never sees a half-deleted checkpoint
            doomed = self.scratch()
            os.replace(folder, doomed / "doomed")
            shutil.rmtree(doomed, ignore_errors=True)

    def update(self, record: CheckpointRecord) -> None:
        folder = self.folder(record.run_id, record.kind, record.name)
        _write_json(folder / METADATA, dataclasses.asdict(record))


def _write_json(path: Path, value: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    tmp.write_text(json.dumps(value, indent=1, sort_keys=True))
    os.replace(tmp, path)


def _run(d: dict[str, Any]) -> RunRecord:
    return RunRecord(**{**d, "lora": LoraSpec(**d["lora"])})


def _checkpoint(d: dict[str, Any]) -> CheckpointRecord:
    return CheckpointRecord(**{**d, "lora": LoraSpec(**d["lora"])})
