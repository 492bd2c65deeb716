"""The CPU's vector ISA flags as the kernels are built and chosen for, from /proc/cpuinfo.

``INFER_CPU_ISA=avx2`` caps them at AVX2 (no AVX-512 subset, no AMX): the kernels are built
and chosen as on an AVX2-only CPU, to compare paths side by side on a newer machine (set
torch's own caps with it for the rest: ``ATEN_CPU_CAPABILITY=avx2``,
``ONEDNN_MAX_CPU_ISA=AVX2``). Unset or ``native``: everything this CPU has.
"""

import functools
import os
from pathlib import Path

from domain.errors import InvalidParameterError

CAPS = ("native", "avx2")


def cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The first CPU's flags, less those ``INFER_CPU_ISA`` caps away."""
    flags: set[str] = set()
    for line in cpuinfo().splitlines():
        if line.split(":", 1)[0].strip() in ("flags", "Features"):
            flags = set(line.split(":", 1)[1].split())
            break
    cap = os.environ.get("INFER_CPU_ISA", "native").strip().lower() or "native"
    if cap not in CAPS:
        raise InvalidParameterError(
            "INFER_CPU_ISA", f"must be one of {', '.join(CAPS)}, got {cap!r}"
        )
    if cap == "avx2":
        flags = {f for f in flags if not f.startswith(("avx512", "amx"))}
    return frozenset(flags)
