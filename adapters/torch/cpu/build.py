"""Compile a folder of C++ kernel sources into a torch extension once per machine.

torch's ``cpp_extension.load`` keys its cache by the extension's name and records the
sources' absolute paths in its build file: two checkouts at different paths that share the
name rebuild over each other on every start (~30 s each). Here the name carries a digest of
the sources, the flags and the torch version, and the build happens in
``<INFER_CACHE_DIR or ~/.cache/infer>/kernels/<name>/`` from a copy of the sources kept
there: every checkout with the same sources finds the same build, wherever it lives.
"""

import hashlib
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import structlog
import torch

log = structlog.get_logger(__name__)


def kernel_cache_dir() -> Path:
    root = os.environ.get("INFER_CACHE_DIR") or Path.home() / ".cache" / "infer"
    return Path(root) / "kernels"


def digest(files: list[Path], cflags: list[str]) -> str:
    """Sources, headers, flags and torch's version: any change names a new build."""
    h = hashlib.sha256(" ".join([torch.__version__, *cflags]).encode())
    for path in sorted(files):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


def build_extension(
    prefix: str, source_dir: Path, cflags: list[str], *, python_module: bool, what: str
) -> Any:
    """Load (building first where needed) the extension of every ``.cpp`` in ``source_dir``
    (its ``.h`` files included); ``python_module`` False for sources that only register
    ``torch.ops``. Raises where it cannot be built (no compiler, no ninja)."""
    from torch.utils.cpp_extension import load

    # INFER_KERNEL_CFLAGS: extra compiler flags for every kernel build (e.g. the
    # -fsanitize=address of tests/integration/test_kernel_asan.py); they name a build apart
    cflags = [*cflags, *os.environ.get("INFER_KERNEL_CFLAGS", "").split()]
    files = sorted(p for p in source_dir.iterdir() if p.suffix in (".cpp", ".h"))
    name = f"{prefix}_{digest(files, cflags)}"
    folder = kernel_cache_dir() / name
    sources = _copy_sources(files, folder / "src")
    built = (folder / f"{name}.so").exists()
    if not built:  # long work shows progress: a first build takes 30-90 s
        log.info(f"compiling the {what} for this CPU, once", flags=cflags, into=str(folder))
    start = time.perf_counter()
    module = load(
        name=name,
        sources=[str(path) for path in sources if path.suffix == ".cpp"],
        extra_cflags=cflags,
        extra_ldflags=["-fopenmp"],
        build_directory=str(folder),
        is_python_module=python_module,
    )
    if not built:
        log.info(f"{what} built", seconds=round(time.perf_counter() - start, 1))
    return module


def _copy_sources(files: list[Path], into: Path) -> list[Path]:
    """The sources under ``into``, copied once (the digest names their content): a copy
    made again would look newer to ninja and rebuild."""
    if not into.is_dir():
        into.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=".src.", dir=into.parent))
        for path in files:
            shutil.copy2(path, scratch / path.name)
        try:
            os.replace(scratch, into)
        except OSError:  # another process copied them first
            shutil.rmtree(scratch, ignore_errors=True)
    return [into / path.name for path in files]
