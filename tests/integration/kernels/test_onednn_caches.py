"""oneDNN's shape caches are bounded (issue 45): a server's steps have every row count, and
each bfloat16 product of a new shape cached its kernels and descriptors (~0.7 MiB), up to
1,024 shapes per cache, so the resident memory of a server under steady load kept
climbing. Importing :mod:`adapters.torch` bounds them (:mod:`adapters.torch.cpu.onednn`).

The growth is measured in a fresh process (the caches are sized once per process, at
first use) as glibc's heap in use, over two runs of 200 new row counts each: before the
bound each run grew it by ~125 MiB; with it the first fills the caches (~50 MiB) and the
second adds nothing (on a CPU whose bfloat16 products go through oneDNN; elsewhere they
do not, and nothing grows either way)."""

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest

from adapters.torch.cpu import onednn

ROOT = Path(__file__).resolve().parents[3]

# The engine's way in (its package imported first), then products of 2 x 200 row counts.
GROWTH = """
import ctypes
import adapters.torch  # noqa: F401  (bounds the caches)
import torch


class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
        "uordblks", "fordblks", "keepcost")]


libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2


def heap() -> int:
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


torch.set_num_threads(1)
weight = torch.randn(480, 576, dtype=torch.bfloat16)
torch.mm(torch.randn(8, 576, dtype=torch.bfloat16), weight.t())
marks = [heap()]
for first in (16, 216):
    for rows in range(first, first + 200):
        torch.mm(torch.randn(rows, 576, dtype=torch.bfloat16), weight.t())
    marks.append(heap())
print((marks[1] - marks[0]) / 2**20, (marks[2] - marks[1]) / 2**20)
"""


def _has_mallinfo2() -> bool:
    try:
        return hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2")
    except OSError:
        return False


@pytest.mark.skipif(not _has_mallinfo2(), reason="glibc's mallinfo2 measures the heap")
def test_products_of_many_row_counts_keep_the_heap_bounded() -> None:
    env = {k: v for k, v in os.environ.items() if k not in onednn.CACHE_VARIABLES}
    run = subprocess.run(
        [sys.executable, "-c", GROWTH],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    first, second = map(float, run.stdout.split()[-2:])
    assert second < 10, f"the heap grew {first:.0f}, then {second:.0f} MiB per 200 row counts"


def test_the_bounds_are_defaults_an_operator_may_override(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "4")
    assert onednn.bound_onednn_caches() == {
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(onednn.PRIMITIVE_CACHE_CAPACITY),
        "LRU_CACHE_CAPACITY": "4",
    }
