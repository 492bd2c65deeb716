"""Choices by measurement (adapters/torch/cpu/tuning.py): what is chosen from which timings,
the per-machine cache, --dtype auto, `infer bench-kernels`, and timings a busy machine
does not spoil (the scripted machine here; a real load in test_tuning_under_load.py)."""

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from adapters.torch import factory
from adapters.torch.cpu import timing, tuning
from adapters.weights.dummy import resolve_dummy
from domain.memory import PANELS_AUTO_MAX
from entrypoints import kernel_commands
from entrypoints.cli import main

SHAPES = [(96, 64), (64, 64)]


ROWS = (1, 2, 4, 8, 16, 32, 64)


def _timings(bf16: float, fp32: float) -> dict[str, dict[str, float]]:
    dots = {str(r): 1.0 * r for r in ROWS}
    return {
        "float32": {"1": fp32, "16": fp32, "64": fp32},
        "bfloat16": {"1": bf16, "16": bf16, "64": bf16},
        "int4 dots float32": dots,
        "int4 tiles float32": {str(r): 12.0 + r / 4 for r in ROWS},  # wins from 16 rows
        "int4 dots bfloat16": dots,
        "int4 tiles bfloat16": {str(r): 3.0 + r / 4 for r in ROWS},  # from 4
        "int8 dots float32": dots,
        "int8 tiles float32": {str(r): 100.0 for r in ROWS},  # never
    }


SWITCHES: dict[str, int | None] = {"int4 float32": 16, "int4 bfloat16": 4, "int8 float32": 128}


def test_the_faster_dtype_and_the_first_row_count_where_tiles_win_are_chosen() -> None:
    dtype, reason = tuning._choose_dtype(_timings(bf16=1.0, fp32=2.0))
    assert dtype == "bfloat16" and "bfloat16 2.00 ms, float32 4.00 ms" in reason
    assert tuning._choose_dtype(_timings(bf16=3.0, fp32=2.0))[0] == "float32"
    assert tuning._choose_switches(_timings(1, 1)) == SWITCHES
    assert tuning._choose_switches({"float32": {}}) is None


def test_a_lone_win_measured_during_a_stall_is_not_the_switch() -> None:
    # What a 2-core machine under another process's load measured: dots stalled at 1 and
    # 2 rows, so tiles "won" at 2, then lost until 32.
    dots = {"1": 28.9, "2": 32.7, "4": 1.09, "8": 2.41, "16": 5.0, "32": 11.2, "64": 42.1}
    tiles = {"1": 20.3, "2": 4.78, "4": 5.02, "8": 5.73, "16": 6.81, "32": 9.25, "64": 14.1}
    timings = {"int4 dots bfloat16": dots, "int4 tiles bfloat16": tiles}
    assert tuning._choose_switches(timings) == {"int4 bfloat16": 32}


def test_what_no_undisturbed_round_timed_is_left_out_of_the_choices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    timings = _timings(bf16=3.0, fp32=2.0)
    monkeypatch.setattr(tuning, "isa_flags", lambda: ["avx2", "avx512_bf16"])
    dtype, reason = tuning._choose_dtype(timings, {("float32", 64), ("bfloat16", 64)})
    assert dtype == "bfloat16" and "not timed undisturbed" in reason  # the ISA's guess
    monkeypatch.setattr(tuning, "isa_flags", lambda: ["avx2"])
    assert tuning._choose_dtype(timings, {("bfloat16", 1)})[0] == "float32"
    assert tuning._choose_dtype(timings, {("float32", 16)})[0] == "float32"  # not used
    # int4 float32's tiles win from 16 rows; 16 not timed undisturbed: from 32
    unsettled = {("int4 dots float32", 16), ("int4 tiles float32", 16)}
    unsettled |= {("int8 dots float32", r) for r in tuning.SWITCH_ROWS}
    assert tuning._choose_switches(timings, unsettled) == SWITCHES | {
        "int4 float32": 32,
        "int8 float32": None,
    }


