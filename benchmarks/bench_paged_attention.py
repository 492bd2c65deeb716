"""Decode attention over a paged KV cache against the contiguous slot cache, one layer of
SmolLM2-135M's shape (9 heads, 3 KV heads, head_dim 64), at a few batch sizes and context
lengths. Rows: the compiled CPU kernel (``paged_attention`` through block tables, bf16;
where AVX512-BF16 is available; its contiguous ``attention`` retired with the contiguous
cache in issue 29 part 5), the
portable paged kernel the runner installs on any CPU with a compiler
(``adapters/torch/cpu/csrc/portable``, any dtype), and the PyTorch path (SDPA over the
contiguous slots vs SDPA over blocks gathered through the tables; the CUDA path when
``--device cuda``). Blocks are handed out in a scrambled order, as a
long-running server's pool would be. Usage:

    .venv/bin/python benchmarks/bench_paged_attention.py [--batch 1,16,64] \\
        [--context 128,512,2048] [--dtype bfloat16] [--device cpu] [--iters 50]
"""

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from adapters.torch.cpu.kernels import for_bf16_cpu
from adapters.torch.cpu.portable import portable_kernels
from adapters.torch.models.paged_kv import block_tables, gather

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16


def _time(fn: Callable[[], object], iters: int, device: str) -> float:
    """Median milliseconds per call."""
    fn()
    times = []
    for _ in range(iters):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def _case(batch: int, context: int, dtype: torch.dtype, device: str, iters: int) -> dict:
    gen = torch.Generator().manual_seed(batch * 7 + context)
    blocks_per_row = -(-context // BLOCK)
    num_blocks = batch * blocks_per_row
    k_pool, v_pool = torch.randn(2, num_blocks, KV_HEADS, BLOCK, DIM, generator=gen).to(
        device, dtype
    )
    order = torch.randperm(num_blocks, generator=gen).view(batch, blocks_per_row).tolist()
    tables = block_tables(order, device)
    lengths = torch.full((batch,), context, device=device)
    # The same keys as contiguous slots [B, Hkv, max_len, D]
    k_slots = gather(k_pool, tables, context).contiguous()
    v_slots = gather(v_pool, tables, context).contiguous()
    q = torch.randn(batch, 1, HEADS, DIM, generator=gen).to(device, dtype).transpose(1, 2)
    scale = DIM**-0.5

    def sdpa(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        compute = torch.float32 if device == "cpu" else dtype
        return F.scaled_dot_product_attention(
            q.to(compute), k.to(compute), v.to(compute), scale=scale, enable_gqa=True
        )

    row = {
        "batch": batch,
        "context": context,
        "torch contiguous ms": _time(lambda: sdpa(k_slots, v_slots), iters, device),
        "torch paged (gather) ms": _time(
            lambda: sdpa(gather(k_pool, tables, context), gather(v_pool, tables, context)),
            iters,
            device,
        ),
    }
    portable = portable_kernels() if device == "cpu" else None
    if portable is not None:
        row["portable paged ms"] = _time(
            lambda: portable.paged_attention(q, k_pool, v_pool, tables, lengths, 0, scale),
            iters,
            device,
        )
    kernels = for_bf16_cpu(k_pool)
    if kernels is not None:
        row["kernel paged ms"] = _time(
            lambda: kernels.paged_attention(q, k_pool, v_pool, tables, lengths, 0, scale),
            iters,
            device,
        )
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch", default="1,16,64")
    p.add_argument("--context", default="128,512,2048")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cpu")
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    rows = [
        _case(b, c, dtype, args.device, args.iters)
        for b in map(int, args.batch.split(","))
        for c in map(int, args.context.split(","))
    ]
    from benchmarks.bench_serving import machine_line

    print(machine_line())
    print(f"{args.dtype}, {HEADS} heads, {KV_HEADS} KV heads, head_dim {DIM}, blocks of {BLOCK}")
    columns = list(rows[0])
    print(" | ".join(columns))
    for row in rows:
        print(
            " | ".join(
                f"{row[c]:.3f}" if isinstance(row[c], float) else str(row[c]) for c in columns
            )
        )


if __name__ == "__main__":
    main()
