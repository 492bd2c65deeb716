"""oneDNN's shape caches, bounded: a server's memory must not grow with the row counts it sees.

On a CPU, torch runs bfloat16 matrix products through oneDNN (via ideep), which keeps what
it built for each distinct shape in two least-recently-used caches: oneDNN's primitive
cache (the JIT-compiled kernels, process-wide, ``ONEDNN_PRIMITIVE_CACHE_CAPACITY``) and
ideep's cache of primitive descriptors (one per OpenMP thread, ``LRU_CACHE_CAPACITY``).
Both hold 1,024 shapes by default, and an entry is large: ~0.4 MiB in the first, ~0.3 MiB
per thread in the second (a [M, 576] x [576, 480] bfloat16 product, AVX512-BF16).

The engine's steps have every row count: a step's rows are its decode rows plus the
prompt tokens it prefills, and the quantized linears' dequantized-tiles path multiplies all
of them at once (a few distinct shapes per linear and row count), as does the LM head's
dense copy. So under steady load each new row count added ~5 shapes, and the server's
resident memory climbed for as long as new row counts came, towards ~1 GiB of cached
kernels (issue 45: ~100 MB a minute with 48 streaming clients).

Bounded at :data:`PRIMITIVE_CACHE_CAPACITY` and :data:`DESCRIPTOR_CACHE_CAPACITY` the
caches take ~60 MiB at most with two threads; a step still reuses what it built within
itself (its 30 layers share a handful of shapes), and a row count met again after
eviction is rebuilt (~0.5 ms per shape). Measured in benchmarks/README.md ("Soak").

The values are environment defaults, read by oneDNN and ideep when their caches are first
used: set before the process's first oneDNN product (importing :mod:`adapters.torch` does
it); an operator's own values of the variables win.
"""

import os

# oneDNN's primitive cache: kernels, shared by every thread.
PRIMITIVE_CACHE_CAPACITY = 128
# ideep's primitive-descriptor cache, per thread: a step's own shapes fit.
DESCRIPTOR_CACHE_CAPACITY = 16

CACHE_VARIABLES = {
    "ONEDNN_PRIMITIVE_CACHE_CAPACITY": PRIMITIVE_CACHE_CAPACITY,
    "LRU_CACHE_CAPACITY": DESCRIPTOR_CACHE_CAPACITY,
}


def bound_onednn_caches() -> dict[str, str]:
    """Set the caches' capacities in the environment where not set already; returns the
    variables as they are now. Takes effect only before oneDNN's first product in this
    process (the caches are sized once)."""
    for name, capacity in CACHE_VARIABLES.items():
        os.environ.setdefault(name, str(capacity))
    return {name: os.environ[name] for name in CACHE_VARIABLES}
