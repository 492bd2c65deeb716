"""Memory sizes as ``infer serve`` takes them (``--kv-cache-memory``, ``--dense-weights-memory``):
a size with its unit or a fraction of the memory there is, parsed and printed; and what
``auto`` means on each device. Pure: the config tree reads it without torch."""

import re
from dataclasses import dataclass

MIB = 1 << 20
UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)")


@dataclass(frozen=True)
class KVCacheMemory:
    """A KV budget: ``nbytes`` bytes, or ``fraction`` of the memory there is (one of them)."""

    nbytes: int | None = None
    fraction: float | None = None

    def __post_init__(self) -> None:
        if (self.nbytes is None) == (self.fraction is None):
            raise ValueError("give bytes or a fraction, one of them")
        if self.nbytes is not None and self.nbytes < 1:
            raise ValueError(f"{self.nbytes} bytes: must be >= 1")
        if self.fraction is not None and not 0 < self.fraction <= 1:
            raise ValueError(f"fraction {self.fraction}: must be in (0, 1]")

    def __str__(self) -> str:
        return f"{self.fraction:g}" if self.fraction is not None else human_size(self.nbytes or 0)


def parse_kv_cache_memory(text: str) -> KVCacheMemory:
    """``512MiB``, ``4GiB``, ``2GB`` (units: B, KB/MB/GB/TB = powers of 1000, KiB/MiB/GiB/TiB
    = powers of 1024, any case), plain integer bytes, or a fraction ``0 < x <= 1`` (``0.9``;
    a number without a unit up to 1 is a fraction). ValueError says what is wrong."""
    match = _SIZE.fullmatch(text.strip().lower())
    forms = "a size (512MiB, 4GiB, 2GB, bytes) or a fraction in (0, 1]"
    if match is None:
        raise ValueError(f"{text!r} is not {forms}")
    number, unit = match.groups()
    if unit not in UNITS:
        known = "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
        raise ValueError(f"{text!r}: unknown unit {unit!r} (units: {known})")
    value = float(number)
    if not unit and value <= 1:
        if value == 0:
            raise ValueError(f"{text!r} is not {forms}")
        return KVCacheMemory(fraction=value)
    if not unit and not value.is_integer():
        raise ValueError(f"{text!r}: a fraction must be in (0, 1], a size whole bytes")
    nbytes = int(value * UNITS[unit])
    if nbytes < 1:
        raise ValueError(f"{text!r} is not {forms}")
    return KVCacheMemory(nbytes=nbytes)


def human_size(nbytes: float) -> str:
    """``nbytes`` in the largest binary unit it reaches: ``1.5 GiB``, ``16.0 KiB``."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", MIB), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{nbytes:.0f} bytes"


# --dense-weights-memory auto: bf16 panel copies of a quantized model's weights (for steps of
# many rows) up to this size and this share of the memory available at load (SmolLM2-135M's
# take 256 MiB; a 1B model's 2 GiB fit where 16 GiB are available: its 16 streams 1.18 ->
# 1.60x llama-server's on Q4_K_M; a 3B model's ~6 GiB do not fit: it stays quantized).
PANELS_AUTO_MAX = 4 << 30


PANELS_AUTO_SHARE = 0.125


# ``--kv-cache-memory auto`` (infer serve's default): vLLM's --gpu-memory-utilization default
# on CUDA; on a CPU a quarter of the memory available at start-up, at most vLLM's CPU KV
# space default (VLLM_CPU_KVCACHE_SPACE, 4 GiB). On a CPU the pool's pages become resident
# only as blocks are first written.
AUTO = "auto"


CUDA_AUTO_FRACTION = 0.9


CPU_AUTO_FRACTION = 0.25


CPU_AUTO_CAP = 4 << 30
