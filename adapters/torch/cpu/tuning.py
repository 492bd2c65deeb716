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

Another process keeping the cores busy must not change the choices (one measured during a
build timed everything ~8x slow and chose tiles from 2 rows instead of 32). So the paths
compared with each other are timed in rounds, alternately (A B, then B A, one call each,
per shape and row count), each round between two timings of a fixed reference GEMM (after
``WARM_S`` of that reference alone: an idle core's clock ramps up first). A
round was disturbed when a reference beside it ran more than ``DISTURBED`` x the fastest
seen (the machine's floor), or when this process's threads waited for a CPU for more than
that share of the round (Linux's schedstat); it is discarded and its comparison measured
again later (in the next turn over the comparisons short of ``ROUNDS`` undisturbed
rounds; after a pause that doubles where a whole turn was disturbed) until its share of
``BUDGET_S`` is spent. A path's time is its minimum over the undisturbed rounds, the same
rounds as the path it is compared with. A comparison without any (a machine busy
throughout; past ``LIMIT`` x the budget, the comparisons left are not measured at all),
or whose rounds only agreed with a floor found lower later, is listed in the tuning's
``disturbed`` and left out of the choices: the dtype then follows the ISA (bfloat16 with
AVX512-BF16 or AMX), a switch is chosen from the row counts timed undisturbed on every
shape (none: None, the kernel's default), and the table shows each path's fastest call.
The floor is cached with the choices: a start that reads them times the reference again
(a few ms) and warns when it now runs ``STALE`` x faster, or when comparisons were
disturbed; ``infer build-kernels --retune`` measures again.
"""

import functools
import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import structlog
import torch
import torch.nn.functional as F
from torch import Tensor

from adapters.torch.cpu.build import kernel_cache_dir
from adapters.torch.cpu.isa import cpu_flags, cpuinfo
from adapters.torch.cpu.portable import portable_kernels
from adapters.torch.cpu.timing import BUDGET_S, Timer, reference_ms, reference_timer
from adapters.torch.models.config import ModelConfig

if TYPE_CHECKING:
    from adapters.torch.quant import QuantLinear
    from adapters.torch.quant_format import QuantizedWeight

log = structlog.get_logger(__name__)
ROWS = (1, 16, 64)  # one decode stream, a small batch, a full batch
SWITCH_ROWS = (2, 4, 8, 16, 32, 64)  # candidates for the quantized kernel's switch
# 2: switches per weight format and activation dtype; 3: a switch needs two row counts
# in a row (one measured under another process's load chose 2 rows instead of 64);
# 4: interleaved rounds checked against a reference GEMM (its floor recorded) and CPU
# waits, what stayed disturbed listed and left out (a switch None: the kernel's default);
# 5: the 4-bit integer path reads dx / xs compact (several rows 1.2-1.9x faster: the
# crossover to tiles moved); 6: bf16 panel copies of the quantized weights timed beside
# both (panels_from_rows)
VERSION = 6
STALE = 1.5  # a cached floor this x the reference's time at a start: tuned on a busy machine
WARM_S = 0.3  # the reference run before any round (clocks ramped up, caches warm)


@dataclass(frozen=True)
class Tuning:
    """What was measured (``timings``: path -> rows -> ms summed over the shapes) and
    chosen: ``dtype`` for the dense model; ``dense_from_rows`` for the quantized kernel,
    ``"int4 bfloat16"`` (weight format, activation dtype) -> rows (None where the kernel is
    not built; a key's None: no row count timed undisturbed, the kernel's default).
    ``reference_ms``: the reference GEMM's floor while measuring (0: unknown);
    ``disturbed``: the comparisons (labels) that no undisturbed round decided, left out of
    the choices."""

    cpu: str
    shapes: list[tuple[int, int]]
    timings: dict[str, dict[str, float]]
    dtype: str
    dense_from_rows: dict[str, int | None] | None
    reason: str
    reference_ms: float = 0.0
    disturbed: list[str] = field(default_factory=list)
    # "int4 bfloat16" -> the fewest rows from which a bf16 panel copy of the weights beats
    # the quantized kernel's paths (None: it never did, or not measured undisturbed); None
    # without the AVX512-BF16 kernels or where the chosen dtype is float32.
    panels_from_rows: dict[str, int | None] | None = None

    def panels(self, bits: int, dtype: str) -> int | None:
        """Rows from which ``bits``-bit weights' bf16 panels win (None: never measured
        to)."""
        return (self.panels_from_rows or {}).get(f"int{bits} {dtype}")

    def switch(self, bits: int, dtype: str) -> int | None:
        """The quantized kernel's switch for ``bits``-bit weights and ``dtype`` activations
        (float32's where ``dtype`` was not measured; None: the kernel's default)."""
        if self.dense_from_rows is None:
            return None
        if f"int{bits} {dtype}" in self.dense_from_rows:
            return self.dense_from_rows[f"int{bits} {dtype}"]
        return self.dense_from_rows.get(f"int{bits} float32")


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
    """The cached tuning for these linear shapes ``(out, in)``, measured first if none (or
    again: ``force``); one read from the cache is checked against the machine now."""
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
            _check_fresh(tuning, path)
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


RETUNE = (
    "run `infer build-kernels --retune` (with this start's --model and --threads) on a "
    "quiet machine"
)


def _check_fresh(tuning: Tuning, path: Path) -> None:
    """A warning where cached choices look measured on a busy machine: some comparisons got
    no undisturbed round, or the reference GEMM now runs ``STALE`` x faster than its floor
    while tuning (timed now, a few ms; a busy machine now only hides the sign)."""
    if tuning.disturbed:
        log.warning(
            "the cached kernel-path choices were measured while other processes kept the "
            "CPU busy; " + RETUNE,
            disturbed=len(tuning.disturbed),
            cached=str(path),
        )
    elif tuning.reference_ms > 0:
        now = reference_ms()
        if _stale(tuning.reference_ms, now):
            log.warning(
                "the cached kernel-path choices look stale: a reference GEMM runs "
                f"{tuning.reference_ms / now:.1f}x faster now than while they were measured; "
                + RETUNE,
                reference_ms_then=round(tuning.reference_ms, 4),
                reference_ms_now=round(now, 4),
                cached=str(path),
            )


def _stale(then_ms: float, now_ms: float) -> bool:
    """The reference's floor while tuning against its time now: tuned on a busy machine."""
    return then_ms > STALE * now_ms


def measure(shapes: list[tuple[int, int]], *, budget_s: float = BUDGET_S) -> Tuning:
    """Time each path on ``shapes`` and choose: the dense dtypes first, then the quantized
    kernel's paths with float32 activations and with the chosen dtype's. ``budget_s``: the
    time for the rounds after each comparison's first (a quiet machine needs a few s)."""
    started = time.perf_counter()
    kernels = portable_kernels()
    reference = reference_timer()
    calls = len(shapes) * (1 if kernels is None else 2)  # the dense stage's share: half
    timer = Timer(reference, budget_s=budget_s, calls=calls)
    # A first floor, before any round, from WARM_S of references: a core that idled runs
    # its first milliseconds slower (its clock ramping up), and rounds timed then were
    # flagged disturbed by the floor found later, on a quiet machine too.
    warm_until, timer.floor = time.perf_counter() + WARM_S, math.inf
    while time.perf_counter() < warm_until:
        timer.floor = min(timer.floor, reference())
    compared: dict[str, Compared] = {}  # each shape's comparisons by label
    dense = {f"{rows} rows": (("float32", "bfloat16"), rows) for rows in ROWS}
    timings = _timings(timer, shapes, _dense_paths, dense, compared)
    timer.recheck()
    dtype, reason = _choose_dtype(timings, _unsettled(timer.disturbed, compared))
    if kernels is not None:
        dtypes = sorted({"float32", dtype})
        panels = (
            dtype == "bfloat16"
            and all(k % 2 == 0 for _, k in shapes)
            and _panel_kernels() is not None
        )
        quantized = {
            f"int{bits} {dtype} at {rows} rows": (
                (f"int{bits} dots {dtype}", f"int{bits} tiles {dtype}")
                + ((f"int{bits} panels {dtype}",) if panels and dtype == "bfloat16" else ()),
                rows,
            )
            for bits in (4, 8)
            for dtype in dtypes
            for rows in sorted({*ROWS, *SWITCH_ROWS})
        }
        make = functools.partial(_quantized_paths, kernels, dtypes, panels)
        timings |= _timings(timer, shapes, make, quantized, compared)
    timer.recheck()
    log.info(
        "kernel paths timed",
        rounds=timer.rounds,
        disturbed_rounds=timer.again,
        paused_s=round(timer.paused_s, 2),
        reference_floor_ms=round(timer.floor, 4),
        unsettled=len(timer.disturbed),
        unmeasured=timer.unmeasured,
        wall_s=round(time.perf_counter() - started, 1),
    )
    return Tuning(
        cpu_name(),
        shapes,
        timings,
        dtype,
        _choose_switches(timings, _unsettled(timer.disturbed, compared)),
        reason,
        reference_ms=timer.floor,
        disturbed=timer.disturbed,
        panels_from_rows=_choose_panels(timings, _unsettled(timer.disturbed, compared)),
    )


Linear = Callable[[Tensor], Tensor]
Made = dict[str, tuple[Linear, torch.dtype]]  # path -> (the linear, its input dtype)
Compared = tuple[tuple[str, ...], int]  # the paths compared, at rows
Comparisons = Mapping[str, Compared]  # by label


def _timings(
    timer: "Timer",
    shapes: list[tuple[int, int]],
    make: Callable[[int, int], Made],
    comparisons: Comparisons,
    compared: dict[str, Compared],
) -> dict[str, dict[str, float]]:
    """Path -> rows -> ms summed over ``shapes`` (none where a shape's was not measured):
    each comparison timed by ``timer`` per shape, one shape's linears in memory at a time;
    ``compared`` gets each shape's comparisons by their labels in ``timer``."""
    timings: dict[str, dict[str, float]] = {}
    missing: set[tuple[str, int]] = set()
    for n, k in shapes:
        paths = make(n, k)
        groups = {
            f"{label}, {n}x{k}": _round_of([(name, *paths[name]) for name in names], rows, k)
            for label, (names, rows) in comparisons.items()
        }
        compared |= {f"{label}, {n}x{k}": found for label, found in comparisons.items()}
        measured = timer.measure(groups)
        for (_, (names, rows)), times in zip(comparisons.items(), measured.values(), strict=True):
            for name in names:
                path = timings.setdefault(name, {})
                if not times:  # not measured: no total for these rows
                    missing.add((name, rows))
                path[str(rows)] = path.get(str(rows), 0.0) + times.get(name, 0.0)
        del paths, groups
    for name, rows in missing:
        del timings[name][str(rows)]
    return timings


def _round_of(
    paths: list[tuple[str, Linear, torch.dtype]], rows: int, k: int
) -> Callable[[int], dict[str, float]]:
    """One round of ``paths`` on ``rows`` rows: one call each, in turn (reversed on odd
    turns, so that neither always follows the other), after a warm-up call now."""
    calls = [(name, fn, torch.randn(rows, k).to(dtype)) for name, fn, dtype in paths]
    with torch.inference_mode():
        for _, fn, x in calls:
            fn(x)

    def one_round(turn: int) -> dict[str, float]:
        times = {}
        with torch.inference_mode():
            for name, fn, x in calls if turn % 2 == 0 else calls[::-1]:
                start = time.perf_counter()
                fn(x)
                times[name] = (time.perf_counter() - start) * 1e3
        return times

    return one_round


Unsettled = set[tuple[str, int]]  # (path, rows) not timed undisturbed on every shape


def _choose_dtype(
    timings: dict[str, dict[str, float]], unsettled: Unsettled | None = None
) -> tuple[str, str]:
    """bfloat16 where its linears beat float32's at one row and at 64 rows together; where
    those were not timed undisturbed, bfloat16 where the CPU has AVX512-BF16 or AMX."""
    if any(
        (path, rows) in (unsettled or set()) for path in ("float32", "bfloat16") for rows in (1, 64)
    ):
        guess = "bfloat16" if {"avx512_bf16", "amx_bf16"} & set(isa_flags()) else "float32"
        return guess, "not timed undisturbed (a busy machine): bfloat16 where the ISA has bf16"
    fp32 = timings["float32"]["1"] + timings["float32"]["64"]
    bf16 = timings["bfloat16"]["1"] + timings["bfloat16"]["64"]
    faster = "bfloat16" if bf16 < fp32 else "float32"
    return faster, f"linears at 1 + 64 rows: bfloat16 {bf16:.2f} ms, float32 {fp32:.2f} ms"


def _choose_switches(
    timings: dict[str, dict[str, float]], unsettled: Unsettled | None = None
) -> dict[str, int | None] | None:
    """Per ``"int4 float32"`` (weight format, activation dtype) measured: the fewest rows
    from which dequantized tiles beat integer dot products, from the row counts timed
    undisturbed (None where none was: the kernel's default); None without the kernel."""
    found: dict[str, int | None] = {}
    for name, dots in timings.items():
        if " dots " in name:
            rows = [r for r in SWITCH_ROWS if (name, r) not in (unsettled or set())]
            tiles = timings[name.replace("dots", "tiles")]
            found[name.replace(" dots", "")] = _choose_switch(dots, tiles, rows) if rows else None
    return found or None


def _choose_switch(
    dots: dict[str, float], tiles: dict[str, float], rows: Sequence[int] = SWITCH_ROWS
) -> int:
    """The fewest of ``rows`` from which tiles beat dots there and at the next count
    measured (tiles' cost grows more slowly: once ahead they stay ahead, so a lone win is a
    stall of the machine during the dots' measurement, not the crossing)."""
    wins = [tiles[str(r)] <= dots[str(r)] for r in rows]
    for i, r in enumerate(rows):
        if wins[i] and (i + 1 == len(rows) or wins[i + 1]):
            return r
    return SWITCH_ROWS[-1] * 2


def _choose_panels(
    timings: dict[str, dict[str, float]], unsettled: Unsettled | None = None
) -> dict[str, int | None] | None:
    """Per ``"int4 bfloat16"`` timed with panels: the fewest rows from which the bf16
    panels beat the faster of dots and tiles there and at the next count (None: never, or
    nothing timed undisturbed); None where no panels were timed."""
    found: dict[str, int | None] = {}
    for name, panels in timings.items():
        if " panels " not in name:
            continue
        dots = timings[name.replace("panels", "dots")]
        tiles = timings[name.replace("panels", "tiles")]
        rows = [
            r
            for r in SWITCH_ROWS
            if not {(name, r), (name.replace("panels", "dots"), r)} & (unsettled or set())
            and str(r) in panels
        ]
        best = {str(r): min(dots[str(r)], tiles[str(r)]) for r in rows}
        switch = _choose_switch(best, panels, rows) if rows else None
        found[name.replace(" panels", "")] = switch if switch in rows else None
    return found or None


def _panel_kernels() -> object | None:
    """The AVX512-BF16 kernels (their panel GEMM), where built."""
    from adapters.torch.cpu.kernels import cpu_kernels

    return cpu_kernels()


def _unsettled(labels: list[str], compared: dict[str, "Compared"]) -> Unsettled:
    """The (path, rows) of the comparisons ``labels`` names."""
    return {(path, compared[label][1]) for label in labels for path in compared[label][0]}


def _dense_paths(n: int, k: int) -> Made:
    """The dense linears of one shape, in each dtype."""
    return {"float32": _dense(n, k, torch.float32), "bfloat16": _dense(n, k, torch.bfloat16)}


def _quantized_paths(kernels: object, dtypes: list[str], panels: bool, n: int, k: int) -> Made:
    """``"int4 dots bfloat16"`` and the like: the quantized kernel forced onto one path, per
    weight format and activation dtype, on one shape's weights per format; with ``panels``
    also ``"int4 panels bfloat16"``: the weights dequantized into bf16 panels."""
    from adapters.torch.quant import QuantLinear
    from adapters.torch.quant_format import quantize_int4, quantize_int8

    paths: Made = {}
    for bits in (4, 8):
        weight = torch.randn(n, k) * 0.02
        w = quantize_int4(weight) if bits == 4 else quantize_int8(weight)
        for dtype in dtypes:
            for path, switch in (("dots", 1 << 30), ("tiles", 1)):
                op = _forced(kernels, w, bits, switch)
                paths[f"int{bits} {path} {dtype}"] = op, getattr(torch, dtype)
        if panels:
            paths[f"int{bits} panels bfloat16"] = _panels(QuantLinear(w), n), torch.bfloat16
    return paths


def _panels(linear: "QuantLinear", n: int) -> Linear:
    """The AVX512-BF16 kernels' GEMM on ``linear``'s weights dequantized into bf16 panels."""
    kernels: Any = _panel_kernels()
    packed = kernels.pack_panels(linear.dequantized(torch.bfloat16).contiguous())
    return lambda x: cast(Tensor, kernels.gemm_packed(x, packed, n))


def _forced(kernels: object, w: "QuantizedWeight", bits: int, switch: int) -> Linear:
    """The quantized kernel on ``w``, switching to tiles from ``switch`` rows."""
    op = kernels.quant_linear  # type: ignore[attr-defined]
    return lambda x: op(x, w.qweight, w.scales, w.mins, bits, w.group_size, switch)


def _dense(n: int, k: int, dtype: torch.dtype) -> tuple[Linear, torch.dtype]:
    """The linear a loaded model of ``dtype`` runs (packed for bf16 where it packs)."""
    from torch import nn

    from adapters.torch.cpu.fused_decode import PackedLinear, can_optimize
    from adapters.torch.cpu.kernels import cpu_kernels

    linear = nn.Linear(k, n, bias=False).to(dtype).requires_grad_(False)
    if dtype == torch.bfloat16 and can_optimize(linear):
        return PackedLinear(linear, cpu_kernels()), dtype
    return (lambda x: F.linear(x, linear.weight)), dtype
