"""The compiled CPU kernels (``csrc/avx512_bf16/``, one file per kernel family), built once
on first use. They register as ``torch.ops.infer.<name>_bf16``, in the op namespace of the
portable kernels (:mod:`.portable`); :func:`cpu_kernels` names them by their short names.

They need AVX512-BF16 and a C++ toolchain (torch's cpp_extension with ninja); where either
is missing, or ``INFER_CPU_KERNELS=0``, :func:`cpu_kernels` is None and callers keep their
PyTorch path. See :mod:`adapters.torch.cpu.fused_decode` for what they replace.
"""

import functools
import os
from pathlib import Path
from types import SimpleNamespace
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
# The ops the build registers, each as torch.ops.infer.<name>_bf16.
OPS = (
    "prompt_attention",
    "pack_panels",
    "gemm_packed",
    "rms_norm",
    "silu_mul",
    "gelu_tanh_mul",
    "sample_rows",
    "rope",
    "argmax_rows",
    "paged_attention",
    "set_split_keys",
    "write_pool",
    "decode_layer_paged",
)


@functools.cache
def cpu_kernels() -> Any | None:
    """The compiled ops by their short names (``.rms_norm``, ``.gemm_packed``, ... as in
    :data:`OPS`), or None where they cannot be built or run."""
    if os.environ.get("INFER_CPU_KERNELS", "1") == "0" or not cpu_has_kernel_isa():
        return None
    try:
        build_extension(
            "infer_cpu_decode", _CSRC, list(CFLAGS), python_module=False, what="CPU kernels"
        )
        # each op's one overload, called without the packet's overload lookup
        ops = torch.ops.infer
        return SimpleNamespace(**{op: getattr(ops, f"{op}_bf16").default for op in OPS})
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
