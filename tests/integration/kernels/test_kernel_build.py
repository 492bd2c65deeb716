"""Kernel builds (adapters/torch/cpu/build.py) are keyed by content, not by checkout path: a
second checkout with the same sources reuses the first one's build. They cannot hang: a
build killed while compiling leaves torch's lock file, which the next build removes; a live
builder is waited for, with a log line, for a bounded time."""

import fcntl
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.utils.cpp_extension

from adapters.torch.cpu import portable
from adapters.torch.cpu.build import (
    LOCK_FILE,
    MARKER,
    TIMEOUT_ENV,
    TORCH_LOCK,
    KernelBuildTimeout,
    build_extension,
    digest,
    kernel_cache_dir,
)
from tests.support.json_logs import json_log_stream

ROOT = Path(__file__).resolve().parents[3]
CXX = shutil.which(os.environ.get("CXX", "c++"))
needs_compiler = pytest.mark.skipif(CXX is None, reason="no C++ compiler")
# A kernel folder that compiles in a moment: the build's machinery is under test, not C++.
TINY = 'extern "C" int infer_test_answer() { return 42; }\n'
FLAGS = ["-O1"]
BUILD = (
    "import sys; from pathlib import Path; from adapters.torch.cpu.build import build_extension; "
    "build_extension('infer_test_tiny', Path(sys.argv[1]), ['-O1'], python_module=False, "
    "what='test kernels')"
)


def _tiny_checkout(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "answer.cpp").write_text(TINY)
    return folder


def _tiny_folder(sources: Path) -> Path:
    return kernel_cache_dir() / f"infer_test_tiny_{digest(sorted(sources.iterdir()), FLAGS)}"


@pytest.fixture
def log_stream() -> Iterator[io.StringIO]:
    """The structured log as JSON lines."""
    with json_log_stream() as stream:
        yield stream


def _env(cache: Path) -> dict[str, str]:
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**os.environ, "INFER_CACHE_DIR": str(cache), "PATH": path}


def test_the_digest_follows_content_and_flags_not_paths(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for folder in (a, b):
        shutil.copytree(portable._SOURCES, folder)
    files_a, files_b = sorted(a.iterdir()), sorted(b.iterdir())
    assert digest(files_a, ["-O3"]) == digest(files_b, ["-O3"])
    assert digest(files_a, ["-O3"]) != digest(files_a, ["-O2"])
    (b / "paged_attention.cpp").write_text("// another kernel\n")
    assert digest(files_a, ["-O3"]) != digest(files_b, ["-O3"])


def test_a_second_checkout_reuses_the_build(tmp_path: Path) -> None:
    if portable.portable_kernels() is None:
        pytest.skip("no C++ toolchain here")
    flags = ["-O3", "-fopenmp", *portable._isa_flags()]
    files = sorted(p for p in portable._SOURCES.iterdir() if p.suffix in (".cpp", ".h"))
    folder = kernel_cache_dir() / f"infer_cpu_portable_{digest(files, flags)}"
    library = folder / f"{folder.name}.so"
    built = library.stat().st_mtime_ns
    elsewhere = tmp_path / "another-checkout" / "portable"
    shutil.copytree(portable._SOURCES, elsewhere)
    build_extension("infer_cpu_portable", elsewhere, flags, python_module=False, what="test")
    assert library.stat().st_mtime_ns == built  # not rebuilt
    assert sorted(p.name for p in (folder / "src").iterdir()) == [p.name for p in files]


@pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None
    or os.environ.get("INFER_CPU_KERNELS", "1") == "0",
    reason="no C++ compiler (or the kernels are turned off)",
)
def test_the_portable_kernels_build_where_a_compiler_exists() -> None:
    """A compile error must fail here, not turn every kernel test into a skip."""
    from adapters.torch.cpu.portable import portable_kernels

    kernels = portable_kernels()
    assert kernels is not None
    assert {"paged_attention", "quant_linear", "quant_decode_layer"} <= set(vars(kernels))


