"""Choices made by measurement on the CPU at hand: which dtype the linears run fastest in,
and, per weight format (int4, int8) and activation dtype, from how many rows the quantized
kernel switches from integer dot products to dequantized tiles and a GEMM.

CPUs differ more than their names suggest: on one AVX512-BF16 Xeon a bf16 GEMM ran at half
float32's rate, on a Zen 5 at four times it, and on an AVX2 EPYC bf16 is emulated. So on
first use for a model's shapes a micro-benchmark (a few seconds) times every path this
machine has on the model's linear shapes at 1, 16 and 64 rows (the quantized paths at 1 to 64,
in float32 and in the chosen dtype: a bfloat16 tile GEMM is 3x float32's on a Zen 5, so the
int4 switch moves from 128 rows to 32 there), and the result is cached per
CPU, torch version, thread count and shape set under ``<cache>/tuning/``. ``infer
build-kernels`` (``make setup``) measures the default model's shapes ahead, so that its
first start reads them; ``infer bench-kernels`` prints the table and the choices.
"""

import functools
import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import structlog
import torch
import torch.nn.functional as F
from torch import Tensor

from adapters.torch.cpu.build import kernel_cache_dir
from adapters.torch.cpu.isa import cpu_flags, cpuinfo
from adapters.torch.cpu.portable import portable_kernels
from adapters.torch.models.config import ModelConfig

log = structlog.get_logger(__name__)
ROWS = (1, 16, 64)  # one decode stream, a small batch, a full batch
SWITCH_ROWS = (2, 4, 8, 16, 32, 64)  # candidates for the quantized kernel's switch
# 2: switches per weight format and activation dtype; 3: a switch needs two row counts
# in a row (one measured under another process's load chose 2 rows instead of 64)
VERSION = 3


@dataclass(frozen=True)
class Tuning:
    """What was measured (``timings``: path -> rows -> ms summed over the shapes) and
    chosen: ``dtype`` for the dense model; ``dense_from_rows`` for the quantized kernel,
    ``"int4 bfloat16"`` (weight format, activation dtype) -> rows (None where the kernel is
    not built)."""

    cpu: str
    shapes: list[tuple[int, int]]
    timings: dict[str, dict[str, float]]
    dtype: str
    dense_from_rows: dict[str, int] | None
    reason: str

    def switch(self, bits: int, dtype: str) -> int | None:
        """The quantized kernel's switch for ``bits``-bit weights and ``dtype`` activations
        (float32's where ``dtype`` was not measured)."""
        if self.dense_from_rows is None:
            return None
        found = self.dense_from_rows.get(f"int{bits} {dtype}")
        return found if found is not None else self.dense_from_rows.get(f"int{bits} float32")


def cpu_name() -> str:
    for line in cpuinfo().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return os.uname().machine


def isa_flags() -> list[str]:
    flags = cpu_flags()
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "asimd")
    return [flag for flag in wanted if flag in flags]


def linear_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    """(out, in) of a layer's fused linears and of the LM head."""
    c = config
    return [
        (c.q_size + 2 * c.kv_size, c.hidden_size),
        (c.hidden_size, c.q_size),
        (2 * c.intermediate_size, c.hidden_size),
        (c.hidden_size, c.intermediate_size),
        (c.vocab_size, c.hidden_size),
    ]


def tuning_path(shapes: list[tuple[int, int]]) -> Path:
    """Where the tuning of these shapes on this CPU, torch and thread count is cached."""
    key = json.dumps(
        [VERSION, cpu_name(), isa_flags(), torch.__version__, torch.get_num_threads(), shapes]
    )
    name = hashlib.sha256(key.encode()).hexdigest()[:16]
    return kernel_cache_dir().parent / "tuning" / f"{name}.json"


_read: dict[Path, Tuning] = {}  # this process's tunings by file: read (and logged) once


def tuned(shapes: list[tuple[int, int]], *, force: bool = False) -> Tuning:
    """The cached tuning for these linear shapes ``(out, in)``, measured first if none."""
    path = tuning_path(shapes)
    if not force and path in _read:
        return _read[path]
    if not force and path.is_file():
        try:
            data = json.loads(path.read_text())
            data["shapes"] = [tuple(s) for s in data["shapes"]]
            tuning = _read[path] = Tuning(**data)
        except (OSError, ValueError, TypeError):
            pass  # measured again below
        else:
            return _logged("kernel paths read from this CPU's measurement", tuning, path)
    log.info(
        "measuring this CPU's kernel paths for the model's shapes, once "
        "(`infer build-kernels` does it ahead)",
        shapes=len(shapes),
    )
    tuning = _read[path] = measure(shapes)
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_suffix(f".{os.getpid()}.tmp")
    scratch.write_text(json.dumps(asdict(tuning), indent=1))
    os.replace(scratch, path)
    return _logged("kernel paths chosen", tuning, path)


def _logged(message: str, tuning: Tuning, path: Path) -> Tuning:
    """``tuning``, once logged as the paths in use (and where they are cached)."""
    log.info(message, dtype=tuning.dtype, dense_from_rows=tuning.dense_from_rows, cached=str(path))
    return tuning


