"""How many KV blocks fit a memory budget (``infer serve --kv-cache-memory``), vLLM-style.

The budget is a size (``512MiB``, ``4GiB``, ``2GB``, plain bytes) or a fraction ``0 < x <=
1``: on CUDA, vLLM's ``--gpu-memory-utilization`` (the process may use ``x`` of the device's
total memory in all: the KV pool gets ``x * total`` minus what torch has allocated already,
the weights included); on CPU, ``x`` of the memory available now (``MemAvailable``). A block
holds ``block_size`` positions of keys and values for every layer and KV head, in the
model's dtype (:class:`~adapters.torch.models.paged_kv.PagedKVCache`'s layout). The forward's
activations come on top of the pool: leave them room.
"""

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from adapters.torch.models.config import ModelConfig
from domain.config import EngineConfig
from domain.errors import InvalidParameterError
from domain.memory import (
    AUTO,
    CPU_AUTO_CAP,
    CPU_AUTO_FRACTION,
    CUDA_AUTO_FRACTION,
    PANELS_AUTO_MAX,
    PANELS_AUTO_SHARE,
    KVCacheMemory,
    human_size,
)

MEMINFO = Path("/proc/meminfo")


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Keys and values of ``block_size`` positions for every layer and KV head."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * config.num_kv_heads * block_size * config.head_dim * itemsize


@dataclass(frozen=True)
class DeviceMemory:
    """``total``: what a fraction is of; ``used``: what this process holds of it already;
    ``available``: what a new allocation may take now. On CPU, the memory available now
    is both ``total`` and ``available``, and ``used`` is 0."""

    total: int
    used: int
    available: int


def cpu_available_memory() -> int:
    """Bytes of memory available now: ``MemAvailable`` of ``/proc/meminfo``, else psutil's,
    else free pages (``os.sysconf``)."""
    try:
        for line in MEMINFO.read_text().splitlines():
            name, _, rest = line.partition(":")
            if name == "MemAvailable":
                return int(rest.split()[0]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def auto_panels_memory() -> int:
    """``--dense-weights-memory auto``'s bytes: :data:`PANELS_AUTO_SHARE` of the memory
    available now, at most :data:`PANELS_AUTO_MAX`."""
    return min(PANELS_AUTO_MAX, int(PANELS_AUTO_SHARE * cpu_available_memory()))


def device_memory(device: torch.device) -> DeviceMemory:
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        allocated = torch.cuda.memory_allocated(device)
        reclaimable = torch.cuda.memory_reserved(device) - allocated  # torch's cache
        return DeviceMemory(total=total, used=allocated, available=free + reclaimable)
    available = cpu_available_memory()
    return DeviceMemory(total=available, used=0, available=available)


def kv_budget(memory: KVCacheMemory, device: DeviceMemory) -> int:
    """Bytes the KV pool may take: the size given, or ``fraction * total - used``; an
    :class:`InvalidParameterError` (``kv_cache_memory``) when that is nothing or more than
    is available."""
    if memory.nbytes is not None:
        budget = memory.nbytes
    else:
        assert memory.fraction is not None
        budget = int(memory.fraction * device.total) - device.used
        if budget <= 0:
            raise InvalidParameterError(
                "kv_cache_memory",
                f"{memory} of {human_size(device.total)} leaves nothing for the KV cache: "
                f"{human_size(device.used)} are in use already",
            )
    if budget > device.available:
        raise InvalidParameterError(
            "kv_cache_memory",
            f"{memory} asks {human_size(budget)} for the KV cache, but only "
            f"{human_size(device.available)} are available",
        )
    return budget


@dataclass(frozen=True)
class KVSizing:
    """The KV pool an engine runs with, and the engine configuration that says so."""

    config: EngineConfig
    bytes_per_block: int

    @property
    def num_blocks(self) -> int:
        return self.config.kv_blocks

    @property
    def memory_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def max_concurrency(self) -> int:
        """Requests of ``max_model_len`` positions the pool holds at once."""
        return self.num_blocks // self.config.blocks_per_sequence


def auto_kv_cache_memory(device: torch.device, measured: DeviceMemory) -> KVCacheMemory:
    """The budget ``auto`` stands for on ``device`` (its memory as ``measured``)."""
    if device.type == "cuda":
        return KVCacheMemory(fraction=CUDA_AUTO_FRACTION)
    return KVCacheMemory(
        nbytes=max(1, min(int(CPU_AUTO_FRACTION * measured.available), CPU_AUTO_CAP))
    )


def size_kv_cache(
    engine: EngineConfig,
    model: ModelConfig,
    dtype: torch.dtype,
    memory: KVCacheMemory | str | None = None,
    device: torch.device | str = "cpu",
    measured: DeviceMemory | None = None,
) -> KVSizing:
    """``engine`` with ``num_kv_blocks`` as many blocks as ``memory`` (or :data:`AUTO`)
    holds on ``device`` (its memory as ``measured``, else measured now); without
    ``memory``, ``engine`` as it is. Too small a budget for one request of ``max_model_len``
    positions: an :class:`InvalidParameterError` naming ``kv_cache_memory`` and the minimum."""
    per_block = bytes_per_block(model, engine.kv_block_size, dtype)
    if memory is None:
        return KVSizing(engine, per_block)
    if engine.num_kv_blocks is not None:
        raise InvalidParameterError("kv_cache_memory", "give it or num_kv_blocks, not both")
    measured = measured or device_memory(torch.device(device))
    if memory == AUTO:
        memory = auto_kv_cache_memory(torch.device(device), measured)
    assert isinstance(memory, KVCacheMemory)
    budget = kv_budget(memory, measured)
    blocks = budget // per_block
    needed = engine.blocks_per_sequence
    if blocks < needed:
        raise InvalidParameterError(
            "kv_cache_memory",
            f"{human_size(budget)} hold {blocks} KV blocks of {engine.kv_block_size} "
            f"positions ({per_block} bytes each); one request of max_model_len = "
            f"{engine.max_model_len} positions needs {needed} blocks: "
            f"{human_size(needed * per_block)} at least",
        )
    return KVSizing(dataclasses.replace(engine, num_kv_blocks=blocks), per_block)
