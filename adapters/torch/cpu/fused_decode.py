"""CPU inference optimizations, applied to a loaded bf16 model from outside.

- When this CPU has AVX512-BF16 and a C++ compiler, kernels from ``csrc/avx512_bf16/``
  (built once on first use, cached by torch): every linear runs on weights packed into
  64-column panels (``gemm_packed``: each thread streams its panels once per call; for
  SmolLM2's shapes 1.2-1.7x oneDNN from 1 to 64 rows and on par for long prompts, for 1B
  models' shapes on par), one call each for RMSNorm and SiLU gating (PyTorch runs ~9 and ~4
  small ops), RoPE in one pass (instead of roll, multiply and addcmul), causal GQA attention
  for prompt chunks, and decode attention over the engine's paged pool through block
  tables. A decode step of a small model is bound by
  weight and KV reads and per-op dispatch: a block's decode rows run as one call
  (:class:`FusedDecodeLayer`). (The cache's writes and the sampler use the same module, see
  ``kernels.py``.)
- Without them, linear weights are prepacked into oneDNN's blocked layout (what inductor's
  freezing pass does): a bf16 matmul ~1.5x faster than ``F.linear``, identical results.

Packed weights are opaque (no autograd, no state_dict), so only inference models are
optimized. ``INFER_CPU_KERNELS=0`` turns the compiled kernels off.
"""

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from adapters.torch.cpu.kernels import cpu_kernels
from adapters.torch.models.attention_backend import CpuBf16Attention
from adapters.torch.models.gemma3 import Gemma3Block
from adapters.torch.models.layers import Attention, GatedMLP, PagedDecodeRows, RMSNorm, gelu_tanh
from adapters.torch.models.llama import LlamaBlock
from adapters.torch.models.reference_grad import through

_ACTS = (F.silu, gelu_tanh)  # the gating activations the kernels have


class PackedLinear(nn.Module):
    """``y = x @ W.T (+ b)`` on prepacked weights: panels for the ``gemm_packed`` kernel
    when the kernels are available, else oneDNN's blocked layout."""

    def __init__(self, linear: nn.Linear, kernels: Any | None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.kernels = kernels if kernels is not None and self.in_features % 2 == 0 else None
        if self.kernels is not None:
            self.packed = self.kernels.pack_panels(weight.contiguous())
        else:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)

    def forward(self, x: Tensor) -> Tensor:
        if self.kernels is None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        y = self.kernels.gemm_packed(x.contiguous(), self.packed, self.out_features)
        return y if self.bias is None else y + self.bias


class KernelRMSNorm(nn.Module):
    """:class:`RMSNorm` as one kernel call for contiguous bf16 inputs."""

    def __init__(self, norm: RMSNorm, kernels: Any) -> None:
        super().__init__()
        self.norm: RMSNorm = norm
        self.kernel = kernels.rms_norm

    def forward(self, x: Tensor) -> Tensor:
        # A strided input (a QK-norm's heads) is copied first: the fused decode layer does
        # the same, so both paths round alike. Trainable: differentiated as the module.
        n = self.norm
        return through(lambda t: self.kernel(t.contiguous(), n.weight, n.eps, n.unit_offset), n, x)


