"""Kernels for any CPU (``portable/``): plain C++ the compiler vectorizes for the ISA this
CPU has, built once on first use (torch's cpp_extension, cached by torch) where a C++
toolchain exists; None elsewhere or with ``INFER_CPU_KERNELS=0``, and callers keep their
PyTorch path.

Today: ``paged_attention``, decode attention read through the KV pool's block tables
(:class:`~adapters.torch.models.paged_kv.PagedKVCache`) without gathering each row's
context into a contiguous copy first; ``quant_linear`` and ``quant_dequantize``, linear
layers over quantized weights (int8, or 4-bit packed like GGUF Q4_0, float16 scales and
optional mins per group): few rows multiply int8-quantized activations with the weights in
integers, many rows dequantize tiles for a GEMM. The AVX512-BF16 kernels (:mod:`.kernels`)
are a separate build: they need that ISA; these need only a compiler.
"""

import functools
import hashlib
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import structlog
import torch
from torch import nn

from adapters.torch.models.layers import Attention

log = structlog.get_logger(__name__)
_SOURCES = Path(__file__).with_name("portable")
# The vector extensions the loops may use, where this CPU has them (x86: AVX2 + FMA; other
# architectures build with their baseline, e.g. NEON on aarch64).
_X86_FLAGS = {"avx2": "-mavx2", "fma": "-mfma", "f16c": "-mf16c"}


def _isa_flags() -> list[str]:
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return []
    return [flag for name, flag in _X86_FLAGS.items() if name in flags]


@functools.cache
def portable_kernels() -> Any | None:
    """The compiled ops (``.paged_attention``, ``.quant_linear``, ``.quant_dequantize``), or
    None where they cannot be built."""
    if os.environ.get("INFER_CPU_KERNELS", "1") == "0":
        return None
    cflags = ["-O3", "-fopenmp", *_isa_flags()]
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        sources = sorted(_SOURCES.glob("*.cpp"))
        name = f"infer_cpu_portable_{_digest(sources, cflags)}"
        built = Path(_get_build_directory(name, verbose=False), f"{name}.so").exists()
        if not built:  # long work shows progress: a first build takes ~30 s
            log.info("compiling the portable CPU kernels for this CPU, once", flags=cflags)
        start = time.perf_counter()
        load(
            name=name,
            sources=[str(path) for path in sources],
            extra_cflags=cflags,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,  # registers torch.ops.infer_portable
        )
        if not built:
            log.info("portable CPU kernels built", seconds=round(time.perf_counter() - start, 1))
        ops = torch.ops.infer_portable
        return SimpleNamespace(
            paged_attention=ops.paged_attention,
            quant_linear=ops.quant_linear,
            quant_dequantize=ops.quant_dequantize,
        )
    except Exception as e:  # no compiler, no ninja, ...: the PyTorch path still works
        log.warning("portable cpu kernels unavailable, using PyTorch ops", error=str(e))
        return None


def _digest(sources: list[Path], cflags: list[str]) -> str:
    """Sources and flags in the extension's name: checkouts or machines with different ones
    never rebuild over each other in torch's extension cache."""
    h = hashlib.sha256(" ".join(cflags).encode())
    for path in sources:
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


def install_paged_attention(model: nn.Module) -> bool:
    """Give every attention layer of a CPU model without one the portable paged decode
    kernel; False where it cannot be built (the layers gather their blocks)."""
    kernels = portable_kernels()
    if kernels is None:
        return False
    for module in model.modules():
        if isinstance(module, Attention) and module.paged_attention_kernel is None:
            module.paged_attention_kernel = kernels.paged_attention
    return True