def test_a_switch_is_per_weight_format_and_activation_dtype() -> None:
    chosen = tuning.Tuning("cpu", [], {}, "bfloat16", SWITCHES, "why")
    assert chosen.switch(4, "bfloat16") == 4 and chosen.switch(4, "float32") == 16
    assert chosen.switch(8, "bfloat16") == 128  # not measured in bfloat16: float32's
    assert chosen.switch(4, "float16") == 16
    assert tuning.Tuning("cpu", [], {}, "float32", None, "").switch(4, "float32") is None
    unsettled = tuning.Tuning("cpu", [], {}, "bfloat16", SWITCHES | {"int4 bfloat16": None}, "")
    assert unsettled.switch(4, "bfloat16") is None  # the kernel's default, not float32's


def test_bf16_panels_are_chosen_from_where_they_beat_both_quantized_paths() -> None:
    timings = _timings(1, 1)  # int4 bfloat16: dots r, tiles 3 + r / 4
    timings["int4 panels bfloat16"] = {str(r): 1.5 + r / 8 for r in ROWS}  # wins from 2 rows
    assert tuning._choose_panels(timings) == {"int4 bfloat16": 2}
    timings["int4 panels bfloat16"] = {str(r): 4.0 + r / 5 for r in ROWS}  # from 32 (vs tiles)
    assert tuning._choose_panels(timings) == {"int4 bfloat16": 32}
    unsettled = {("int4 panels bfloat16", 32)}  # 32 not timed undisturbed: from 64
    assert tuning._choose_panels(timings, unsettled) == {"int4 bfloat16": 64}
    timings["int4 panels bfloat16"] = {str(r): 100.0 for r in ROWS}  # never
    assert tuning._choose_panels(timings) == {"int4 bfloat16": None}
    assert tuning._choose_panels(_timings(1, 1)) is None  # no panels timed
    chosen = tuning.Tuning(
        "cpu", [], {}, "bfloat16", SWITCHES, "", panels_from_rows={"int4 bfloat16": 8}
    )
    assert chosen.panels(4, "bfloat16") == 8 and chosen.panels(8, "bfloat16") is None
    assert tuning.Tuning("cpu", [], {}, "bfloat16", SWITCHES, "").panels(4, "bfloat16") is None


def test_panels_the_tuning_chose_are_kept_within_the_memory_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from adapters.torch.cpu.kernels import cpu_kernels
    from adapters.torch.quant import QuantLinear

    if cpu_kernels() is None:
        pytest.skip("no AVX512-BF16 kernels")
    resolved = resolve_dummy("SmolLM2-135M", tmp_path)
    panels = {"int4 bfloat16": 8, "int8 bfloat16": 2}
    fixed = tuning.Tuning("cpu", [], {}, "bfloat16", SWITCHES, "m", panels_from_rows=panels)
    monkeypatch.setattr(factory, "tuned", lambda shapes: fixed)
    model = factory.build_model(resolved, "bfloat16", "cpu", "int4", panels_memory=1 << 30)
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert {(m.bits, m.panels_from_rows) for m in linears} == {(4, 8), (8, 2)}
    assert all(m.panels is not None for m in linears)
    model = factory.build_model(resolved, "bfloat16", "cpu", "int4", panels_memory=1 << 20)
    assert all(m.panels is None for m in model.modules() if isinstance(m, QuantLinear))
    assert 0 < factory.auto_panels_memory() <= PANELS_AUTO_MAX


def test_measure_times_every_path_this_machine_has() -> None:
    result = tuning.measure(SHAPES, budget_s=2.0)
    assert {"float32", "bfloat16"} <= set(result.timings)
    assert all(t > 0 for path in result.timings.values() for t in path.values())
    assert result.dtype in ("float32", "bfloat16")
    if "int4 dots float32" in result.timings:
        assert result.dense_from_rows is not None
        want = {f"int{bits} {dtype}" for bits in (4, 8) for dtype in {"float32", result.dtype}}
        assert set(result.dense_from_rows) == want
        assert all(r in (*tuning.SWITCH_ROWS, 128, None) for r in result.dense_from_rows.values())
    assert result.reference_ms > 0  # None above: not timed undisturbed on a busy machine
    from adapters.torch.cpu.kernels import cpu_kernels

    if result.dtype == "bfloat16" and cpu_kernels() is not None:
        assert result.panels_from_rows is not None
        assert set(result.panels_from_rows) == {"int4 bfloat16", "int8 bfloat16"}
        assert "int4 panels bfloat16" in result.timings


