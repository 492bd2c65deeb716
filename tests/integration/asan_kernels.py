"""Run by test_kernel_asan.py in a subprocess with libasan preloaded: the portable kernels
(quant_linear.cpp, paged_attention.cpp) built with -fsanitize=address under their own op
namespace, then called over every weight format, path and activation layout, row count and
tail length the hand-written vector loops branch on. AddressSanitizer aborts the process at
the first read or write outside an allocation; "ok N" on the last line means none.

    LD_PRELOAD=$(gcc -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0 \\
        python -m tests.integration.asan_kernels [--avx2]
"""

import sys
import tempfile
from pathlib import Path

import torch

from adapters.torch.cpu.build import build_extension
from adapters.torch.cpu.portable import _SOURCES, _isa_flags
from tests.integration.test_quant_kernel import random_weight

AVX2 = ["-mavx2", "-mfma", "-mf16c"]


def build(source: str, namespace: str, flags: list[str], into: Path) -> None:
    text = (_SOURCES / source).read_text()
    for old in ("TORCH_LIBRARY_FRAGMENT(infer_portable", "TORCH_LIBRARY(infer_portable"):
        text = text.replace(old, f"TORCH_LIBRARY({namespace}")
    folder = into / namespace
    folder.mkdir(parents=True)
    (folder / source).write_text(text)
    build_extension(namespace, folder, flags, python_module=False, what=f"{source} with ASan")


def quant_linear_calls() -> int:
    op = torch.ops.infer_asan_ql.quant_linear
    calls = 0
    for bits, group in ((4, 32), (4, 64), (8, 32), (8, 16), (8, 0)):
        for k in (32, 64, 96, 128, 160, 224, 288, 576, 608):
            g = group or k
            if k % g:
                continue
            for mins in (True, False):
                q, s, m = random_weight(13, k, bits, g, mins, seed=k)
                for rows in (1, 2, 3, 4, 5, 7, 9):
                    for dtype in (torch.float32, torch.bfloat16):
                        x = torch.randn(rows, k).to(dtype)
                        for switch in (1, 1 << 30):
                            op(x, q, s, m, bits, g, switch)
                            calls += 1
    return calls


def paged_attention_calls() -> int:
    op = torch.ops.infer_asan_pa.paged_attention
    calls, size = 0, 16
    for heads, kv_heads, dim in ((9, 3, 64), (4, 1, 128), (8, 8, 32), (6, 2, 48)):
        for lengths in ([1], [16], [17], [37, 1, 20, 64], [300]):
            for window in (0, 6, 100):
                for dtype in (torch.float32, torch.bfloat16):
                    blocks = [-(-n // size) for n in lengths]
                    total = sum(blocks) + 2
                    k_pool = torch.randn(total, kv_heads, size, dim).to(dtype)
                    v_pool = torch.randn(total, kv_heads, size, dim).to(dtype)
                    order = torch.randperm(total)
                    tables = torch.zeros(len(lengths), max(blocks), dtype=torch.int32)
                    at = 0
                    for i, b in enumerate(blocks):
                        tables[i, :b] = order[at : at + b]
                        at += b
                    q = torch.randn(len(lengths), heads, 1, dim).to(dtype)
                    op(q, k_pool, v_pool, tables, torch.tensor(lengths), window, 0.1)
                    calls += 1
    return calls


def main() -> None:
    isa = AVX2 if "--avx2" in sys.argv else _isa_flags()
    flags = ["-O1", "-g", "-fopenmp", "-fsanitize=address", "-fno-omit-frame-pointer", *isa]
    with tempfile.TemporaryDirectory() as tmp:
        build("quant_linear.cpp", "infer_asan_ql", flags, Path(tmp))
        build("paged_attention.cpp", "infer_asan_pa", flags, Path(tmp))
        print("ok", quant_linear_calls() + paged_attention_calls())


if __name__ == "__main__":
    main()
