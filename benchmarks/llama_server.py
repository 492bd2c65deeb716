"""llama.cpp's C++ ``llama-server``, built once from the sources vendored in llama-cpp-python's
sdist and cached outside the checkout: the anchor of ``bench_vs_llamacpp.py``.

The package index is the only network this needs: ``pip download --no-binary :all:
llama-cpp-python==VERSION`` fetches the sdist, whose ``vendor/llama.cpp`` is configured with
CMake (``GGML_NATIVE=OFF``; every x86 ISA option from what ``/proc/cpuinfo`` advertises: AVX,
AVX2, FMA, F16C, BMI2, AVX-VNNI, AVX-512 F/CD/VL/DQ/BW, VBMI, VNNI, BF16; AMX always off,
because a VM may advertise AMX without letting a process use its tiles, and a native build
then segfaults on the first request) and built static (``BUILD_SHARED_LIBS=OFF``, so the
binaries move freely) for ``llama-server`` and ``llama-quantize``.

Cached in ``${INFER_CACHE_DIR:-~/.cache/infer}/llama.cpp/<version>-<hash of the CMake
flags>/``: ``bin/llama-server``, ``bin/llama-quantize``, the vendored ``convert_hf_to_gguf.py``
with its ``conversion/`` and ``gguf-py/`` (HF checkpoint -> GGUF), ``build-info.json``. A
build runs in a temporary folder beside it and is renamed into place when done, so an
interrupted build never blocks the next (stale temporary folders are removed); a lock makes
a second concurrent build wait for the first instead of repeating it. The sdist is kept in
``.../llama.cpp/sdist/``. Re-running with the folder in place does nothing.

Progress goes to stderr, the requested binary's path to stdout:

    .venv/bin/python benchmarks/llama_server.py                 # build if needed; print its path
    .venv/bin/python benchmarks/llama_server.py --tool llama-quantize
    .venv/bin/python benchmarks/llama_server.py --print-flags    # the CMake flags; builds nothing
    .venv/bin/python benchmarks/llama_server.py --jobs 2 --nice 15 --version 0.3.36
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

VERSION = "0.3.36"
TARGETS = ("llama-server", "llama-quantize")
# Kept from the source tree (besides the binaries): the HF -> GGUF converter and what it imports.
CONVERTER = ("convert_hf_to_gguf.py", "conversion", "gguf-py", "LICENSE")
TMP_PREFIX = ".tmp-"

# (ggml CMake option, the /proc/cpuinfo flags it needs). GGML_AVX512 compiles with
# -mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw, so it needs all five.
ISA_OPTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("GGML_SSE42", ("sse4_2",)),
    ("GGML_AVX", ("avx",)),
    ("GGML_AVX2", ("avx2",)),
    ("GGML_BMI2", ("bmi2",)),
    ("GGML_FMA", ("fma",)),
    ("GGML_F16C", ("f16c",)),
    ("GGML_AVX_VNNI", ("avx_vnni",)),
    ("GGML_AVX512", ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")),
    ("GGML_AVX512_VBMI", ("avx512vbmi",)),
    ("GGML_AVX512_VNNI", ("avx512_vnni",)),
    ("GGML_AVX512_BF16", ("avx512_bf16",)),
)
# Off whatever the CPU says (see the module docstring).
AMX_OFF = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")
# Everything else the build needs: release, static, CPU only, no network at build or run time
# (no OpenSSL for model downloads, no prebuilt web UI fetched from Hugging Face), only tools.
BASE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DGGML_NATIVE=OFF",
    "-DGGML_CPU_ALL_VARIANTS=OFF",
    "-DGGML_BACKEND_DL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
)


# ---------------------------------------------------------------------------- pure parts


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The first ``flags`` line of /proc/cpuinfo (every core advertises the same)."""
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def isa_options(flags: frozenset[str]) -> dict[str, bool]:
    """Each ggml ISA option: on where the CPU has every flag it needs; AMX off."""
    options = {name: all(f in flags for f in needs) for name, needs in ISA_OPTIONS}
    options.update(dict.fromkeys(AMX_OFF, False))
    return options


