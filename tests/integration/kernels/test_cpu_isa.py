"""INFER_CPU_ISA: the flags the CPU kernels are built and chosen for (adapters/torch/cpu/isa.py)."""

import pytest

from adapters.torch.cpu import isa
from domain.errors import InvalidParameterError

CPUINFO = """processor\t: 0
model name\t: Some CPU
flags\t\t: fpu sse2 avx2 fma f16c avx512f avx512bw avx512_bf16 avx512_vnni amx_tile
processor\t: 1
flags\t\t: fpu
"""


@pytest.fixture(autouse=True)
def fake_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(isa, "cpuinfo", lambda: CPUINFO)
    isa.cpu_flags.cache_clear()
    yield
    isa.cpu_flags.cache_clear()


def test_native_is_every_flag_of_the_first_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("INFER_CPU_ISA", raising=False)
    assert isa.cpu_flags() == {
        "fpu", "sse2", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16",
        "avx512_vnni", "amx_tile",
    }  # fmt: skip


def test_avx2_caps_away_avx512_and_amx(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFER_CPU_ISA", "AVX2")
    assert isa.cpu_flags() == {"fpu", "sse2", "avx2", "fma", "f16c"}


def test_an_unknown_cap_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFER_CPU_ISA", "avx9")
    with pytest.raises(InvalidParameterError, match="INFER_CPU_ISA: must be one of native, avx2"):
        isa.cpu_flags()
