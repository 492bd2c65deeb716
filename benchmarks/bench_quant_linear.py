"""Quantized linear layers (the portable ``quant_linear`` kernel) against dense ``F.linear``,
at SmolLM2-135M's linear shapes and a few batch sizes M. Rows: F.linear float32 and
bfloat16 (dense weights), then ``quant_linear`` over int8 per-channel and int4 group-32
(with mins, like GGUF Q4_1 / Q4_K) weights, float32 activations, by both of its paths:
``int8-act`` (activations quantized per block of 32, integer dot products: int16 x against
int8 weights, int8 x against 4-bit ones) and
``dense`` (tiles dequantized to float32, then GEMM). GB/s is the weight bytes a call reads
(quantized: qweight + scales + mins) over its time. The last table gives, per shape and
format, the smallest M where the dense path is faster: the ``dense_from_rows`` to choose.

Each call reads its weights from memory, as a forward pass through a model does: calls
cycle through copies of each weight, at least 64 MiB of them, more than the CPU's caches
hold (``--warm``: one copy, which the caches keep after the first call). Usage:

    .venv/bin/python benchmarks/bench_quant_linear.py [--m 1,4,16,32,64,256] \\
        [--shapes qkv,o,gate_up,down,lm_head] [--budget 0.15] [--threads 2] [--warm]
"""

import argparse
import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from adapters.torch.cpu.portable import portable_kernels

# SmolLM2-135M: hidden 576, intermediate 1536, 9 heads + 2 x 3 KV heads of 64, vocab 49152
SHAPES = {
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}
NEVER = 1 << 30
COLD_BYTES = 64 << 20  # more than the last-level cache: every call reads from memory
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile")


def _time(fn: Callable[[int], object], budget: float) -> float:
    """Milliseconds of the fastest call ``fn(i)``, i = 0, 1, ..., of as many as fit in
    ``budget`` seconds (3-50): on a shared machine a call can wait out another process's time
    slice (several ms)."""
    start = time.perf_counter()
    fn(0)
    first = time.perf_counter() - start
    iters = max(3, min(50, int(budget / max(first, 1e-6))))
    times = []
    for i in range(1, iters + 1):
        start = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def _weights(
    n: int, k: int, seed: int
) -> dict[str, tuple[Tensor, Tensor, Tensor | None, int, int]]:
    """(qweight, scales, mins, bits, group_size) per quantized format."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "int8/ch": (
            torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8),
            (torch.rand(n, 1, generator=gen) * 0.01).half(),
            None,
            8,
            k,
        ),
        "int4/g32": (
            torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8),
            (torch.rand(n, k // 32, generator=gen) * 0.01).half(),
            (torch.randn(n, k // 32, generator=gen) * 0.01).half(),
            4,
            32,
        ),
    }


def _nbytes(*tensors: Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _copies(nbytes: int, warm: bool) -> int:
    return 1 if warm else -(-COLD_BYTES // nbytes)


def _shape_rows(
    name: str, ms: list[int], budget: float, warm: bool
) -> list[tuple[str, int, str, float, int]]:
    """(shape, M, row name, ms, weight bytes) for every row at every M."""
    n, k = SHAPES[name]
    w32 = [torch.randn(n, k) * 0.02 for _ in range(_copies(4 * n * k, warm))]
    w16 = [w.bfloat16() for w in w32[: _copies(2 * n * k, warm)]]
    # row name -> (call(x, i) on copy i, weight bytes a call reads, x's dtype)
    rows: dict[str, tuple[Callable[[Tensor, int], Tensor], int, torch.dtype]] = {
        "F.linear fp32": (lambda x, i: F.linear(x, w32[i % len(w32)]), 4 * n * k, torch.float32),
        "F.linear bf16": (lambda x, i: F.linear(x, w16[i % len(w16)]), 2 * n * k, torch.bfloat16),
    }
    kernels = portable_kernels()
    if kernels is not None:
        first = _weights(n, k, 0)
        for fmt, (q, s, mn, _, _) in first.items():
            count = _copies(_nbytes(q, s, mn), warm)
            copies = [first[fmt]] + [_weights(n, k, i)[fmt] for i in range(1, count)]
            for path, dense_from in (("int8-act", NEVER), ("dense", 1)):

                def call(x: Tensor, i: int, copies: list = copies, dense_from: int = dense_from):
                    q, s, mn, bits, group = copies[i % len(copies)]
                    return kernels.quant_linear(x, q, s, mn, bits, group, dense_from)

                rows[f"{fmt} {path}"] = (call, _nbytes(q, s, mn), torch.float32)
    out = []
    for m in ms:
        x = torch.randn(m, k)
        for row, (call, nbytes, dtype) in rows.items():
            t = _time(functools.partial(call, x.to(dtype)), budget)
            out.append((name, m, row, t, nbytes))
    return out


def _machine() -> str:
    """CPU model, threads and the vector ISA flags that matter here, from /proc/cpuinfo."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "cpu: unknown (no /proc/cpuinfo)"
    fields = dict(line.split(":", 1) for line in reversed(lines) if ":" in line)
    fields = {key.strip(): value.strip() for key, value in fields.items()}
    flags = set(fields.get("flags", "").split())
    isa = " ".join(f for f in ISA_FLAGS if f in flags) or "none of " + " ".join(ISA_FLAGS)
    model = fields.get("model name", "unknown")
    return f"cpu: {model}, {torch.get_num_threads()} threads, ISA: {isa}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--m", default="1,4,16,32,64,256", help="batch sizes (rows of x)")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--budget", type=float, default=0.15, help="seconds of timing per cell")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--warm", action="store_true", help="one copy of each weight, cached")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(_machine())
    print(
        f"torch {torch.__version__}; x float32 (F.linear bf16: x and W bfloat16); weights "
        + (
            "cached (--warm)"
            if args.warm
            else f"read from memory (copies of >= {COLD_BYTES >> 20} MiB)"
        )
    )
    ms = [int(v) for v in args.m.split(",")]
    rows = [
        r for name in args.shapes.split(",") for r in _shape_rows(name, ms, args.budget, args.warm)
    ]
    names = list(dict.fromkeys(r[2] for r in rows))
    cells = {(r[0], r[1], r[2]): (r[3], r[4]) for r in rows}
    print("\nms per call (GB/s of weights read)")
    print(" | ".join(["shape (N,K)", "M", *names]))
    for shape in dict.fromkeys(r[0] for r in rows):
        for m in ms:
            line = [f"{shape} {SHAPES[shape]}", str(m)]
            for row in names:
                t, nbytes = cells[(shape, m, row)]
                line.append(f"{t:.3f} ({nbytes / t / 1e6:.1f})")
            print(" | ".join(line))
    print("\nsmallest M where the dense path beats int8-act")
    for shape in dict.fromkeys(r[0] for r in rows):
        for fmt in ("int8/ch", "int4/g32"):
            if (shape, ms[0], f"{fmt} dense") not in cells:
                continue
            wins = [
                m
                for m in ms
                if cells[(shape, m, f"{fmt} dense")][0] < cells[(shape, m, f"{fmt} int8-act")][0]
            ]
            print(f"{shape} {fmt}: {wins[0] if wins else 'none up to ' + str(ms[-1])}")


if __name__ == "__main__":
    main()