def cmake_flags(flags: frozenset[str]) -> list[str]:
    options = isa_options(flags)
    return [*BASE_FLAGS, *(f"-D{k}={'ON' if v else 'OFF'}" for k, v in options.items())]


def build_name(version: str, flags: Sequence[str]) -> str:
    """``<version>-<12 hex digits of the flags>``: another CPU (other flags) gets its own build."""
    digest = hashlib.sha256("\n".join([version, *flags]).encode()).hexdigest()[:12]
    return f"{version}-{digest}"


def cache_root() -> Path:
    base = os.environ.get("INFER_CACHE_DIR") or str(Path.home() / ".cache" / "infer")
    return Path(base).expanduser() / "llama.cpp"


def read_cpuinfo() -> str:
    with contextlib.suppress(OSError):
        return Path("/proc/cpuinfo").read_text()
    return ""


def enabled(flags: Sequence[str]) -> list[str]:
    """The ISA options a flag list turns on, without the ``GGML_`` prefix (for reports)."""
    names = {name for name, _ in ISA_OPTIONS}
    on = []
    for flag in flags:
        key, _, value = flag.removeprefix("-D").partition("=")
        if key in names and value == "ON":
            on.append(key.removeprefix("GGML_"))
    return on


# ---------------------------------------------------------------------------- building


def _progress(message: str) -> None:
    print(f"[llama_server] {message}", file=sys.stderr, flush=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_temporaries(root: Path) -> None:
    """Temporary build folders of processes that no longer run (interrupted builds)."""
    for path in root.glob(f"{TMP_PREFIX}*"):
        try:
            pid = int(path.name.split("-")[-2])
        except (IndexError, ValueError):
            continue
        if not _pid_alive(pid):
            _progress(f"removing {path} (left by an interrupted build)")
            shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    """An exclusive ``flock``: the kernel drops it when its holder dies, so it never blocks
    after an interrupted build."""
    with path.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _progress(f"another build holds {path}; waiting for it")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _run(command: list[str], cwd: Path | None = None, nice: int = 0) -> None:
    """Run with its output on our stderr (cmake's and ninja's progress)."""
    _progress("$ " + " ".join(command))

    def lower_priority() -> None:  # to niceness ``nice`` at least (not stacked on the caller's)
        if (increment := nice - os.nice(0)) > 0:
            os.nice(increment)

    subprocess.run(
        command,
        cwd=cwd,
        stdout=sys.stderr,
        stderr=sys.stderr,
        check=True,
        preexec_fn=lower_priority,
    )


def sdist(version: str, root: Path) -> Path:
    """llama-cpp-python's sdist, downloaded with pip (once: kept in ``root/sdist``)."""
    target = root / "sdist" / f"llama_cpp_python-{version}.tar.gz"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    prefix = f"{TMP_PREFIX}sdist-{os.getpid()}-"
    with tempfile.TemporaryDirectory(prefix=prefix, dir=root) as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:"]
        command += ["--no-deps", "--disable-pip-version-check", "-d", tmp]
        _run([*command, f"llama-cpp-python=={version}"])
        [downloaded] = Path(tmp).glob("*.tar.gz")
        os.replace(downloaded, target)
    return target


def _unpack_vendored(archive: Path, dest: Path) -> Path:
    """``vendor/llama.cpp`` of the sdist into ``dest``; returns the source folder."""
    _progress(f"unpacking {archive.name}")
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name + "/"]
        tar.extractall(dest, members=members, filter="data")
    [src] = dest.glob("*/vendor/llama.cpp")
    # A git submodule's pointer to the parent repository, which the sdist does not hold:
    # without it llama.cpp's build-info asks no git (its build number stays 0).
    if (src / ".git").is_file():
        (src / ".git").unlink()
    return src


def installed(version: str = VERSION, flags: Sequence[str] | None = None) -> Path:
    """Where the build for this CPU lives (whether or not it exists yet)."""
    flags = list(flags) if flags is not None else cmake_flags(cpu_flags(read_cpuinfo()))
    return cache_root() / build_name(version, flags)


