"""Choices by measurement (adapters/torch/cpu/tuning.py): what is chosen from which timings,
the per-machine cache, --dtype auto, and `infer bench-kernels`."""

from pathlib import Path

import pytest

from adapters.torch import factory
from adapters.torch.cpu import tuning
from adapters.weights.dummy import resolve_dummy
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


SWITCHES = {"int4 float32": 16, "int4 bfloat16": 4, "int8 float32": 128}


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


def test_a_switch_is_per_weight_format_and_activation_dtype() -> None:
    chosen = tuning.Tuning("cpu", [], {}, "bfloat16", SWITCHES, "why")
    assert chosen.switch(4, "bfloat16") == 4 and chosen.switch(4, "float32") == 16
    assert chosen.switch(8, "bfloat16") == 128  # not measured in bfloat16: float32's
    assert chosen.switch(4, "float16") == 16
    assert tuning.Tuning("cpu", [], {}, "float32", None, "").switch(4, "float32") is None


def test_measure_times_every_path_this_machine_has() -> None:
    result = tuning.measure(SHAPES)
    assert {"float32", "bfloat16"} <= set(result.timings)
    assert all(t > 0 for path in result.timings.values() for t in path.values())
    assert result.dtype in ("float32", "bfloat16")
    if "int4 dots float32" in result.timings:
        assert result.dense_from_rows is not None
        want = {f"int{bits} {dtype}" for bits in (4, 8) for dtype in {"float32", result.dtype}}
        assert set(result.dense_from_rows) == want
        assert all(r in (*tuning.SWITCH_ROWS, 128) for r in result.dense_from_rows.values())


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
