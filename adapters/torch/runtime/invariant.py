"""Batch-invariant serving (``--batch-invariant``): a row's logits do not depend on what
shares its step — how many rows, prompt chunks or decode rows, drafts or not, a prefix
cache hit or not.

Three choices make a step's arithmetic depend on its shape, and this turns each off:

- the quantized linears switch from integer dot products to dequantized tiles and a GEMM
  from some row count on (:class:`~adapters.torch.quant.QuantLinear`'s
  ``dense_from_rows``), and to bf16 panel copies (``panels_from_rows``), and an 8-bit LM
  head keeps a dense copy for many rows: here every row takes the integer path, which
  computes each row alone in one fixed order;
- prompt chunks attend through the prompt kernel or SDPA (its own blocking), decode rows
  through the paged decode kernel: here every token of a step is a row over the paged pool
  (the runner lays prompt chunks out as rows; the fused decode layer writes the step's keys
  and values first, then each row attends to the positions before its own);
- the AVX512-BF16 decode attention splits one row's keys across threads when few rows share
  the call: here it never splits.

The elementwise parts (norms, RoPE, gating, residuals) and the sampler are per row already.
What it costs is measured side by side in ``benchmarks/bench_batch_invariance.py``; where a
model's linears are not quantized (``--quantization none``), their GEMMs are the BLAS
library's, whose reduction order may change with the row count: the start-up log says so.
"""

import structlog
from torch import nn

from adapters.torch.cpu.fused_decode import PackedLinear
from adapters.torch.cpu.kernels import cpu_kernels
from adapters.torch.quant import QuantLinear

log = structlog.get_logger(__name__)

# dense_from_rows for "never": more rows than any step holds.
NEVER = 1 << 30


def make_batch_invariant(model: nn.Module) -> dict[str, int | bool]:
    """Put ``model``'s kernels on their one-path-per-row settings (see the module); returns
    what was set, for the start-up log."""
    quantized = dense = 0
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.dense_from_rows = NEVER
            module.dense = None  # the LM head's dense copy serves many rows only
            module.panels, module.panels_from_rows = None, NEVER  # as do the bf16 panels
            quantized += 1
        elif isinstance(module, nn.Linear | PackedLinear):
            dense += 1
    kernels = cpu_kernels()
    if kernels is not None and hasattr(kernels, "set_split_keys"):
        kernels.set_split_keys(False)
    if dense:
        log.warning(
            "batch-invariant: the model has linears that are not quantized; their GEMMs "
            "may round differently with the row count (serve with --quantization)",
            dense_linears=dense,
        )
    return {"quantized_linears": quantized, "dense_linears": dense, "split_keys": False}