@pytest.mark.slow
@needs_compiler
def test_a_build_killed_while_compiling_does_not_hang_the_next(tmp_path: Path) -> None:
    """SIGKILL while the compiler runs leaves torch's ``lock`` (its FileBaton) in the build
    folder, on which every later build used to wait forever; the next one takes over."""
    sources = _tiny_checkout(tmp_path / "checkout")
    started = tmp_path / "compiler-started"
    stalling = tmp_path / "stalling-cxx"  # the compile step stalls while STALL is set
    stalling.write_text(
        "#!/bin/sh\n"
        'case " $* " in *" -c "*) if [ -n "$STALL" ]; then echo $$ > "$STALL"; exec sleep 300; '
        "fi;; esac\n"
        f'exec {CXX} "$@"\n'
    )
    stalling.chmod(0o755)
    env = {**_env(tmp_path / "cache"), "CXX": str(stalling)}
    first = subprocess.Popen(
        [sys.executable, "-c", BUILD, str(sources)],
        cwd=ROOT,
        env={**env, "STALL": str(started)},
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while not (started.exists() and started.read_text().strip()):
            assert first.poll() is None and time.monotonic() < deadline, "no compile started"
            time.sleep(0.1)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
        if started.exists() and started.read_text().strip():  # ninja's own process group
            os.kill(int(started.read_text()), signal.SIGKILL)
    (folder,) = (tmp_path / "cache" / "kernels").iterdir()
    assert (folder / TORCH_LOCK).exists() and not (folder / MARKER).exists()

    again = subprocess.run(
        [sys.executable, "-c", BUILD, str(sources)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,  # the bug: forever
    )
    assert again.returncode == 0, again.stdout + again.stderr
    assert "removing the lock of a kernel build that never finished" in again.stdout + again.stderr
    assert (folder / MARKER).is_file() and not (folder / TORCH_LOCK).exists()
    assert (folder / f"{folder.name}.so").is_file()


def test_a_live_builder_is_waited_for_then_given_up_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, log_stream: io.StringIO
) -> None:
    monkeypatch.setenv("INFER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(TIMEOUT_ENV, "0.5")
    sources = _tiny_checkout(tmp_path / "checkout")
    folder = _tiny_folder(sources)
    folder.mkdir(parents=True)
    held = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT)  # as another builder holds it
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        os.write(held, b"4242\n")
        start = time.monotonic()
        with pytest.raises(KernelBuildTimeout, match=f"process 4242 .* {TIMEOUT_ENV}"):
            build_extension("infer_test_tiny", sources, FLAGS, python_module=False, what="t")
        assert 0.5 <= time.monotonic() - start < 10
    finally:
        os.close(held)
    logs = [json.loads(line) for line in log_stream.getvalue().splitlines()]
    assert logs[0]["event"] == "waiting for another process to build the t"
    assert logs[0]["pid"] == "4242" and logs[0]["folder"] == str(folder)
    assert not (folder / MARKER).exists()


def test_the_build_timeout_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    from adapters.torch.cpu.build import DEFAULT_TIMEOUT_S, build_timeout
    from domain.errors import InvalidParameterError

    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    assert build_timeout() == DEFAULT_TIMEOUT_S == 300
    monkeypatch.setenv(TIMEOUT_ENV, "12.5")
    assert build_timeout() == 12.5
    monkeypatch.setenv(TIMEOUT_ENV, "soon")
    with pytest.raises(InvalidParameterError, match=TIMEOUT_ENV):
        build_timeout()


@pytest.mark.slow
@needs_compiler
def test_two_checkouts_build_once_and_the_build_names_neither(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("INFER_CACHE_DIR", str(tmp_path / "cache"))
    first = _tiny_checkout(tmp_path / "one" / "kernels")
    build_extension("infer_test_tiny", first, FLAGS, python_module=False, what="test kernels")
    folder = _tiny_folder(first)
    library = folder / f"{folder.name}.so"
    built = library.stat().st_mtime_ns
    assert str(tmp_path / "one") not in (folder / "build.ninja").read_text()

    second = _tiny_checkout(tmp_path / "two" / "kernels")

    def no_build(**kwargs: object) -> None:
        raise AssertionError("rebuilt (torch's load, whose ninja file names this venv)")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_build)
    found = build_extension("infer_test_tiny", second, FLAGS, python_module=False, what="t")
    assert found == str(library) and library.stat().st_mtime_ns == built
