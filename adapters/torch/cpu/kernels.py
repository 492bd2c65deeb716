"""The compiled CPU kernels (``csrc/cpu_decode.cpp``), built once on first use.

They need AVX512-BF16 and a C++ toolchain (torch's cpp_extension with ninja); where either
is missing, or ``INFER_CPU_KERNELS=0``, :func:`cpu_kernels` is None and callers keep their
PyTorch path. See :mod:`adapters.torch.cpu.fused_decode` for what they replace.
"""

import functools
import hashlib
import os
from pathlib import Path
from typing import Any

import structlog
import torch
from torch import Tensor

log = structlog.get_logger(__name__)
_SOURCE = Path(__file__).with_name("csrc") / "cpu_decode.cpp"
_ISA_FLAGS = ("-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bf16")


@functools.cache
def cpu_kernels() -> Any | None:
    """The compiled kernels module, or None where they cannot be built or run."""
    if os.environ.get("INFER_CPU_KERNELS", "1") == "0" or not _cpu_has_kernel_isa():
        return None
    try:
        from torch.utils.cpp_extension import load

        # The source hash in the name lets checkouts with different kernels coexist in
        # torch's extension cache instead of rebuilding over each other.
        digest = hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:12]
        return load(
            name=f"infer_cpu_decode_{digest}",
            sources=[str(_SOURCE)],
            extra_cflags=["-O3", "-fopenmp", *_ISA_FLAGS],
            extra_ldflags=["-fopenmp"],
        )
    except Exception as e:  # no compiler, no ninja, ...: the PyTorch path still works
        log.warning("cpu kernels unavailable, using PyTorch ops", error=str(e))
        return None


def _cpu_has_kernel_isa() -> bool:
    """AVX512-BF16 and the AVX-512 subsets the kernels also use (every CPU with BF16 has them)."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return False
    return {"avx512f", "avx512dq", "avx512vl", "avx512_bf16"} <= flags


def for_bf16_cpu(t: Tensor) -> Any | None:
    """The kernels, when ``t`` is a bf16 CPU tensor and they are available."""
    if t.dtype != torch.bfloat16 or t.device.type != "cpu":
        return None
    return cpu_kernels()
