"""Where converted models live, and how a conversion lands there atomically."""

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# Part of every cache key: bump it when the converters' output changes, so that folders
# written by an older converter are redone instead of reused.
LAYOUT_VERSION = 3  # 3: GGUF K-quants kept as super-blocks (gguf_quant.py)


def default_cache_dir() -> Path:
    return Path(os.environ.get("INFER_CACHE_DIR") or Path.home() / ".cache" / "infer")


def model_folder(cache_dir: Path, stem: str, *identity: object) -> Path:
    """``cache_dir/models/<stem>-<hash of identity>``: a new identity gets a new folder."""
    text = "|".join(str(part) for part in (LAYOUT_VERSION, *identity))
    return cache_dir / "models" / f"{stem}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def file_identity(path: Path) -> tuple[str, int, int]:
    """Path, size and mtime: hashing the content would cost seconds on every cached load."""
    stat = path.stat()
    return str(path.resolve()), stat.st_size, stat.st_mtime_ns


@contextmanager
def building(final: Path) -> Iterator[Path]:
    """Yield an empty folder that becomes ``final`` only if the body succeeds.

    The work happens in a hidden sibling folder that is renamed in one step, so an
    interrupted conversion never leaves a folder that looks complete.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        yield scratch
        _publish(scratch, final)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _publish(scratch: Path, final: Path) -> None:
    try:
        os.replace(scratch, final)
    except OSError:
        # Another process published the same conversion first; theirs is as good as ours.
        if not final.is_dir():
            raise
