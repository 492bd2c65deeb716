"""The ModelRunner port's contract, held by the fake and the torch runner (a tiny float32
model): batches are built by hand from ``domain.scheduler``, as a scheduler would."""

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from adapters.fake.runner import FakeModelRunner
from adapters.torch.loading.loader import load_model
from adapters.torch.runtime.runner import TorchModelRunner
from domain.config import EngineConfig
from domain.ports import ModelRunner
from domain.request import Request
from domain.sampling import SamplingParams
from domain.scheduler import RunnerOutput, ScheduledChunk, SchedulerOutput
from tests.support.tiny_models import VOCAB, save_tiny_model

CONFIG = EngineConfig(max_num_seqs=3, max_model_len=64)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 17, 42, 8, 99, 3, 61, 7], [11, 12], [200, 1, 30, 4, 50]]


@dataclass
class Impl:
    make: Callable[[], ModelRunner]
    held: Callable[[ModelRunner], set[str]]  # the requests holding runner state
    vocab_size: int


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    folder: Path = tmp_path_factory.mktemp("llama")
    save_tiny_model("llama", folder)
    return load_model(folder, dtype=torch.float32)


@pytest.fixture(params=["fake", "torch"])
def impl(request) -> Impl:
    if request.param == "fake":
        return Impl(FakeModelRunner, lambda r: set(r.live), 259)  # type: ignore[attr-defined]
    model = request.getfixturevalue("tiny_model")
    return Impl(
        lambda: TorchModelRunner(model, CONFIG),
        lambda r: set(r.generators),  # type: ignore[attr-defined]
        VOCAB,
    )


_ids: Iterator[int] = iter(range(10**9))


def new_request(prompt: Sequence[int], params: SamplingParams = GREEDY) -> Request:
    return Request(f"req-{next(_ids)}", list(prompt), params, arrival_time_s=0.0)


def chunk(request: Request, num_tokens: int | None = None) -> ScheduledChunk:
    """The request's next ``num_tokens`` (default: all it has not computed yet), with a
    block table of its own among any ``max_num_seqs`` requests made one after another
    (the KV pool holds that many at ``max_model_len``)."""
    remaining = request.num_tokens - request.num_computed_tokens
    per = CONFIG.blocks_per_sequence
    first = int(request.request_id.removeprefix("req-")) % CONFIG.max_num_seqs * per
    table = tuple(range(first, first + per))
    return ScheduledChunk(request, request.num_computed_tokens, num_tokens or remaining, table)


def step(runner: ModelRunner, chunks: list[ScheduledChunk]) -> RunnerOutput:
    """Run ``chunks`` and advance their requests as the scheduler does."""
    result = runner.execute(SchedulerOutput(chunks))
    for c in chunks:
        c.request.num_computed_tokens += c.num_tokens
        if c.request.request_id in result.sampled_token_ids:
            c.request.generated_token_ids.append(result.sampled_token_ids[c.request.request_id])
    return result


def assert_token(result: RunnerOutput, request: Request, vocab_size: int) -> int:
    token = result.sampled_token_ids[request.request_id]
    assert isinstance(token, int) and 0 <= token < vocab_size
    return token


def test_a_step_samples_exactly_for_chunks_reaching_their_newest_token(impl: Impl) -> None:
    runner = impl.make()
    whole, partial = new_request(PROMPTS[0]), new_request(PROMPTS[2])
    result = step(runner, [chunk(whole), chunk(partial, 2)])
    assert set(result.sampled_token_ids) == {whole.request_id}
    assert_token(result, whole, impl.vocab_size)
    # decode: the newest (sampled) token, one at a time
    result = step(runner, [chunk(whole), chunk(partial)])
    assert set(result.sampled_token_ids) == {whole.request_id, partial.request_id}


def test_a_prompt_chunked_over_two_steps_samples_once_and_as_if_whole(impl: Impl) -> None:
    runner = impl.make()
    chunked, whole = new_request(PROMPTS[0]), new_request(PROMPTS[0])
    assert step(runner, [chunk(chunked, 3)]).sampled_token_ids == {}
    first = step(runner, [chunk(chunked)])
    assert set(first.sampled_token_ids) == {chunked.request_id}
    alone = step(runner, [chunk(whole)])
    assert first.sampled_token_ids[chunked.request_id] == alone.sampled_token_ids[whole.request_id]
    for _ in range(3):  # and decoding on from there: the same continuation
        a, b = step(runner, [chunk(chunked), chunk(whole)]).sampled_token_ids.values()
        assert a == b


def test_every_request_of_a_step_gets_a_token(impl: Impl) -> None:
    runner = impl.make()
    requests = [new_request(p) for p in PROMPTS]
    result = step(runner, [chunk(r) for r in requests])
    assert set(result.sampled_token_ids) == {r.request_id for r in requests}
    for r in requests:
        assert_token(result, r, impl.vocab_size)


def test_release_frees_the_state_and_is_idempotent(impl: Impl) -> None:
    runner = impl.make()
    requests = [new_request(p) for p in PROMPTS]  # as many as the runner has room for
    step(runner, [chunk(r) for r in requests])
    ids = {r.request_id for r in requests}
    assert impl.held(runner) == ids
    runner.release([requests[1].request_id])
    assert impl.held(runner) == ids - {requests[1].request_id}
    runner.release([requests[1].request_id, "never-seen"])  # again, and unknown: harmless
    runner.release([r.request_id for r in requests])
    assert impl.held(runner) == set()
    # the room is back: as many new requests run again, and decode on
    fresh = [new_request(p) for p in PROMPTS]
    for _ in range(2):
        result = step(runner, [chunk(r) for r in fresh])
        assert set(result.sampled_token_ids) == {r.request_id for r in fresh}


def test_a_released_requests_successor_sees_none_of_its_state(impl: Impl) -> None:
    runner = impl.make()
    old = new_request(PROMPTS[0])
    step(runner, [chunk(old)])
    step(runner, [chunk(old)])
    runner.release([old.request_id])
    fresh, reference = new_request(PROMPTS[1]), new_request(PROMPTS[1])
    got = step(runner, [chunk(fresh)]).sampled_token_ids[fresh.request_id]
    assert got == step(impl.make(), [chunk(reference)]).sampled_token_ids[reference.request_id]


def test_the_same_seed_samples_the_same_tokens(impl: Impl) -> None:
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=8, ignore_eos=True)

    def sample(runner: ModelRunner) -> list[int]:
        request = new_request(PROMPTS[0], params)
        return [
            step(runner, [chunk(request)]).sampled_token_ids[request.request_id] for _ in range(5)
        ]

    runner = impl.make()
    first = sample(runner)
    assert sample(runner) == first  # the same runner, later
    assert sample(impl.make()) == first  # another runner