def test_a_tuning_is_measured_once_per_machine_and_shapes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("INFER_CACHE_DIR", str(tmp_path))
    calls = []

    def fake_measure(shapes: list[tuple[int, int]]) -> tuning.Tuning:
        calls.append(shapes)
        return tuning.Tuning("cpu", shapes, _timings(1.0, 2.0), "bfloat16", SWITCHES, "why")

    monkeypatch.setattr(tuning, "measure", fake_measure)
    first = tuning.tuned(SHAPES)
    assert tuning.tuned(SHAPES) == first and len(calls) == 1
    tuning.tuned(SHAPES[:1])
    tuning.tuned(SHAPES, force=True)
    assert len(calls) == 3
    assert len(list((tmp_path / "tuning").glob("*.json"))) == 2


def test_dtype_auto_takes_the_measured_dtype_on_a_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    resolved = resolve_dummy("SmolLM2-135M", tmp_path)
    fixed = tuning.Tuning("cpu", [], _timings(3.0, 2.0), "float32", SWITCHES, "measured")
    monkeypatch.setattr(factory, "tuned", lambda shapes: fixed)
    assert factory.choose_dtype("auto", resolved, "cpu") == "float32"
    assert factory.choose_dtype("bfloat16", resolved, "cpu") == "bfloat16"
    assert factory.choose_dtype("auto", resolved, "cuda") == "bfloat16"