def build(
    version: str = VERSION,
    jobs: int | None = None,
    nice: int = 15,
    flags: Sequence[str] | None = None,
    force: bool = False,
) -> Path:
    """The cached build folder for this CPU (``bin/llama-server`` inside), built first when
    missing. ``force`` rebuilds it."""
    flags = list(flags) if flags is not None else cmake_flags(cpu_flags(read_cpuinfo()))
    root = cache_root()
    final = root / build_name(version, flags)
    if not force and _complete(final):
        return final
    root.mkdir(parents=True, exist_ok=True)
    with _lock(root / f".lock-{final.name}"):
        if not force and _complete(final):  # another process built it while we waited
            _progress(f"built by another process: {final}")
            return final
        _remove_stale_temporaries(root)
        archive = sdist(version, root)
        tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{final.name}-{os.getpid()}-", dir=root))
        try:
            _build_into(archive, tmp, flags, version, jobs or os.cpu_count() or 1, nice)
            if final.exists():  # only with force: the old build goes
                shutil.rmtree(final)
            os.rename(tmp / "out", final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    _progress(f"built: {final}")
    return final


def _complete(folder: Path) -> bool:
    return (
        all((folder / "bin" / t).is_file() for t in TARGETS)
        and (folder / "build-info.json").is_file()
    )


def _build_into(
    archive: Path, tmp: Path, flags: list[str], version: str, jobs: int, nice: int
) -> None:
    started = time.monotonic()
    src = _unpack_vendored(archive, tmp / "src")
    build_dir = tmp / "build"
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    _run(["cmake", "-S", str(src), "-B", str(build_dir), *generator, *flags], nice=nice)
    _progress(f"compiling {', '.join(TARGETS)} with {jobs} jobs (~10 min on 2 cores)")
    command = ["cmake", "--build", str(build_dir), "--target", *TARGETS, "-j", str(jobs)]
    _run(command, nice=nice)
    out = tmp / "out"
    (out / "bin").mkdir(parents=True)
    for target in TARGETS:
        shutil.copy2(build_dir / "bin" / target, out / "bin" / target)
    for name in CONVERTER:
        path = src / name
        if path.is_dir():
            shutil.copytree(path, out / name)
        elif path.exists():
            shutil.copy2(path, out / name)
    info = {
        "llama_cpp_python": version,
        "cmake_flags": flags,
        "isa": enabled(flags),
        "cpu": _cpu_model(),
        "compiler": _compiler(),
        "machine": platform.machine(),
        "build_seconds": round(time.monotonic() - started, 1),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    (out / "build-info.json").write_text(json.dumps(info, indent=2) + "\n")


def _cpu_model() -> str:
    for line in read_cpuinfo().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def _compiler() -> str:
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        out = subprocess.run(["c++", "--version"], capture_output=True, text=True, check=True)
        return out.stdout.splitlines()[0]
    return "unknown"


def server_binary(version: str = VERSION, jobs: int | None = None, nice: int = 15) -> Path:
    """``llama-server`` for this CPU, built first when missing."""
    return build(version, jobs=jobs, nice=nice) / "bin" / "llama-server"


def build_info(folder: Path) -> dict[str, object]:
    with contextlib.suppress(OSError, json.JSONDecodeError):
        return dict(json.loads((folder / "build-info.json").read_text()))
    return {}


# ---------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--version", default=VERSION, help="llama-cpp-python's sdist version")
    p.add_argument("--jobs", type=int, default=None, help="default: every core")
    p.add_argument("--nice", type=int, default=15, help="the compilers' niceness, at least")
    p.add_argument("--tool", default="llama-server", choices=[*TARGETS, "convert", "dir"])
    p.add_argument("--force", action="store_true", help="rebuild even when cached")
    p.add_argument("--print-flags", action="store_true", help="print the CMake flags and exit")
    args = p.parse_args(argv)
    flags = cmake_flags(cpu_flags(read_cpuinfo()))
    if args.print_flags:
        print(" ".join(flags))
        print(f"cache: {installed(args.version, flags)}", file=sys.stderr)
        return
    folder = build(args.version, jobs=args.jobs, nice=args.nice, flags=flags, force=args.force)
    paths = {"dir": folder, "convert": folder / "convert_hf_to_gguf.py"}
    print(paths.get(args.tool, folder / "bin" / args.tool))


if __name__ == "__main__":
    main()
