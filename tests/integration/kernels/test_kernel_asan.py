"""The CPU kernels' hand-written vector loops read and write only inside their buffers: the
kernel tests run again in a subprocess with every kernel built with -fsanitize=address
(``INFER_KERNEL_CFLAGS``, a build of its own) and gcc's AddressSanitizer runtime preloaded,
which aborts at the first access outside an allocation and writes its report to a file.
Once a padded last quad of 4-bit blocks read 32 bytes past its activation row: found so."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from adapters.torch.cpu.portable import _isa_flags, portable_kernels

ROOT = Path(__file__).resolve().parents[3]
PORTABLE_TESTS = [
    "tests/integration/kernels/test_quant_kernel.py",
    "tests/integration/torch/test_paged_kv.py",
    "tests/integration/kernels/test_quant_decode.py",
]


def _gcc_file(name: str) -> str | None:
    try:
        out = subprocess.run(
            ["gcc", f"-print-file-name={name}"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return out if os.path.isabs(out) and Path(out).exists() else None


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["native", "avx2"])
def test_the_kernel_tests_pass_under_address_sanitizer(isa: str, tmp_path: Path) -> None:
    libasan, libstdcxx = _gcc_file("libasan.so"), _gcc_file("libstdc++.so.6")
    if portable_kernels() is None or libasan is None or libstdcxx is None:
        pytest.skip("needs a C++ toolchain with AddressSanitizer (gcc's libasan)")
    if isa == "avx2" and "-mavx2" not in _isa_flags():
        pytest.skip("not an AVX2 CPU")
    reports = tmp_path / "asan"
    env = {
        **os.environ,
        # libstdc++ preloaded too: ASan's interceptor of C++ throws (a kernel's TORCH_CHECK)
        # finds the real one only so
        "LD_PRELOAD": f"{libasan} {libstdcxx}",
        "ASAN_OPTIONS": f"detect_leaks=0:log_path={reports}",
        "INFER_KERNEL_CFLAGS": "-fsanitize=address -fno-omit-frame-pointer",
        "INFER_CACHE_DIR": str(tmp_path / "cache"),
        "INFER_CPU_ISA": isa,
    }
    # AVX2-capped: the hand-written AVX2 loops (quant_linear.cpp); the rest is the same
    # code as natively
    tests = ["tests/integration/kernels/test_quant_kernel.py"]
    if isa == "native":
        tests = ["tests/integration/kernels/test_cpu_kernels.py", *PORTABLE_TESTS]
    args = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests]
    out = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    found = sorted(tmp_path.glob("asan*"))
    assert not found, found[0].read_text()[:4000]
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
