"""Decode attention read through block tables, as one Triton kernel (no gather, no mask).

One program per (decode row, KV head) walks the row's visible keys in tiles of
``TILE`` positions: each key's block comes from the row's table, the scores of the
head's ``G`` query heads (grouped-query attention) are taken against the tile in float32,
and an online softmax accumulates the values, as flash decoding does. Every shape it
sees is fixed by the pool and the tables' width, so the launch can be captured in a CUDA
graph; the keys it reads are bounded by each row's length, read from the device.

The contract is ``attention_backend.PagedKernel``'s: ``q`` ``[R, H, 1, D]``,
``k_pool, v_pool`` ``[blocks, Hkv, block_size, D]``, ``tables`` ``[R, max_blocks]`` int32,
``lengths`` ``[R]`` (row ``r`` sees keys ``< lengths[r]``, only the last ``window`` of them
where ``window`` > 0), ``scale`` -> ``[R, H, 1, D]`` in ``q``'s dtype.
"""

from typing import Any

import torch
from torch import Tensor, nn

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only machine: the layers gather their blocks
    triton = None


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _paged_decode(
        q_ptr,
        k_ptr,
        v_ptr,
        tables_ptr,
        lengths_ptr,
        out_ptr,
        scale,
        window,
        stride_qr,
        stride_qh,
        stride_kb,
        stride_kh,
        stride_ks,
        stride_tr,
        stride_or,
        stride_oh,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        DIM_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        TILE: tl.constexpr,
    ) -> None:
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        length = tl.load(lengths_ptr + row).to(tl.int32)
        start = 0
        if window > 0:
            start = tl.maximum(length - window, 0)
        groups = tl.arange(0, GROUP_PAD)
        dims = tl.arange(0, DIM_PAD)
        heads = kv_head * GROUP + groups
        group_ok = groups < GROUP
        dim_ok = dims < HEAD_DIM
        q = tl.load(
            q_ptr + row * stride_qr + heads[:, None] * stride_qh + dims[None, :],
            mask=group_ok[:, None] & dim_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        q = q * scale
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        s = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
        keys = tl.arange(0, TILE)
        first = (start // TILE) * TILE
        for tile in tl.range(first, length, TILE):
            pos = tile + keys
            visible = (pos < length) & (pos >= start)
            block = tl.load(tables_ptr + row * stride_tr + pos // BLOCK_SIZE, mask=visible, other=0)
            at = (
                block.to(tl.int64) * stride_kb
                + kv_head * stride_kh
                + (pos % BLOCK_SIZE) * stride_ks
            )
            kv_mask = visible[:, None] & dim_ok[None, :]
            k = tl.load(k_ptr + at[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(tl.float32)
            scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [GROUP_PAD, TILE]
            scores = tl.where(visible[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            p = tl.exp(scores - m_new[:, None])
            alpha = tl.exp(m - m_new)
            v = tl.load(v_ptr + at[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            s = s * alpha + tl.sum(p, axis=1)
            m = m_new
        out = acc / s[:, None]
        tl.store(
            out_ptr + row * stride_or + heads[:, None] * stride_oh + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=group_ok[:, None] & dim_ok[None, :],
        )


def paged_decode_attention(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    tables: Tensor,
    lengths: Tensor,
    window: int,
    scale: float,
) -> Tensor:
    """See the module's contract; ``q`` may be a strided view (its last dim contiguous)."""
    assert triton is not None, "Triton is not installed"
    rows, heads, _, dim = q.shape
    _, kv_heads, block_size, _ = k_pool.shape
    if q.stride(3) != 1:
        q = q.contiguous()
    assert k_pool.stride(3) == 1 and v_pool.stride() == k_pool.stride()
    out = torch.empty((rows, heads, 1, dim), dtype=q.dtype, device=q.device)
    group = heads // kv_heads
    # keys per iteration: a power of two, the [group, tile, dim] product within ~4096 values
    tile = max(16, min(64, 4096 // (triton.next_power_of_2(group) * triton.next_power_of_2(dim))))
    kwargs: dict[str, Any] = dict(
        GROUP=group,
        GROUP_PAD=triton.next_power_of_2(group),
        HEAD_DIM=dim,
        DIM_PAD=triton.next_power_of_2(dim),
        BLOCK_SIZE=block_size,
        TILE=tile,
    )
    _paged_decode[(rows, kv_heads)](
        q,
        k_pool,
        v_pool,
        tables,
        lengths,
        out,
        scale,
        window,
        q.stride(0),
        q.stride(1),
        k_pool.stride(0),
        k_pool.stride(1),
        k_pool.stride(2),
        tables.stride(0),
        out.stride(0),
        out.stride(1),
        **kwargs,
    )
    return out


def install_paged_attention(model: nn.Module) -> bool:
    """Give every attention layer of a CUDA model the Triton paged decode kernel; False
    where Triton is missing (the layers gather their blocks)."""
    from adapters.torch.models.attention_backend import PagedDecodeAttention
    from adapters.torch.models.layers import Attention

    if triton is None:
        return False
    backend = PagedDecodeAttention(paged_decode_attention, "triton")
    for module in model.modules():
        if isinstance(module, Attention) and module.backend.paged is None:
            module.backend = backend
    return True
