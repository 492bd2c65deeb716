"""The runner's step costs, measured on a tiny model as speculation reads them: every
shape timed (decode rows of 1, 2, 4, ... sequences plus their draft rows), positive, the
runner left as it was (no request state, the engine then serves normally), cached per
machine and model and read back, measured again when forced; none where speculation is
off or drafts come from a draft model."""

from pathlib import Path

import pytest
import torch

from adapters.fake import ByteTokenizer
from adapters.torch.loading.loader import load_model
from adapters.torch.runtime import step_costs as sc
from adapters.torch.runtime.runner import TorchModelRunner
from application.engine.engine import Engine
from domain.config import EngineConfig
from domain.sampling import SamplingParams
from domain.speculation import SpeculativeConfig, StepCosts
from tests.fakes import ListSink
from tests.support.engine_calls import add_request
from tests.support.engine_runs import run_to_end
from tests.support.tiny_models import save_tiny_model

SPEC = SpeculativeConfig(num_speculative_tokens=3)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder: Path = tmp_path_factory.mktemp("llama")
    save_tiny_model("llama", folder)
    return load_model(folder, dtype=torch.float32)


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("INFER_CACHE_DIR", str(tmp_path))
    # a quiet machine, whatever else runs beside the tests (the busy case is its own test)
    monkeypatch.setattr(sc, "waited_ms", lambda: (0.0, 0.0))
    return tmp_path


def _config(**kw: object) -> EngineConfig:
    values: dict[str, object] = {
        "max_model_len": 256,
        "max_num_seqs": 8,
        "speculative_config": SPEC,
    }
    return EngineConfig(**(values | kw))  # type: ignore[arg-type]


def test_every_shape_is_measured_and_the_runner_is_left_clean(model, cache) -> None:
    config = _config(max_num_seqs=64, num_kv_blocks=320)  # 64 sequences' room
    runner = TorchModelRunner(model, config)
    costs = sc.step_costs(runner, config, "tiny-llama")
    assert costs is not None
    assert sorted(costs.ms) == [1, 2, 4, 8, 16, 32, 64]
    for b, points in costs.ms.items():
        drafts = [d for d, _ in points]
        assert drafts == sorted({0, 1, 2, 3, b, 2 * b, 3 * b})
        assert all(ms > 0 for _, ms in points)
    assert costs.ratio(1, 3) > 1.0 and costs.ratio(65, 1) == float("inf")
    assert runner.generators == {}  # the measuring requests were released
    # the engine serves on the same runner with the measured costs
    sink = ListSink()
    engine = Engine(config, runner, ByteTokenizer(), sink, vocab_size=256, step_costs=costs)
    add_request(engine, "r", "abc abc abc", SamplingParams(temperature=0.0, max_tokens=12))
    run_to_end(engine)
    assert sum(1 for o in sink.of("r") if o.token_id is not None) == 12


def test_the_measurement_is_cached_and_forced_again(model, cache, monkeypatch) -> None:
    config = _config(max_num_seqs=8, num_kv_blocks=32)  # a pool of 6 sequences' room
    runner = TorchModelRunner(model, config)
    first = sc.step_costs(runner, config, "tiny-llama")
    [cached] = (cache / "tuning").glob("steps-*.json")
    calls = []
    measure = sc.measure

    def counted(*args: object) -> StepCosts:
        calls.append(1)
        return measure(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(sc, "measure", counted)
    again = sc.step_costs(runner, config, "tiny-llama")
    assert again == first and calls == []  # read back
    assert first is not None and sorted(first.ms) == [1, 2, 4]  # what the pool holds
    sc.step_costs(runner, config, "other-model")  # another model: measured
    assert calls == [1]
    sc.step_costs(runner, config, "tiny-llama", force=True)
    assert calls == [1, 1]
    cached.write_text("{not json")  # a broken file: measured again, not a failed start
    assert sc.step_costs(runner, config, "tiny-llama") is not None
    assert calls == [1, 1, 1]
    assert not list((cache / "tuning").glob("*.tmp"))


def test_a_pool_too_small_for_one_sequence_measures_nothing(model) -> None:
    config = _config(max_num_seqs=1, max_model_len=32, num_kv_blocks=2)
    assert sc.step_costs(TorchModelRunner(model, config), config, "m") is None


def test_none_without_ngram_speculation(model) -> None:
    off = _config(speculative_config=None)
    assert sc.step_costs(TorchModelRunner(model, off), off, "m") is None
    draft = SpeculativeConfig(method="draft_model", model="tiny")
    config = _config(speculative_config=draft)
    assert sc.step_costs(TorchModelRunner(model, config), config, "m") is None


def test_a_measurement_on_a_busy_machine_serves_but_is_not_kept(model, cache, monkeypatch) -> None:
    # the process's threads waited for a CPU for longer than the measurement took: another
    # process had the cores; the costs serve this start, the next one measures again
    waits = iter([(0.0, 0.0), (1e6, 0.0)])
    monkeypatch.setattr(sc, "waited_ms", lambda: next(waits))
    config = _config(num_kv_blocks=32)
    assert sc.step_costs(TorchModelRunner(model, config), config, "tiny-llama") is not None
    assert not list((cache / "tuning").glob("steps-*.json"))
