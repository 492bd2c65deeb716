"""The compiled CPU kernels (``csrc/avx512_bf16/``, one file per kernel family), built once
on first use.

They need AVX512-BF16 and a C++ toolchain (torch's cpp_extension with ninja); where either
is missing, or ``INFER_CPU_KERNELS=0``, :func:`cpu_kernels` is None and callers keep their
PyTorch path. See :mod:`adapters.torch.cpu.fused_decode` for what they replace.
"""

import functools
import os
from pathlib import Path
from typing import Any

import structlog
import torch
from torch import Tensor

from adapters.torch.cpu.build import build_extension
from adapters.torch.cpu.isa import cpu_flags

log = structlog.get_logger(__name__)
_CSRC = Path(__file__).with_name("csrc") / "avx512_bf16"
_ISA_FLAGS = ("-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bf16")
CFLAGS = ("-O3", "-fopenmp", *_ISA_FLAGS)


@functools.cache
def cpu_kernels() -> Any | None:
    """The compiled kernels module, or None where they cannot be built or run."""
    if os.environ.get("INFER_CPU_KERNELS", "1") == "0" or not cpu_has_kernel_isa():
        return None
    try:
        return build_extension(
            "infer_cpu_decode", _CSRC, list(CFLAGS), python_module=True, what="CPU kernels"
        )
    except Exception as e:  # no compiler, no ninja, ...: the PyTorch path still works
        log.warning("cpu kernels unavailable, using PyTorch ops", error=str(e))
        return None


def cpu_has_kernel_isa() -> bool:
    """AVX512-BF16 and the AVX-512 subsets the kernels also use (every CPU with BF16 has them)."""
    return {"avx512f", "avx512dq", "avx512vl", "avx512_bf16"} <= cpu_flags()


def for_bf16_cpu(t: Tensor) -> Any | None:
    """The kernels, when ``t`` is a bf16 CPU tensor and they are available."""
    if t.dtype != torch.bfloat16 or t.device.type != "cpu":
        return None
    return cpu_kernels()
