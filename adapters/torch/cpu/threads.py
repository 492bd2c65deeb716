"""``--threads``: the intra-op threads torch and the kernels' OpenMP loops use.

The default is every CPU this process may run on (its affinity mask, which a container's
CPU set or ``taskset`` narrows; ``os.cpu_count()`` would count the host's). Measured on a
2-vCPU machine (benchmarks/README.md, "Threads"): both threads for the engine beat one,
though the event loop, the HTTP server and the tokenizer threads share the same two CPUs:
a decode step is a few milliseconds of work split across threads, and the loop's work
between steps is small beside it.
"""

import os

import structlog
import torch

from domain.errors import InvalidParameterError

log = structlog.get_logger(__name__)


def available_cpus() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def set_threads(threads: int | None) -> int:
    """Use ``threads`` intra-op threads (None: :func:`available_cpus`); returns the count."""
    if threads is not None and threads < 1:
        raise InvalidParameterError("threads", f"must be at least 1, got {threads}")
    count = threads or available_cpus()
    if count != torch.get_num_threads():
        torch.set_num_threads(count)
    log.debug("threads", intra_op=count, cpus=available_cpus())
    return count
