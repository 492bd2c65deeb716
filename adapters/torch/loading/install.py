"""Every kernel a model runs with, installed in one place, once, when it is loaded.

:func:`install_kernels` (the loader's last step) gives a model, by device:

- on a CPU with ``fused`` (the loader's ``prepack``): the fused quantized decode layer over
  quantized linears (:mod:`adapters.torch.cpu.quant_decode`), and for a bf16 model the
  AVX512-BF16 kernels where the CPU and a compiler have them
  (:mod:`adapters.torch.cpu.fused_decode`: packed linears, norms, gating, the
  :class:`~adapters.torch.models.attention_backend.CpuBf16Attention` backend, fused decode
  blocks);
- on a CPU, fused or not, the portable paged decode kernel for the layers without a paged
  kernel yet (it reads the pool in place; a model kept for training, ``fused`` False, keeps
  its plain parameters and gets only this);
- on CUDA, the Triton paged decode kernel.

Where a kernel cannot be built, the layers keep SDPA over gathered blocks. What was chosen
is logged once per load, by attention backend.
"""

from collections import Counter

import structlog

from adapters.torch.cpu import portable
from adapters.torch.cpu.fused_decode import can_optimize, optimize_for_cpu
from adapters.torch.cpu.quant_decode import install_quant_decode
from adapters.torch.cuda import paged_attention as cuda_attention
from adapters.torch.models.layers import Attention
from adapters.torch.models.transformer import Transformer
from adapters.torch.quant import QuantLinear

log = structlog.get_logger(__name__)


def install_trainable_kernels(model: Transformer) -> None:
    """The kernels a serving model's prompt path runs (the AVX512-BF16 norms, gating, RoPE
    and prompt attention), on a model to train through them: no packed linears, no fused
    decode layers (a training forward has no decode rows)."""
    if model.embed_tokens.weight.device.type == "cpu" and can_optimize(model):
        optimize_for_cpu(model, pack_linears=False)


def install_kernels(model: Transformer, *, fused: bool = True) -> dict[str, int]:
    """Install the model's kernels (see the module); returns attention backend -> layers."""
    device = model.embed_tokens.weight.device.type
    if device == "cpu":
        if fused and any(isinstance(m, QuantLinear) for m in model.modules()):
            install_quant_decode(model)
        if fused and can_optimize(model):
            optimize_for_cpu(model)
        portable.install_paged_attention(model)
    elif device == "cuda":
        cuda_attention.install_paged_attention(model)
    backends = dict(Counter(m.backend.name for m in model.modules() if isinstance(m, Attention)))
    log.debug("attention backend", layers=backends, device=device, fused=fused)
    return backends