def measure(shapes: list[tuple[int, int]]) -> Tuning:
    """Time each path on ``shapes`` and choose: the dense dtypes first, then the quantized
    kernel's paths with float32 activations and with the chosen dtype's."""
    timings: dict[str, dict[str, float]] = {}
    for name, make in _dense_paths().items():
        timings[name] = {str(rows): _total(make, rows, shapes) for rows in ROWS}
    dtype, reason = _choose_dtype(timings)
    rows_measured = sorted({*ROWS, *SWITCH_ROWS})
    for name, make in _quantized_paths(sorted({"float32", dtype})).items():
        timings[name] = {str(rows): _total(make, rows, shapes) for rows in rows_measured}
    return Tuning(cpu_name(), shapes, timings, dtype, _choose_switches(timings), reason)


def _total(make: "MakePath", rows: int, shapes: list[tuple[int, int]]) -> float:
    """``rows`` rows through the path made for each shape, ms summed over the shapes."""
    return sum(_time(make(n, k), rows, k) for n, k in shapes)


def _choose_dtype(timings: dict[str, dict[str, float]]) -> tuple[str, str]:
    """bfloat16 where its linears beat float32's at one row and at 64 rows together."""
    fp32 = timings["float32"]["1"] + timings["float32"]["64"]
    bf16 = timings["bfloat16"]["1"] + timings["bfloat16"]["64"]
    faster = "bfloat16" if bf16 < fp32 else "float32"
    return faster, f"linears at 1 + 64 rows: bfloat16 {bf16:.2f} ms, float32 {fp32:.2f} ms"


def _choose_switches(timings: dict[str, dict[str, float]]) -> dict[str, int] | None:
    """Per ``"int4 float32"`` (weight format, activation dtype) measured: the fewest rows
    from which dequantized tiles beat integer dot products; None without the kernel."""
    found = {
        name.replace(" dots", ""): _choose_switch(dots, timings[name.replace("dots", "tiles")])
        for name, dots in timings.items()
        if " dots " in name
    }
    return found or None


def _choose_switch(dots: dict[str, float], tiles: dict[str, float]) -> int:
    """The fewest rows from which tiles beat dots there and at the next count measured
    (tiles' cost grows more slowly: once ahead they stay ahead, so a lone win is a stall of
    the machine during the dots' measurement, not the crossing)."""
    wins = [tiles[str(rows)] <= dots[str(rows)] for rows in SWITCH_ROWS]
    for i, rows in enumerate(SWITCH_ROWS):
        if wins[i] and (i + 1 == len(SWITCH_ROWS) or wins[i + 1]):
            return rows
    return SWITCH_ROWS[-1] * 2


Linear = Callable[[Tensor], Tensor]


MakePath = Callable[[int, int], tuple[Linear, torch.dtype]]  # (out, in) -> (linear, x dtype)
Paths = dict[str, MakePath]


def _dense_paths() -> Paths:
    """Path name -> (out, in) -> (the linear, its input dtype)."""
    return {
        "float32": lambda n, k: _dense(n, k, torch.float32),
        "bfloat16": lambda n, k: _dense(n, k, torch.bfloat16),
    }


def _quantized_paths(dtypes: list[str]) -> Paths:
    """``"int4 dots bfloat16"`` and the like: the quantized kernel forced onto one path, per
    weight format and activation dtype; none where the kernel is not built."""
    kernels = portable_kernels()
    if kernels is None:
        return {}
    paths: Paths = {}
    for bits in (4, 8):
        for dtype in dtypes:
            for path, switch in (("dots", 1 << 30), ("tiles", 1)):
                paths[f"int{bits} {path} {dtype}"] = functools.partial(
                    _quantized, kernels, bits=bits, switch=switch, dtype=getattr(torch, dtype)
                )
    return paths


def _dense(n: int, k: int, dtype: torch.dtype) -> tuple[Linear, torch.dtype]:
    """The linear a loaded model of ``dtype`` runs (packed for bf16 where it packs)."""
    from torch import nn

    from adapters.torch.cpu.fused_decode import PackedLinear, can_optimize
    from adapters.torch.cpu.kernels import cpu_kernels

    linear = nn.Linear(k, n, bias=False).to(dtype).requires_grad_(False)
    if dtype == torch.bfloat16 and can_optimize(linear):
        return PackedLinear(linear, cpu_kernels()), dtype
    return (lambda x: F.linear(x, linear.weight)), dtype


def _quantized(
    kernels: object, n: int, k: int, *, bits: int, switch: int, dtype: torch.dtype
) -> tuple[Linear, torch.dtype]:
    """int4 as GGUF Q4_1 (group 32, mins), int8 per channel as ``--quantization int8``."""
    from adapters.torch.quant import quantize_int4, quantize_int8

    weight = torch.randn(n, k) * 0.02
    w = quantize_int4(weight) if bits == 4 else quantize_int8(weight)
    op = kernels.quant_linear  # type: ignore[attr-defined]
    return (lambda x: op(x, w.qweight, w.scales, w.mins, bits, w.group_size, switch)), dtype


def _time(path: tuple[Linear, torch.dtype], rows: int, k: int) -> float:
    """The fastest of a few calls after a warm-up, in ms: other processes' load only adds
    time (scheduler stalls of several ms on a busy 2-core machine), so the minimum ranks
    paths best. The weights stay in cache between calls: this ranks, it does not predict."""
    fn, dtype = path
    x = torch.randn(rows, k).to(dtype)
    with torch.inference_mode():
        fn(x)
        samples = []
        for _ in range(3):
            start = time.perf_counter()
            fn(x)
            samples.append((time.perf_counter() - start) * 1e3)
    return min(samples)