class KernelGatedMLP(nn.Module):
    """A SiLU or tanh-GELU :class:`GatedMLP` with the gating done in one kernel call."""

    def __init__(self, mlp: GatedMLP, kernels: Any) -> None:
        super().__init__()
        self.gelu = mlp.act is gelu_tanh
        self.w13, self.w2 = mlp.w13, mlp.w2
        self.kernel = kernels.gelu_tanh_mul if self.gelu else kernels.silu_mul

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(through(self.kernel, self._gated, self.w13(x)))

    def _gated(self, gate_up: Tensor) -> Tensor:
        """The gating in PyTorch ops (its gradient, for a trainer on these kernels)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return (gelu_tanh(gate) if self.gelu else F.silu(gate)) * up


class FusedDecodeLayer:
    """A Llama, Qwen3 or Gemma 3 block's decode rows as one kernel call, ``decode_layer_paged``
    over the engine's paged pool: the same kernels in the same order as its modules, without
    ~40-50 Python-level ops."""

    def __init__(self, block: LlamaBlock | Gemma3Block, kernels: Any) -> None:
        assert FusedDecodeLayer.applies(block)
        attn, mlp = block.attn, block.mlp
        assert isinstance(mlp, KernelGatedMLP)
        gemma = isinstance(block, Gemma3Block)
        mlp_norm = block.pre_feedforward_layernorm if gemma else block.post_attention_layernorm
        self.kernel = kernels.decode_layer_paged
        self.weights = [
            _weight(block.input_layernorm),
            _packed(attn.wqkv),
            _packed(attn.wo),
            _weight(block.post_attention_layernorm) if gemma else None,
            _weight(mlp_norm),
            _packed(mlp.w13),
            _packed(mlp.w2),
            _weight(block.post_feedforward_layernorm) if gemma else None,
            _weight(attn.q_norm) if attn.q_norm is not None else None,
            _weight(attn.k_norm) if attn.k_norm is not None else None,
        ]
        first = block.input_layernorm
        assert isinstance(first, KernelRMSNorm)
        self.unit_offset, self.eps, self.gelu = first.norm.unit_offset, first.norm.eps, mlp.gelu
        self.intermediate = mlp.w2.in_features
        self.n_heads, self.n_kv, self.scale = attn.n_heads, attn.n_kv, attn.scale

    @staticmethod
    def applies(block: nn.Module) -> bool:
        if not isinstance(block, LlamaBlock | Gemma3Block):
            return False
        attn, mlp = block.attn, block.mlp
        norms = [m for m in block.children() if not isinstance(m, Attention | KernelGatedMLP)]
        norms += [n for n in (attn.q_norm, attn.k_norm) if n is not None]
        linears = (attn.wqkv, attn.wo, getattr(mlp, "w13", None), getattr(mlp, "w2", None))
        return (
            isinstance(mlp, KernelGatedMLP)
            and all(isinstance(m, PackedLinear) and m.kernels and m.bias is None for m in linears)
            and all(isinstance(n, KernelRMSNorm) for n in norms)
            and isinstance(attn.backend, CpuBf16Attention)
        )

    def __call__(
        self, x: Tensor, rope: tuple[Tensor, Tensor], rows: PagedDecodeRows
    ) -> Tensor | None:
        y = self.kernel(
            x.reshape(-1, x.shape[-1]),
            *self.weights,
            self.unit_offset,
            self.gelu,
            self.intermediate,
            rows.k_pool,
            rows.v_pool,
            rows.write_index,
            rows.tables,
            rows.lengths,
            rows.window,
            *rope,
            self.n_heads,
            self.n_kv,
            self.scale,
            self.eps,
        )
        return y.view(x.shape)


def _weight(norm: object) -> Tensor:
    assert isinstance(norm, KernelRMSNorm)
    return norm.norm.weight


def _packed(linear: object) -> Tensor:
    assert isinstance(linear, PackedLinear)
    return linear.packed


def can_optimize(model: nn.Module) -> bool:
    """Needs oneDNN with bf16 support, a CPU model and bf16 weights."""
    weight = next(model.parameters())
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def optimize_for_cpu(model: nn.Module, *, pack_linears: bool = True) -> None:
    """Swap in packed linears and, where available, the compiled kernels (in place).
    ``pack_linears`` False: plain linears stay (a model to train: packed ones have no
    gradient; the kernels here are trainable, see ``models/reference_grad.py``)."""
    kernels = cpu_kernels()
    if pack_linears:
        _swap(model, nn.Linear, lambda m: PackedLinear(m, kernels))
    if kernels is None:
        return
    _swap(model, RMSNorm, lambda m: KernelRMSNorm(m, kernels))
    _swap(model, GatedMLP, lambda m: KernelGatedMLP(m, kernels) if m.act in _ACTS else m)
    backend = CpuBf16Attention(kernels.prompt_attention, kernels.paged_attention, kernels.rope)
    for module in model.modules():
        if isinstance(module, Attention) and module.head_dim % 32 == 0:
            module.backend = backend
    for module in model.modules():
        if isinstance(module, LlamaBlock | Gemma3Block) and FusedDecodeLayer.applies(module):
            module.decode_kernel = FusedDecodeLayer(module, kernels)


def _swap(model: nn.Module, kind: type[nn.Module], make: Callable[[Any], nn.Module]) -> None:
    for name, module in list(model.named_modules()):
        if isinstance(module, kind):
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, make(module))
