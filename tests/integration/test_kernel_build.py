"""Kernel builds are keyed by content, not by checkout path (adapters/torch/cpu/build.py):
a second checkout with the same sources reuses the first one's build."""

import os
import shutil
from pathlib import Path

import pytest

from adapters.torch.cpu import portable
from adapters.torch.cpu.build import build_extension, digest, kernel_cache_dir


def test_the_digest_follows_content_and_flags_not_paths(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for folder in (a, b):
        shutil.copytree(portable._SOURCES, folder)
    files_a, files_b = sorted(a.iterdir()), sorted(b.iterdir())
    assert digest(files_a, ["-O3"]) == digest(files_b, ["-O3"])
    assert digest(files_a, ["-O3"]) != digest(files_a, ["-O2"])
    (b / "paged_attention.cpp").write_text("// another kernel\n")
    assert digest(files_a, ["-O3"]) != digest(files_b, ["-O3"])


def test_a_second_checkout_reuses_the_build(tmp_path: Path) -> None:
    if portable.portable_kernels() is None:
        pytest.skip("no C++ toolchain here")
    flags = ["-O3", "-fopenmp", *portable._isa_flags()]
    files = sorted(p for p in portable._SOURCES.iterdir() if p.suffix in (".cpp", ".h"))
    folder = kernel_cache_dir() / f"infer_cpu_portable_{digest(files, flags)}"
    library = folder / f"{folder.name}.so"
    built = library.stat().st_mtime_ns
    elsewhere = tmp_path / "another-checkout" / "portable"
    shutil.copytree(portable._SOURCES, elsewhere)
    build_extension("infer_cpu_portable", elsewhere, flags, python_module=False, what="test")
    assert library.stat().st_mtime_ns == built  # not rebuilt
    assert sorted(p.name for p in (folder / "src").iterdir()) == [p.name for p in files]


@pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None
    or os.environ.get("INFER_CPU_KERNELS", "1") == "0",
    reason="no C++ compiler (or the kernels are turned off)",
)
def test_the_portable_kernels_build_where_a_compiler_exists() -> None:
    """A compile error must fail here, not turn every kernel test into a skip."""
    from adapters.torch.cpu.portable import portable_kernels

    kernels = portable_kernels()
    assert kernels is not None
    assert {"paged_attention", "quant_linear", "quant_decode_layer"} <= set(vars(kernels))
