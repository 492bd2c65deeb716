"""The draft-model method over fake runners: a draft runner that writes what the target
writes gets every draft accepted (the same output in far fewer steps), one that writes
something else stops drafting after the probe, a failing one costs only drafts; its KV pool
is emptied as requests end; a draft model with another tokenizer is refused at start-up,
naming the flag; and the container wires one in from ``--speculative-config``."""

from collections.abc import Callable

import pytest

from adapters.fake import ByteTokenizer
from adapters.fake.runner import FakeModelRunner, next_token, reply_script
from application.engine.engine import Engine
from application.engine.speculation import DraftModel
from domain.config import EngineConfig
from domain.errors import InvalidParameterError
from domain.request import Request, StepOutput
from domain.sampling import SamplingParams
from domain.scheduler import RunnerOutput, ScheduledChunk, SchedulerOutput
from domain.speculation import SpeculativeConfig
from entrypoints.backends import check_draft_tokenizer
from entrypoints.config import ServerConfig
from entrypoints.container import create_container
from tests.fakes import ListSink
from tests.support.byte_tokenizer import byte_level_tokenizer
from tests.support.engine_calls import add_request

TOKENIZER = ByteTokenizer()
REPLY = "The quick brown fox jumps over the lazy dog, twice: the quick brown fox."
SPEC = SpeculativeConfig(
    method="draft_model", model="fake", num_speculative_tokens=3, disable_by_batch_size=None
)


class Counting(FakeModelRunner):
    """A fake runner that keeps its steps' chunks."""

    def __init__(self, script: Callable[[Request], int]) -> None:
        super().__init__(script=script)
        self.chunks: list[ScheduledChunk] = []

    def execute(self, batch: SchedulerOutput) -> RunnerOutput:
        self.chunks += batch.chunks
        return super().execute(batch)


class Failing(FakeModelRunner):
    def execute(self, batch: SchedulerOutput) -> RunnerOutput:
        raise RuntimeError("the draft model broke")


def run(
    draft: FakeModelRunner | None, prompts: int = 1, **params: object
) -> tuple[list[list[StepOutput]], Engine, int]:
    target = FakeModelRunner(script=reply_script(TOKENIZER, REPLY))
    sink = ListSink()
    config = EngineConfig(speculative_config=SPEC if draft is not None else None)
    engine = Engine(config, target, TOKENIZER, sink, draft=draft)
    for i in range(prompts):
        add_request(engine, f"r{i}", f"say it {i}", SamplingParams(temperature=0.0, **params))  # type: ignore[arg-type]
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
    return [sink.of(f"r{i}") for i in range(prompts)], engine, steps


def tokens(outputs: list[StepOutput]) -> list[int | None]:
    return [o.token_id for o in outputs]


def draft_pool(engine: Engine) -> DraftModel:
    assert engine.speculator is not None and engine.speculator.draft is not None
    return engine.speculator.draft


def test_a_draft_model_that_writes_what_the_target_writes() -> None:
    plain, _, plain_steps = run(None, prompts=3, max_tokens=100)
    draft = Counting(reply_script(TOKENIZER, REPLY))
    fast, engine, steps = run(draft, prompts=3, max_tokens=100)
    assert [tokens(f) for f in fast] == [tokens(p) for p in plain]
    assert steps < plain_steps / 3, (steps, plain_steps)
    # Catching up on verified tokens (the last draft, which the draft model had not run,
    # and the newest) runs them as decode rows: one token and a "draft" row after it.
    generated = [c for c in draft.chunks if c.start >= c.request.num_prompt_tokens]
    assert all(c.num_tokens == 1 for c in generated)
    assert sum(len(c.drafts) == 1 for c in generated) > 10
    pool = draft_pool(engine).blocks
    assert pool.usage == 0.0  # every request's KV went back,
    assert pool.num_cached_blocks >= 3 * 4  # its full blocks of verified tokens cached


def test_a_draft_model_that_is_always_wrong_stops_after_the_probe() -> None:
    plain, _, _ = run(None, max_tokens=70, ignore_eos=True)
    wrong = FakeModelRunner(script=next_token(259))  # never the reply's next byte
    fast, engine, _ = run(wrong, max_tokens=70, ignore_eos=True)
    assert tokens(fast[0]) == tokens(plain[0])
    probe = SPEC.probe_tokens
    drafted = len(wrong.steps)  # its forwards: one per draft (none accepted)
    assert probe <= drafted <= probe + SPEC.num_speculative_tokens
    assert draft_pool(engine).blocks.usage == 0.0


def test_a_failing_draft_model_costs_only_its_drafts() -> None:
    plain, _, _ = run(None, max_tokens=30)
    fast, engine, _ = run(Failing(), max_tokens=30)
    assert tokens(fast[0]) == tokens(plain[0]) and fast[0][-1].error is None
    assert draft_pool(engine).blocks.usage == 0.0


def test_a_draft_model_with_another_tokenizer_is_refused() -> None:
    check_draft_tokenizer("same", TOKENIZER, ByteTokenizer())
    with pytest.raises(InvalidParameterError, match="speculative_config") as e:
        check_draft_tokenizer("other", TOKENIZER, byte_level_tokenizer(""))
    assert "'other': its tokenizer is not the target model's" in str(e.value)


def test_the_container_wires_the_draft_model_in() -> None:
    config = ServerConfig.for_model(None, runner="fake", speculative_config=SPEC)
    engine = create_container(config).engine()
    assert isinstance(draft_pool(engine).runner, FakeModelRunner)
    plain = ServerConfig.for_model(None, runner="fake")
    assert create_container(plain).engine().speculator is None
