"""Compile a folder of C++ kernel sources into a torch extension once per machine.

Keyed by content: the build happens in ``<INFER_CACHE_DIR or ~/.cache/infer>/kernels/
<prefix>_<digest>/``, the digest over the sources, the compiler flags (the ISA's ``-m`` flags among
them), torch's version, Python's ABI and the machine's architecture, from a copy of the
sources kept there. Nothing in it names a checkout: every checkout (and every virtual
environment) with the same sources finds the same build. A finished build is marked
(``built.json``) and later loads open its library directly, without torch's
``cpp_extension.load``, whose ninja file records this virtual environment's include paths
and would rebuild for a second checkout's environment.

Builds cannot hang: one process builds a folder at a time, under an ``fcntl.flock`` on
``infer-build.lock`` in it (the kernel releases it when its owner dies, however it dies;
the file holds the owner's pid for the log). The lock's holder removes a torch ``lock``
file left there by a builder that died mid-compile (torch's ``FileBaton`` would wait on it
forever). A process that finds another one building logs what it waits for and gives up
after ``INFER_KERNEL_BUILD_TIMEOUT`` seconds (default 300) with :class:`KernelBuildTimeout`;
the kernels' callers then keep their PyTorch path, as where no compiler exists.
"""

import fcntl
import hashlib
import importlib.util
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import structlog
import torch

from domain.errors import InvalidParameterError

log = structlog.get_logger(__name__)
TIMEOUT_ENV = "INFER_KERNEL_BUILD_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0
LOCK_FILE = "infer-build.lock"
MARKER = "built.json"
TORCH_LOCK = "lock"  # torch.utils.cpp_extension's FileBaton in the build directory
_POLL_S = 0.2
_LOG_EVERY_S = 30.0


class KernelBuildTimeout(RuntimeError):
    """Another process held a kernel build longer than ``INFER_KERNEL_BUILD_TIMEOUT``."""


def kernel_cache_dir() -> Path:
    root = os.environ.get("INFER_CACHE_DIR") or Path.home() / ".cache" / "infer"
    return Path(root) / "kernels"


def build_timeout() -> float:
    """Seconds to wait for another process's build of the same kernels."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if seconds < 0:
        raise InvalidParameterError(TIMEOUT_ENV, f"must be seconds >= 0, got {raw!r}")
    return seconds


def digest(files: list[Path], cflags: list[str]) -> str:
    """Sources, headers, flags, torch's version, Python's ABI and the architecture: any
    change names a new build; where the files lie does not."""
    identity = [torch.__version__, sys.implementation.cache_tag, platform.machine(), *cflags]
    h = hashlib.sha256(" ".join(identity).encode())
    for path in sorted(files):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


def build_extension(
    prefix: str, source_dir: Path, cflags: list[str], *, python_module: bool, what: str
) -> Any:
    """Load (building first where needed) the extension of every ``.cpp`` in ``source_dir``
    (its ``.h`` files included); ``python_module`` False for sources that only register
    ``torch.ops``. Raises where it cannot be built (no compiler, no ninja,
    :class:`KernelBuildTimeout`)."""
    # INFER_KERNEL_CFLAGS: extra compiler flags for every kernel build (e.g. the
    # -fsanitize=address of tests/integration/kernels/test_kernel_asan.py); they name a build apart
    cflags = [*cflags, *os.environ.get("INFER_KERNEL_CFLAGS", "").split()]
    files = sorted(p for p in source_dir.iterdir() if p.suffix in (".cpp", ".h"))
    name = f"{prefix}_{digest(files, cflags)}"
    folder = kernel_cache_dir() / name
    library = folder / f"{name}.so"
    if not _finished(folder, library):
        with build_lock(folder, what):
            if not _finished(folder, library):  # else built while this process waited
                return _build(name, folder, files, cflags, python_module, what)
    return _load(library, name, python_module)


def _finished(folder: Path, library: Path) -> bool:
    return (folder / MARKER).is_file() and library.is_file()


@contextmanager
def build_lock(folder: Path, what: str) -> Iterator[None]:
    """Hold ``folder``'s build lock: wait (logging whom for) while a live process holds
    it, at most :func:`build_timeout` seconds."""
    timeout = build_timeout()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        start = time.monotonic()
        next_log = start
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = time.monotonic() - start
                owner = _owner(path)
                if waited >= timeout:
                    raise KernelBuildTimeout(
                        f"gave up after {waited:.0f} s waiting for process {owner} to build "
                        f"the {what} in {folder} (set {TIMEOUT_ENV} to wait longer)"
                    ) from None
                if time.monotonic() >= next_log:
                    log.info(
                        f"waiting for another process to build the {what}",
                        pid=owner,
                        folder=str(folder),
                        waited_s=round(waited),
                        gives_up_after_s=timeout,
                    )
                    next_log += _LOG_EVERY_S
                time.sleep(_POLL_S)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _owner(lock: Path) -> str:
    try:
        return lock.read_text().strip() or "?"
    except OSError:
        return "?"


def _build(
    name: str, folder: Path, files: list[Path], cflags: list[str], python_module: bool, what: str
) -> Any:
    """Compile and load, holding the build lock: a torch ``lock`` file found now was left by
    a builder that died (every builder holds the lock first)."""
    from torch.utils.cpp_extension import load

    sources = _copy_sources(files, folder / "src")
    stale = folder / TORCH_LOCK
    if stale.exists():
        log.warning("removing the lock of a kernel build that never finished", path=str(stale))
        stale.unlink(missing_ok=True)
    # long work shows progress: a first build takes 30-90 s
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
    seconds = round(time.perf_counter() - start, 1)
    marker = {"torch": torch.__version__, "python": sys.version.split()[0], "cflags": cflags}
    scratch = folder / f".{MARKER}.{os.getpid()}"
    scratch.write_text(json.dumps({**marker, "seconds": seconds}, indent=1))
    os.replace(scratch, folder / MARKER)
    log.info(f"{what} built", seconds=seconds, into=str(folder))
    return module


def _load(library: Path, name: str, python_module: bool) -> Any:
    """A finished build's library, as torch's ``load`` would return it."""
    if not python_module:
        torch.ops.load_library(str(library))
        return str(library)
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
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
