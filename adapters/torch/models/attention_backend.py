"""How a model's attention layers attend, chosen once per model when its kernels are
installed (never per call by which kernel slots happen to be set).

- :class:`SdpaAttention` (the default): ``F.scaled_dot_product_attention`` over the keys, a
  paged view's blocks gathered through their tables first;
- :class:`PagedDecodeAttention`: decode rows read the block pool through their tables with a
  paged kernel (the portable CPU one, the Triton one on CUDA); prompt chunks as SDPA;
- :class:`CpuBf16Attention`: the AVX512-BF16 build's kernels for everything (decode rows
  over the pool, prompt chunks and the no-cache forward, one-pass RoPE).

A backend keeps no per-layer state: one instance serves every layer of a model (the layer
passes its head counts and scale). Every kernel takes the same arguments:
``(q [B, H, T, D], k, v, lengths, window, scale)``, the paged one
``(q [R, H, 1, D], k_pool, v_pool, tables, lengths, window, scale)``.
"""

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from adapters.torch.models.paged_kv import gather
from adapters.torch.models.reference_grad import through

Kernel = Callable[[Tensor, Tensor, Tensor, Tensor, int, float], Tensor]
PagedKernel = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, int, float], Tensor]
RopeKernel = Callable[[Tensor, Tensor, Tensor], Tensor]


class AttnLayer(Protocol):
    """What a backend reads of the layer it attends for."""

    n_heads: int
    n_kv: int
    head_dim: int
    scale: float


class MaskLike(Protocol):
    """The fields of :class:`~adapters.torch.models.layers.AttnMask` a backend reads."""

    mask: Tensor | None
    is_causal: bool
    kv_start: int
    lengths: Tensor | None
    window: int
    tables: Tensor | None
    kv_len: int
    rows: bool


class SdpaAttention:
    """SDPA over the keys (a paged view's blocks gathered first); float32 on a CPU, whose
    SDPA kernels are much slower in bf16."""

    name = "sdpa"
    paged: PagedKernel | None = None  # the decode rows' kernel over the pool, if any
    rope: RopeKernel | None = None  # a one-pass RoPE (same arguments and result as apply_rope)

    def attend(self, layer: AttnLayer, q: Tensor, k: Tensor, v: Tensor, mask: MaskLike) -> Tensor:
        """``q`` ``[B, H, T, D]``, ``k, v`` ``[B, Hkv, L, D]`` -> ``[B, H, T, D]``; or, when
        ``mask.tables`` is set, ``k, v`` one layer's block pools read through them."""
        if mask.tables is not None:
            k, v = gather(k, mask.tables, mask.kv_len), gather(v, mask.tables, mask.kv_len)
        return self.sdpa(layer, q, k, v, mask)

    @staticmethod
    def sdpa(layer: AttnLayer, q: Tensor, k: Tensor, v: Tensor, mask: MaskLike) -> Tensor:
        if mask.kv_start:
            k, v = k[:, :, mask.kv_start :], v[:, :, mask.kv_start :]
        dtype = torch.float32 if k.device.type == "cpu" else k.dtype
        y = F.scaled_dot_product_attention(
            q.to(dtype),
            k.to(dtype),
            v.to(dtype),
            attn_mask=mask.mask,
            is_causal=mask.is_causal,
            scale=layer.scale,
            enable_gqa=layer.n_kv != layer.n_heads,
        )
        return y.to(q.dtype)


class PagedDecodeAttention(SdpaAttention):
    """Decode rows through ``paged`` over the pool. A prompt chunk (one token too: the last
    of a cached prompt, an ``n`` > 1 choice's) reads its keys gathered, as every chunk does,
    so a prompt's logits round alike however it was split into chunks."""

    def __init__(self, paged: PagedKernel, name: str) -> None:
        self.kernel: PagedKernel = paged
        self.paged, self.name = paged, name

    def attend(self, layer: AttnLayer, q: Tensor, k: Tensor, v: Tensor, mask: MaskLike) -> Tensor:
        if (
            mask.tables is not None
            and mask.rows
            and q.dtype == k.dtype
            and mask.lengths is not None
        ):
            return self.kernel(q, k, v, mask.tables, mask.lengths, mask.window, layer.scale)
        return super().attend(layer, q, k, v, mask)


class CpuBf16Attention(PagedDecodeAttention):
    """The AVX512-BF16 build's kernels (bf16, head_dim a multiple of 32): decode rows over
    the pool; prompt chunks and the no-cache forward (``prompt``: rounds as for a chunk
    whatever its length) over the keys, which the kernel reads as rows of a cache; RoPE in
    one pass."""

    def __init__(self, prompt: Kernel, paged: PagedKernel, rope: RopeKernel):
        super().__init__(paged, "avx512-bf16")
        self.prompt, self.rope_kernel = prompt, rope
        # Trainable (a LoRA trainer runs the engine's kernels, reference_grad.py): RoPE and
        # the prompt kernel differentiate as their PyTorch equivalents.
        self.rope = self._rope

    def _rope(self, x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
        return through(self.rope_kernel, _rope_reference, x, cos, signed_sin)

    def attend(self, layer: AttnLayer, q: Tensor, k: Tensor, v: Tensor, mask: MaskLike) -> Tensor:
        if mask.tables is not None:
            if mask.rows and q.dtype == k.dtype and mask.lengths is not None:
                return self.kernel(q, k, v, mask.tables, mask.lengths, mask.window, layer.scale)
            k, v = gather(k, mask.tables, mask.kv_len), gather(v, mask.tables, mask.kv_len)
        if mask.lengths is not None and q.dtype == k.dtype:
            # The kernel reads rows of a cache; a chunk's own keys (a view of the
            # projection) are copied into such rows.
            if k.stride(2) != layer.head_dim or v.stride(2) != layer.head_dim:
                # (a clone: ``contiguous()`` keeps the stride of a one-key chunk's size-1 dim)
                k = k.clone(memory_format=torch.contiguous_format)
                v = v.clone(memory_format=torch.contiguous_format)
            lengths, window, scale = mask.lengths, mask.window, layer.scale
            return through(
                lambda q, k, v: self.prompt(q, k, v, lengths, window, scale),
                lambda q, k, v: self.sdpa(layer, q, k, v, mask),
                q,
                k,
                v,
            )
        return self.sdpa(layer, q, k, v, mask)


def _rope_reference(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """``layers.apply_rope`` (which imports this module): the rope kernel's gradient."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


SDPA = SdpaAttention()  # the default of every layer
