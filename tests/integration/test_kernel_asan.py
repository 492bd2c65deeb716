"""The portable kernels' hand-written vector loops read and write only inside their buffers:
AddressSanitizer over every format, path and tail (tests/integration/asan_kernels.py).
A padded last quad of 4-bit blocks once read 32 bytes past its activation row."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from adapters.torch.cpu.portable import _isa_flags, portable_kernels

ROOT = Path(__file__).resolve().parents[2]


def _libasan() -> str | None:
    try:
        out = subprocess.run(
            ["gcc", "-print-file-name=libasan.so"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return out if os.path.isabs(out) and Path(out).exists() else None


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["native", "avx2"])
def test_the_portable_kernels_stay_inside_their_buffers(isa: str, tmp_path: Path) -> None:
    libasan = _libasan()
    if portable_kernels() is None or libasan is None:
        pytest.skip("needs a C++ toolchain with AddressSanitizer (gcc's libasan)")
    if isa == "avx2" and "-mavx2" not in _isa_flags():
        pytest.skip("not an AVX2 CPU")
    env = {
        **os.environ,
        "LD_PRELOAD": libasan,
        "ASAN_OPTIONS": "detect_leaks=0",
        "INFER_CACHE_DIR": str(tmp_path),
        "PYTHONPATH": str(ROOT),
    }
    args = [sys.executable, "-m", "tests.integration.asan_kernels"]
    if isa == "avx2":
        args.append("--avx2")
    out = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    report = out.stdout + out.stderr
    assert "AddressSanitizer" not in report, report[-4000:]
    assert out.returncode == 0, report[-4000:]
    assert out.stdout.strip().splitlines()[-1].startswith("ok "), report[-4000:]