def test_bench_kernels_prints_the_table_and_the_choices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("INFER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(
        tuning,
        "measure",
        lambda shapes: tuning.Tuning("cpu", shapes, _timings(3.0, 2.0), "float32", SWITCHES, "r"),
    )
    argv = ["bench-kernels", "--model", "dummy:SmolLM2-135M", "--cache-dir", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| float32 | 2.00 | " in out and "| int4 tiles bfloat16 |" in out
    assert "--dtype auto: float32 (r)" in out
    assert "int4 weights, bfloat16 activations: integer dot products below 4 rows" in out
    assert "int8 weights, float32 activations: integer dot products below 128 rows" in out


@pytest.mark.parametrize(("dtype", "int4_switch"), [("bfloat16", 4), ("float32", 16)])
def test_each_quantized_linear_gets_its_formats_switch_for_the_model_dtype(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: str, int4_switch: int
) -> None:
    from adapters.torch.quant import QuantLinear

    resolved = resolve_dummy("SmolLM2-135M", tmp_path)
    fixed = tuning.Tuning("cpu", [], {}, "bfloat16", SWITCHES, "measured")
    monkeypatch.setattr(factory, "tuned", lambda shapes: fixed)
    model = factory.build_model(resolved, dtype, "cpu", "int4")
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    if linears[0].kernel is None:
        pytest.skip("no C++ toolchain: the PyTorch path has no switch")
    switches = {(m.bits, m.dense_from_rows) for m in linears}
    assert (4, int4_switch) in switches
    assert switches <= {(4, int4_switch), (8, 128)}


def test_build_kernels_measures_what_the_first_load_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`make setup` runs `infer build-kernels`: after it, --dtype auto on the model's first
    load reads the cached measurement instead of measuring (~25 s)."""
    from adapters.torch.cpu import kernels, portable

    monkeypatch.setenv("INFER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(factory, "default_device", lambda: "cpu")
    calls = []

    def fake_measure(shapes: list[tuple[int, int]]) -> tuning.Tuning:
        calls.append(shapes)
        return tuning.Tuning("cpu", shapes, _timings(3.0, 2.0), "float32", SWITCHES, "r")

    # the step costs measured on the model's runner: tests/integration/torch/test_step_costs.py
    monkeypatch.setattr(kernel_commands, "measure_steps", lambda args: None)
    with monkeypatch.context() as built:  # the kernels' build is test_kernel_build's
        built.setattr(portable, "portable_kernels", lambda: object())
        built.setattr(kernels, "cpu_kernels", lambda: object())
        built.setattr(tuning, "measure", fake_measure)
        argv = ["build-kernels", "--model", "dummy:SmolLM2-135M", "--cache-dir", str(tmp_path)]
        assert main(argv) == 0
    assert len(calls) == 1
    (cached,) = (tmp_path / "tuning").glob("*.json")
    out = capsys.readouterr().out
    assert "--dtype auto for " in out and f"kernel paths measured: {cached}" in out

    tuning._read.clear()  # a new process: only the file
    monkeypatch.setattr(tuning, "measure", lambda shapes: pytest.fail("measured again"))
    resolved = resolve_dummy("SmolLM2-135M", tmp_path)
    assert factory.choose_dtype("auto", resolved, "cpu") == "float32"
    (read,) = [
        line
        for line in capsys.readouterr().err.splitlines()  # build-kernels logs to stderr
        if "kernel paths read from this CPU's measurement" in line
    ]
    assert f"cached={cached}" in read


class Machine:
    """A scripted machine for :class:`timing.Timer`: the reference GEMM takes 0.1 ms and a
    path its quiet time, each times the slowdown of the round (1.0 once the script ends),
    the time added spent waiting for a CPU where ``waits`` (Linux says so, not every OS);
    the clock moves by what it measures and by the pauses."""

    def __init__(self, quiet: dict[str, float], slowdowns: list[float], waits: bool = True):
        self.quiet, self.slowdowns, self.waits = quiet, slowdowns, waits
        self.references = 0  # two per round: before and after
        self.now, self.waited, self.pauses = 0.0, 0.0, list[float]()

    def slowdown(self) -> float:
        i = (self.references - 1) // 2
        return self.slowdowns[i] if i < len(self.slowdowns) else 1.0

    def reference(self) -> float:
        self.references += 1
        return 0.1 * self.slowdown()

    def one_round(self, turn: int) -> dict[str, float]:
        times = {path: ms * self.slowdown() for path, ms in self.quiet.items()}
        self.now += sum(times.values()) / 1e3
        self.waited += (sum(times.values()) - sum(self.quiet.values())) * self.waits
        return times

    def sleep(self, seconds: float) -> None:
        self.pauses.append(seconds)
        self.now += seconds

    def timer(self, budget_s: float = 10.0) -> timing.Timer:
        return timing.Timer(
            self.reference,
            budget_s=budget_s,
            clock=lambda: self.now,
            sleep=self.sleep,
            waited=lambda: (self.waited, 0.0),
        )


def test_a_quiet_machine_is_timed_in_the_fewest_rounds() -> None:
    machine = Machine({"dots": 2.0, "tiles": 5.0}, [])
    timer = machine.timer()
    assert timer.measure({"int4 at 2 rows": machine.one_round}) == {
        "int4 at 2 rows": {"dots": 2.0, "tiles": 5.0}
    }
    assert timer.rounds == timing.ROUNDS and timer.again == 0 and machine.pauses == []
    assert timer.floor == pytest.approx(0.1) and timer.disturbed == []


def test_disturbed_rounds_are_measured_again_later_after_growing_pauses() -> None:
    # The Xeon's failure: a build ran beside the first rounds and slowed everything 8x.
    machine = Machine({"dots": 2.0, "tiles": 5.0}, [8.0, 8.0, 8.0, 1.0, 1.0, 1.0])
    timer = machine.timer()
    assert timer.measure({"g": machine.one_round}) == {"g": {"dots": 2.0, "tiles": 5.0}}
    assert timer.rounds == 6 and timer.again == 3 and timer.disturbed == []
    first, most = timing.BACKOFF_S
    assert machine.pauses == [first, 2 * first, min(4 * first, most)]


def test_a_floor_found_later_flags_what_a_uniform_slowdown_hid() -> None:
    # Slowed 2x through the first comparison, without waits to show it (another OS, or a
    # sibling hyperthread's load): its rounds agree with each other, not with the floor.
    machine = Machine({"dots": 2.0, "tiles": 5.0}, [2.0] * 3, waits=False)
    timer = machine.timer()
    assert timer.measure({"g1": machine.one_round}) == {"g1": {"dots": 4.0, "tiles": 10.0}}
    assert timer.disturbed == [] and timer.recheck() == []
    assert timer.measure({"g2": machine.one_round}) == {"g2": {"dots": 2.0, "tiles": 5.0}}
    assert timer.recheck() == ["g1"] and timer.disturbed == ["g1"]


def test_a_machine_busy_past_the_budget_gets_each_paths_fastest_call_and_says_so() -> None:
    machine = Machine({"dots": 2.0, "tiles": 5.0}, [4.0, 3.0, 6.0] + [5.0] * 100)
    timer = machine.timer(budget_s=0.2)
    found = timer.measure({"g": machine.one_round})
    assert found == {"g": {"dots": 6.0, "tiles": 15.0}}  # the round slowed least
    assert timer.disturbed == ["g"]
    assert 3 <= timer.rounds < 10 and machine.now < 0.2 + 2 * timing.BACKOFF_S[1]


def test_a_machine_busy_past_the_limit_leaves_the_last_comparisons_unmeasured() -> None:
    machine = Machine({"dots": 2.0, "tiles": 5.0}, [50.0] * 100)  # 0.35 s a round
    timer = machine.timer(budget_s=0.5)
    found = timer.measure({f"g{i}": machine.one_round for i in range(5)})
    assert found["g0"] == {"dots": 100.0, "tiles": 250.0} and found["g4"] == {}
    assert timer.disturbed == [f"g{i}" for i in range(5)] and timer.unmeasured >= 2
    assert machine.now < timing.LIMIT * 0.5 + 0.35


def test_a_row_count_not_measured_on_every_shape_has_no_total() -> None:
    class Stub:
        def measure(self, groups: dict[str, object]) -> dict[str, dict[str, float]]:
            return {
                label: {} if "64 rows, 8x8" in label else {"a": 1.0, "b": 2.0} for label in groups
            }

    def make(n: int, k: int) -> tuning.Made:
        return {path: ((lambda x: x), torch.float32) for path in ("a", "b")}

    compared: dict[str, tuning.Compared] = {}
    comparisons = {f"{rows} rows": (("a", "b"), rows) for rows in (1, 64)}
    timings = tuning._timings(Stub(), [(4, 8), (8, 8)], make, comparisons, compared)  # type: ignore[arg-type]
    assert timings == {"a": {"1": 2.0}, "b": {"1": 4.0}}
    assert compared["64 rows, 8x8"] == (("a", "b"), 64)


def test_a_round_whose_threads_waited_for_a_cpu_is_disturbed() -> None:
    quiet = timing.Round((0.1, 0.1), {"dots": 1.0, "tiles": 1.0}, waited_ms=0.05)
    assert not timing._disturbed(quiet, floor=0.1)
    waited = timing.Round((0.1, 0.1), {"dots": 1.0, "tiles": 1.0}, waited_ms=1.5)
    assert timing._disturbed(waited, floor=0.1)  # 1.4 ms of 2 ms waiting
    assert timing._disturbed(timing.Round((0.1, 0.2), {"dots": 1.0}), floor=0.1)
    own, others = timing.waited_ms()
    assert own >= 0.0 and others >= 0.0
    # an intra-op thread that waited 5 ms while 1 ms of calls ran without it (too little
    # work to split) delayed them by at most 1 ms
    waits = iter([(0.0, 0.0), (0.0, 5.0)])
    timer = timing.Timer(lambda: 0.1, waited=lambda: next(waits, (0.0, 5.0)))
    timer.measure({"g": lambda turn: {"dots": 0.5, "tiles": 0.5}})
    assert timer.history["g"][0].waited_ms == 1.0


def test_the_switch_measured_through_a_disturbed_machine_is_the_quiet_one() -> None:
    """The Xeon's: dots stalled at 2 and 4 rows mid-round (the references before and after
    quiet, our threads waiting for a CPU), so that tiles "won" there; those rounds are
    measured again and the quiet switch is found."""
    quiet = {2: (0.6, 3.2), 4: (0.8, 3.3), 8: (1.7, 3.7), 16: (3.2, 4.1), 32: (6.2, 4.9)}
    quiet |= {64: (11.5, 7.0)}
    dots, tiles, again = {}, {}, 0
    for rows, (d, t) in quiet.items():
        machine = Machine({"dots": d, "tiles": t}, [])
        timer = machine.timer()
        found = timer.measure({"g": _stalling_dots(machine, [8.0, 1.0, 6.0] if rows <= 4 else [])})
        dots[str(rows)], tiles[str(rows)] = found["g"]["dots"], found["g"]["tiles"]
        again += timer.again
    assert tuning._choose_switch(dots, tiles) == 32
    assert again == 4 and (dots["2"], tiles["2"]) == quiet[2]


def _stalling_dots(machine: Machine, stalls: list[float]) -> Callable[[int], dict[str, float]]:
    """Rounds whose dots call is slowed by ``stalls`` in turn, the time added spent waiting
    for a CPU; the references not slowed."""
    script = iter(stalls)

    def one_round(turn: int) -> dict[str, float]:
        slow = next(script, 1.0)
        machine.waited += machine.quiet["dots"] * (slow - 1)
        return {"dots": machine.quiet["dots"] * slow, "tiles": machine.quiet["tiles"]}

    return one_round


def test_a_cached_tuning_made_on_a_busy_machine_is_warned_of_at_a_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from adapters.observability.logging import configure_logging

    configure_logging("info", "console")
    monkeypatch.setenv("INFER_CACHE_DIR", str(tmp_path))
    busy = tuning.Tuning("cpu", SHAPES, _timings(1.0, 2.0), "bfloat16", SWITCHES, "r", 0.4)
    monkeypatch.setattr(tuning, "measure", lambda shapes: busy)
    tuning.tuned(SHAPES)
    capsys.readouterr()

    def warnings(reference_now: float, cached: tuning.Tuning = busy) -> list[str]:
        tuning._read.clear()  # a new process
        monkeypatch.setattr(tuning, "reference_ms", lambda: reference_now)
        assert tuning.tuned(SHAPES) == cached
        return [line for line in capsys.readouterr().err.splitlines() if "warning" in line]

    (stale,) = warnings(0.1)  # 4x faster now
    assert "4.0x faster now" in stale and "infer build-kernels --retune" in stale
    assert warnings(0.35) == []  # within noise
    assert warnings(2.0) == []  # busy now: no sign either way
    flagged = tuning.Tuning("cpu", SHAPES, {}, "float32", None, "r", 0.1, ["int4 at 2 rows"])
    monkeypatch.setattr(tuning, "measure", lambda shapes: flagged)
    tuning.tuned(SHAPES, force=True)
    (disturbed,) = warnings(0.1, flagged)
    assert "while other processes kept the CPU busy" in disturbed and "disturbed=1" in disturbed


def test_the_reference_check_at_a_start_takes_a_few_milliseconds() -> None:
    timing.reference_ms()  # torch's first GEMM
    start = time.perf_counter()
    assert timing.reference_ms() > 0
    assert time.perf_counter() - start < 0.2  # ~5 ms quiet; at most 50 ms and a call busy


def test_build_kernels_retune_measures_again_over_a_cached_tuning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from adapters.torch.cpu import kernels, portable

    monkeypatch.setenv("INFER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(factory, "default_device", lambda: "cpu")
    monkeypatch.setattr(portable, "portable_kernels", lambda: object())
    monkeypatch.setattr(kernels, "cpu_kernels", lambda: object())
    calls = []

    def fake_measure(shapes: list[tuple[int, int]]) -> tuning.Tuning:
        calls.append(shapes)
        disturbed = ["int4 bfloat16 at 2 rows"] if len(calls) == 1 else []
        return tuning.Tuning("cpu", shapes, {}, "float32", SWITCHES, "r", 0.1, disturbed)

    monkeypatch.setattr(tuning, "measure", fake_measure)
    steps: list[bool] = []  # each build-kernels' step-cost measurement: forced or not
    monkeypatch.setattr(kernel_commands, "measure_steps", lambda args: steps.append(args.retune))
    argv = ["build-kernels", "--model", "dummy:SmolLM2-135M", "--cache-dir", str(tmp_path)]
    assert main(argv) == 0
    assert "1 comparisons stayed disturbed" in capsys.readouterr().out
    tuning._read.clear()
    monkeypatch.setattr(tuning, "reference_ms", lambda: 0.1)
    assert main(argv) == 0 and len(calls) == 1  # read, not measured
    read = capsys.readouterr()
    assert "stayed disturbed" in read.out and "infer build-kernels --retune" in read.err
    assert main([*argv, "--retune"]) == 0 and len(calls) == 2
    assert "stayed disturbed" not in capsys.readouterr().out
    assert steps == [False, False, True]  # the step costs measured again with --retune
