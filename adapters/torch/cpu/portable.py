"""Kernels for any CPU (``csrc/portable/``): plain C++ the compiler vectorizes for the ISA this
CPU has, built once on first use (:mod:`.build`, cached per machine) where a C++
toolchain exists; None elsewhere or with ``INFER_CPU_KERNELS=0``, and callers keep their
PyTorch path.

Today: ``paged_attention``, decode attention read through the KV pool's block tables
(:class:`~adapters.torch.models.paged_kv.PagedKVCache`) without gathering each row's
context into a contiguous copy first; ``quant_linear`` and ``quant_dequantize``, linear
layers over quantized weights (int8, or 4-bit packed like GGUF Q4_0, float16 scales and
optional mins per group): few rows multiply int8-quantized activations with the weights in
integers, many rows dequantize tiles for a GEMM; ``quant_decode_layer``, a whole decoder
layer's decode rows over those linears and the pool in one call (:mod:`.quant_decode`).
The AVX512-BF16 kernels (:mod:`.kernels`) are a separate build: they need that ISA; these
need only a compiler.
"""

import functools
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import structlog
import torch
from torch import nn

from adapters.torch.cpu.build import build_extension
from adapters.torch.cpu.isa import cpu_flags
from adapters.torch.models.attention_backend import PagedDecodeAttention
from adapters.torch.models.layers import Attention

log = structlog.get_logger(__name__)
_SOURCES = Path(__file__).with_name("csrc") / "portable"
# The vector extensions the loops may use, where this CPU has them (x86: AVX2 + FMA, and
# AVX-512 with VNNI where present; other architectures build with their baseline, e.g. NEON
# on aarch64).
_X86_FLAGS = {
    "avx2": "-mavx2",
    "fma": "-mfma",
    "f16c": "-mf16c",
    "avx512f": "-mavx512f",
    "avx512bw": "-mavx512bw",
    "avx512vl": "-mavx512vl",
    "avx512_vnni": "-mavx512vnni",
}


def _isa_flags() -> list[str]:
    flags = cpu_flags()
    return [flag for name, flag in _X86_FLAGS.items() if name in flags]


@functools.cache
def portable_kernels() -> Any | None:
    """The compiled ops (``.paged_attention``, ``.quant_linear``, ``.quant_dequantize``,
    ``.quant_decode_layer``) and ``.fast_bits`` (the weight widths whose integer path has
    vector code on this build: 6 only with AVX-512BW), or None where they cannot be built."""
    if os.environ.get("INFER_CPU_KERNELS", "1") == "0":
        return None
    cflags = ["-O3", "-fopenmp", *_isa_flags()]
    try:
        build_extension(
            "infer_cpu_portable",
            _SOURCES,
            cflags,
            python_module=False,  # registers its ops in torch.ops.infer
            what="portable CPU kernels",
        )
        ops = torch.ops.infer
        return SimpleNamespace(
            paged_attention=ops.paged_attention,
            quant_linear=ops.quant_linear,
            quant_dequantize=ops.quant_dequantize,
            quant_decode_layer=ops.quant_decode_layer,
            fast_bits=frozenset(ops.quant_fast_bits()),
        )
    except Exception as e:  # no compiler, no ninja, ...: the PyTorch path still works
        log.warning("portable cpu kernels unavailable, using PyTorch ops", error=str(e))
        return None


def install_paged_attention(model: nn.Module) -> bool:
    """Give every attention layer of a CPU model that has no paged kernel yet the portable
    one (:class:`PagedDecodeAttention`, one instance for the model); False where it cannot
    be built (the layers gather their blocks)."""
    kernels = portable_kernels()
    if kernels is None:
        return False
    backend = PagedDecodeAttention(kernels.paged_attention, "portable")
    for module in model.modules():
        if isinstance(module, Attention) and module.backend.paged is None:
            module.backend = backend
    return True
