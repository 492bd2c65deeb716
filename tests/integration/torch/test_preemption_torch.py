"""Preemption on the torch runner: a preempted request's KV slot and generator are released,
it is prefilled again (prompt + generated tokens) in a fresh slot, and its output is the
output it has alone (greedy, and seeded sampling)."""

from pathlib import Path

import pytest
import torch

from adapters.fake import ByteTokenizer
from adapters.torch.loading.loader import load_model
from adapters.torch.runtime.runner import TorchModelRunner
from application.engine.engine import Engine
from domain.config import EngineConfig
from domain.request import RequestContext
from domain.sampling import SamplingParams
from tests.fakes import ListSink, ManualClock
from tests.support.engine_calls import add_request
from tests.support.tiny_models import save_tiny_model

TOKENIZER = ByteTokenizer()
GREEDY = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, seed=1234, max_tokens=14, ignore_eos=True)
HIGH = RequestContext(priority=1)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder: Path = tmp_path_factory.mktemp("llama")
    save_tiny_model("llama", folder)
    return load_model(folder, dtype=torch.float32)


def engine(model, max_num_seqs: int) -> tuple[Engine, TorchModelRunner, ListSink]:
    config = EngineConfig(max_num_seqs=max_num_seqs, max_model_len=96)
    runner = TorchModelRunner(model, config)
    sink = ListSink()
    clock = ManualClock()
    return Engine(config, runner, TOKENIZER, sink, clock=clock), runner, sink


def tokens(sink: ListSink, request_id: str) -> list[int | None]:
    return [o.token_id for o in sink.of(request_id)]


def alone(model, prompt: str, params: SamplingParams) -> list[int | None]:
    e, _, sink = engine(model, 1)
    add_request(e, "alone", prompt, params)
    while e.has_work():
        e.step()
    return tokens(sink, "alone")


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_preempted_request_ends_with_the_tokens_it_has_alone(model, params) -> None:
    e, runner, sink = engine(model, max_num_seqs=1)
    add_request(e, "low", "A low priority prompt", params)
    for _ in range(6):
        e.step()
    assert len(sink.of("low")) == 6
    e.clock.now += 1.0  # type: ignore[attr-defined]
    add_request(e, "high", "Urgent!", GREEDY, context=HIGH)
    stats = e.step()
    assert stats.preempted == ("low",)
    assert "low" not in runner.generators and "high" in runner.generators
    while e.has_work():
        e.step()
    assert tokens(sink, "low") == alone(model, "A low priority prompt", params)
    assert tokens(sink, "high") == alone(model, "Urgent!", GREEDY)
    assert runner.generators == {}


def test_preemption_in_a_shared_batch_keeps_every_output(model) -> None:
    """Two slots: the youngest low-priority request is preempted while another keeps its
    slot; both low-priority requests, and the high one, end as they do alone."""
    prompts = {"old": "An old request", "young": "A young one", "vip": "VIP"}
    e, runner, sink = engine(model, max_num_seqs=2)
    add_request(e, "old", prompts["old"], GREEDY)
    e.clock.now += 1.0  # type: ignore[attr-defined]
    add_request(e, "young", prompts["young"], GREEDY)
    for _ in range(4):
        e.step()
    e.clock.now += 1.0  # type: ignore[attr-defined]
    add_request(e, "vip", prompts["vip"], GREEDY, context=HIGH)
    assert e.step().preempted == ("young",)
    while e.has_work():
        e.step()
    for request_id, prompt in prompts.items():
        assert tokens(sink, request_id) == alone(model, prompt, GREEDY), request_id
    assert runner.generators == {}
