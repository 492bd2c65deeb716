"""The CPU kernels' sources (``adapters/torch/cpu/csrc``, one file per kernel family): what
the build takes and names, checked on any machine (running them needs AVX512-BF16)."""

import os
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

from adapters.torch.cpu import kernels
from adapters.torch.cpu.build import digest

CSRC = kernels._CSRC
DECLARED = r"^(?!//)\S[^(]*?\b(\w+)\("  # a declaration's (or definition's) name


def test_every_declared_kernel_is_registered_once_as_a_torch_op() -> None:
    """Each kernel of kernels.h is ``torch.ops.infer.<name>_bf16`` (no pybind11 module), and
    :func:`cpu_kernels` names every one of them."""
    declared = re.findall(DECLARED, (CSRC / "kernels.h").read_text(), re.M)
    text = (CSRC / "bindings.cpp").read_text()
    assert "PYBIND11_MODULE" not in text
    bound = re.findall(r'm\.def\(\s*"(\w+)\(.*?&(\w+)\);', text, re.S)
    assert all(op == f"{fn}_bf16" for op, fn in bound), bound
    assert sorted(fn for _, fn in bound) == sorted(declared) == sorted(kernels.OPS)
    # attention, write_rows, decode_layer retired; set_split_keys (batch invariance) added
    assert len(declared) == len(set(declared)) == 13


def test_one_torch_library_owns_the_infer_namespace() -> None:
    """One ``TORCH_LIBRARY(infer)`` over both builds; every other file adds a fragment."""
    csrc = CSRC.parent
    owners = [p for p in csrc.glob("*/*.cpp") if "TORCH_LIBRARY(infer," in p.read_text()]
    assert [p.relative_to(csrc).as_posix() for p in owners] == ["portable/paged_attention.cpp"]
    for path in csrc.glob("*/*.cpp"):
        assert "PYBIND11_MODULE" not in path.read_text(), path


def test_each_kernel_is_defined_in_exactly_one_source() -> None:
    header = (CSRC / "kernels.h").read_text()
    declared = re.findall(DECLARED, header, re.M)
    sources = {p.name: p.read_text() for p in CSRC.glob("*.cpp")}
    for name in declared:
        defined = [
            f for f, text in sources.items() if re.search(rf"^(?!//)\S[^(]*?\b{name}\(", text, re.M)
        ]
        defined = [f for f in defined if f != "bindings.cpp"]
        assert len(defined) == 1, (name, defined)


def test_the_build_name_changes_with_any_source_or_header(tmp_path: Path) -> None:
    copy = tmp_path / "csrc"
    shutil.copytree(CSRC, copy)
    files = sorted(copy.iterdir())
    flags = list(kernels.CFLAGS)
    before = digest(files, flags)
    assert before == digest(files, flags)
    assert digest(files, [*flags, "-mavx2"]) != before
    for name in ("common.h", "gemm.cpp"):
        path = copy / name
        path.write_text(path.read_text() + "\n// changed\n")
        after = digest(files, flags)
        assert after != before
        before = after


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
@pytest.mark.skipif(
    not os.environ.get("INFER_CHECK_KERNEL_SOURCES"),
    reason="~1 min a file: set INFER_CHECK_KERNEL_SOURCES=1 (for CPUs that cannot run them)",
)
@pytest.mark.parametrize("source", sorted(p.name for p in CSRC.glob("*.cpp")))
def test_each_source_compiles_with_the_kernel_flags(source: str) -> None:
    """Syntax and types (``-fsyntax-only``) with the flags the build uses, so a machine
    without AVX512-BF16 still checks the kernels' code."""
    from torch.utils.cpp_extension import include_paths

    includes = [*include_paths(), sysconfig.get_paths()["include"]]
    command = [
        "c++",
        "-fsyntax-only",
        "-std=c++20",
        "-DTORCH_EXTENSION_NAME=infer_cpu_decode_check",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        *(f"-isystem{path}" for path in includes),
        *kernels.CFLAGS,
        str(CSRC / source),
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
