"""Issue 11 §6: kill -9 at every step of a checkpoint overwrite (and of a delete, and of the
move from the old one-folder layout) never leaves a checkpoint unlisted after a restart,
nor listed with half its files.

A child process commits through FileCheckpointStorage with ``os``'s file operations
trapped: the k-th one SIGKILLs the process before it happens. The parent restarts the
storage on the same folder after each kill and lists what is there.
"""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from adapters.storage.checkpoints import METADATA, FileCheckpointStorage
from application.tinker.checkpoints import CheckpointStore
from domain.tinker.values import CheckpointRecord, LoraSpec

ROOT = Path(__file__).resolve().parents[2]
CHILD = """
import os, shutil, signal, sys, time
from pathlib import Path
from adapters.storage.checkpoints import FileCheckpointStorage
from domain.tinker.values import CheckpointRecord, LoraSpec

root, action, kill_at, content = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
storage = FileCheckpointStorage(root)
calls = [0]

def trap(fn):
    def wrapped(*args, **kwargs):
        calls[0] += 1
        if calls[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return fn(*args, **kwargs)
    return wrapped

for name in ("replace", "rename", "symlink", "unlink", "rmdir", "link", "mkdir"):
    setattr(os, name, trap(getattr(os, name)))
shutil.rmtree = trap(shutil.rmtree)
record = CheckpointRecord(
    run_id="run", kind="training", name="ck", owner="me", base_model="base",
    lora=LoraSpec(4), created_at=time.time(), size_bytes=2,
)
if action == "save":
    scratch = storage.scratch()
    (scratch / "a.bin").write_text(content)
    (scratch / "b.bin").write_text(content)
    storage.commit(scratch, record, overwrite=True)
else:
    storage.delete(record)
"""


def _child(root: Path, action: str, kill_at: int, content: str) -> int:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(root), action, str(kill_at), content],
        cwd=ROOT,
        env=env,
        timeout=60,
        capture_output=True,
        text=True,
    )
    assert done.returncode in (0, -signal.SIGKILL), done.stderr
    return done.returncode


def _listed(root: Path) -> dict[str, str]:
    """What a restarted server lists: checkpoint id -> its files' (equal) content."""
    store = CheckpointStore(FileCheckpointStorage(root))
    listed = {}
    for record in store.find("me"):
        folder = store.folder(record)
        a, b = (folder / "a.bin").read_text(), (folder / "b.bin").read_text()
        assert a == b, "half a checkpoint"  # both files of the same save
        meta = json.loads((folder / METADATA).read_text())
        assert meta["name"] == record.name
        listed[record.checkpoint_id] = a
    return listed


def _save(root: Path, content: str) -> None:
    storage = FileCheckpointStorage(root)
    scratch = storage.scratch()
    for name in ("a.bin", "b.bin"):
        (scratch / name).write_text(content)
    record = CheckpointRecord("run", "training", "ck", "me", "base", LoraSpec(4), time.time(), 2)
    storage.commit(scratch, record, overwrite=True)


def test_kill_9_at_every_step_of_an_overwrite_keeps_the_old_or_the_new(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    _save(root, "v0")
    current = "v0"
    for kill_at in range(1, 40):  # bounded: the last run completes untrapped
        new = f"v{kill_at}"
        code = _child(root, "save", kill_at, new)
        listed = _listed(root)
        assert set(listed) == {"weights/ck"}, (kill_at, listed)  # never unlisted
        assert listed["weights/ck"] in (current, new), (kill_at, listed)
        current = listed["weights/ck"]
        if code == 0:
            assert current == new
            break
    else:
        raise AssertionError("the save never finished untrapped")
    leftovers = list((root / "checkpoints/run/weights/@versions/ck").iterdir())
    assert len(leftovers) == 1  # old versions are tidied at restart


def test_kill_9_at_every_step_of_a_delete_never_leaves_half_a_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    for kill_at in range(1, 20):
        _save(root, "v")
        code = _child(root, "delete", kill_at, "")
        assert _listed(root) in ({}, {"weights/ck": "v"}), kill_at
        if code == 0:
            assert _listed(root) == {}
            break
    else:
        raise AssertionError("the delete never finished untrapped")


def test_checkpoints_of_the_old_layout_are_listed_and_overwritten_safely(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    for kill_at in range(1, 40):
        shutil.rmtree(root, ignore_errors=True)
        old = root / "checkpoints/run/weights/ck"  # a plain folder per checkpoint
        old.mkdir(parents=True)
        for name in ("a.bin", "b.bin"):
            (old / name).write_text("legacy")
        record = CheckpointRecord("run", "training", "ck", "me", "base", LoraSpec(4), 1.0, 2)
        (old / METADATA).write_text(json.dumps(dataclasses.asdict(record)))
        code = _child(root, "save", kill_at, "new")
        assert _listed(root) in ({"weights/ck": "legacy"}, {"weights/ck": "new"}), kill_at
        if code == 0:
            assert _listed(root) == {"weights/ck": "new"}
            break
    else:
        raise AssertionError("the save never finished untrapped")
