"""The continuous scheduler's KV blocks under the engine (fake runner, no torch): a
randomized run of admissions, aborts, finishes and preemptions never leaks a block, never
hands a block to two writers, and every chunk's table covers its positions."""

import itertools
import random

import pytest

from adapters.fake import ByteTokenizer
from adapters.fake.runner import FakeModelRunner
from application.engine.engine import Engine
from domain.config import EngineConfig
from domain.errors import InvalidParameterError
from domain.kv_blocks import BlockManager
from domain.request import AdmitCall, RequestContext
from domain.sampling import SamplingParams
from domain.scheduler import ContinuousScheduler
from tests.fakes import ListSink
from tests.support.engine_calls import add_request


def check_counts(blocks: BlockManager, live: set[str]) -> None:
    """Reference counts match the block tables; free blocks are unreferenced."""
    counts = [0] * blocks.num_blocks
    for request_id in live:
        for block_id in blocks.block_table(request_id):
            counts[block_id] += 1
    assert [b.ref_count for b in blocks.blocks] == counts
    assert blocks.num_free_blocks == sum(c == 0 for c in counts)


def test_a_random_run_never_leaks_or_shares_a_written_block() -> None:
    rng = random.Random(15)
    config = EngineConfig(
        max_num_seqs=6, max_model_len=96, num_kv_blocks=14, max_num_batched_tokens=40
    )
    runner = FakeModelRunner()  # raises on a table short of its chunk or a block two write
    engine = Engine(config, runner, ByteTokenizer(), ListSink())
    scheduler = engine.scheduler
    assert isinstance(scheduler, ContinuousScheduler)
    blocks = scheduler.blocks
    system = [rng.randrange(1, 250) for _ in range(40)]  # a shared prefix, for cache hits
    live: list[str] = []
    preempted = 0
    for step in range(3000):
        if rng.random() < 0.3 and engine.scheduler.room() > 4:
            prompt = rng.choice([system, system[:20], []]) + [
                rng.randrange(1, 250) for _ in range(rng.randrange(1, 30))
            ]
            params = SamplingParams(
                max_tokens=rng.randrange(1, 40),
                ignore_eos=True,
                prompt_logprobs=rng.random() < 0.1,
            )
            n = rng.choice([1, 1, 1, 2, 3])
            ids = [f"r{step}-{i}" for i in range(n)]
            context = RequestContext(priority=rng.choice([0, 0, 1]))
            engine.admit(AdmitCall(tuple(ids), (prompt,), params, n, context=context))
            live += ids
        if live and rng.random() < 0.05:
            engine.abort(live.pop(rng.randrange(len(live))))
        preempted += len(engine.step().preempted)
        running = {r.request_id for r in scheduler.running}
        check_counts(blocks, running)
    for _ in range(2000):
        engine.step()  # the last one releases the last finished requests
    assert scheduler.running == [] and len(scheduler.waiting) == 0
    assert blocks.num_free_blocks == blocks.num_blocks
    check_counts(blocks, set())
    assert preempted > 0, "the pool is small enough to preempt"
    assert blocks.prefix_hit_tokens > 0, "the shared prefix was reused"


def test_blocks_running_out_preempt_the_youngest_and_it_recomputes() -> None:
    # 2 sequences of 32 positions; each request reaches 3 blocks, so both cannot finish.
    config = EngineConfig(max_num_seqs=2, max_model_len=48, num_kv_blocks=4)
    ticks = itertools.count()
    engine = Engine(
        config, FakeModelRunner(), ByteTokenizer(), sink := ListSink(), clock=lambda: next(ticks)
    )
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    add_request(engine, "old", [7] * 10, params)
    add_request(engine, "young", [9] * 10, params)  # arrives later
    preempted: list[str] = []
    for _ in range(500):
        preempted += engine.step().preempted
    assert not engine.has_work()
    assert preempted and set(preempted) == {"young"}
    for request_id in ("old", "young"):
        assert len([o for o in sink.outputs if o.request_id == request_id]) == 30
    assert engine.scheduler.blocks.num_free_blocks == 4  # type: ignore[attr-defined]


@pytest.mark.parametrize("caching", [True, False])
def test_a_repeated_prompt_computes_only_its_last_block_with_prefix_caching(caching) -> None:
    config = EngineConfig(max_num_seqs=2, max_model_len=96, prefix_caching=caching)
    engine = Engine(config, FakeModelRunner(), ByteTokenizer(), ListSink())
    prompt = list(range(1, 41))  # 40 tokens: two full blocks, then 8 positions
    prefill = []
    for name in ("first", "second"):
        add_request(engine, name, prompt, SamplingParams(max_tokens=3, ignore_eos=True))
        prefill.append(0)
        for _ in range(10):
            prefill[-1] += engine.step().scheduler.prefill_tokens
    assert prefill == ([40, 8] if caching else [40, 40])


def test_a_cache_salt_shares_blocks_only_with_the_same_salt() -> None:
    config = EngineConfig(max_num_seqs=2, max_model_len=96)
    engine = Engine(config, FakeModelRunner(), ByteTokenizer(), ListSink())
    prompt = list(range(1, 41))  # two full blocks, then 8 positions
    prefill = {}
    for name, salt in [("open", None), ("a1", "tenant-a"), ("b1", "tenant-b"), ("a2", "tenant-a")]:
        params = SamplingParams(max_tokens=2, ignore_eos=True, cache_salt=salt)
        add_request(engine, name, prompt, params)
        prefill[name] = sum(engine.step().scheduler.prefill_tokens for _ in range(6))
    # the unsalted request's blocks serve no salted one; a salt's serve only that salt
    assert prefill == {"open": 40, "a1": 40, "b1": 40, "a2": 8}


def test_an_empty_or_oversized_cache_salt_is_refused() -> None:
    with pytest.raises(InvalidParameterError, match="cache_salt"):
        SamplingParams(cache_salt="")
    with pytest.raises(InvalidParameterError, match="cache_salt"):
        SamplingParams(cache_salt="x" * 257)


@pytest.mark.parametrize("caching", [True, False])
def test_identical_prompts_queued_together_compute_the_prompt_once(caching) -> None:
    """In-flight sharing (Tinker's num_samples, a burst of one prompt): requests admitted
    while another computes their very prompt wait for it and fork its full blocks; with
    prefix caching off each computes its own. Every request still gets all its tokens and
    every block comes back."""
    config = EngineConfig(
        max_num_seqs=5, max_model_len=128, max_num_batched_tokens=256, prefix_caching=caching
    )
    engine = Engine(config, FakeModelRunner(), ByteTokenizer(), sink := ListSink())
    prompt = list(range(1, 41))  # 40 tokens: two full blocks, then 8 positions
    for i in range(4):
        add_request(engine, f"s{i}", prompt, SamplingParams(max_tokens=5, ignore_eos=True, seed=i))
    add_request(engine, "logprobs", prompt, SamplingParams(max_tokens=2, prompt_logprobs=True))
    prefill = 0
    for _ in range(60):
        prefill += engine.step().scheduler.prefill_tokens
    # caching: s0 computes 40, s1..s3 the 8 after the two shared blocks, and the request
    # asking for prompt logprobs computes its whole prompt
    assert prefill == (40 + 3 * 8 + 40 if caching else 5 * 40)
    for i in range(4):
        assert len([o for o in sink.outputs if o.request_id == f"s{i}" and o.token_id]) == 5
    blocks = engine.scheduler.blocks  # type: ignore[attr-defined]
    assert blocks.num_free_blocks == blocks.num_blocks and not engine.has_work()
