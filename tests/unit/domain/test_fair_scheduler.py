"""Fair scheduling in the continuous policy: weighted fair queuing across tenants,
priorities, preemption with recompute (no model, no torch)."""

from collections import Counter
from collections.abc import Sequence

import pytest

from adapters.fake import ByteTokenizer
from adapters.fake.observer import RecordingObserver
from application.engine.engine import Engine
from domain.config import EngineConfig
from domain.errors import InvalidParameterError
from domain.request import Request, RequestContext
from domain.sampling import SamplingParams
from domain.scheduler import ContinuousScheduler, RunnerOutput, SchedulerOutput
from tests.fakes import ListSink, ManualClock
from tests.support.engine_calls import add_request
from tests.support.engine_runs import run_to_end

EOS = 0
TOKEN = 7  # what every request samples in the scheduler-only tests (never EOS)


def request(
    request_id: str,
    tenant: str | None = None,
    *,
    priority: int = 0,
    prompt_len: int = 4,
    max_tokens: int = 16,
    arrival: float = 0.0,
) -> Request:
    params = SamplingParams(max_tokens=max_tokens)
    context = RequestContext(tenant_id=tenant, priority=priority)
    return Request(request_id, list(range(1, prompt_len + 1)), params, arrival, context=context)


def scheduler(
    max_num_seqs: int = 4, budget: int = 256, max_waiting: int = 512, **kwargs
) -> ContinuousScheduler:
    config = EngineConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_waiting_requests=max_waiting,
    )
    return ContinuousScheduler(config, [EOS], **kwargs)


def step(s: ContinuousScheduler) -> SchedulerOutput:
    output = s.schedule()
    tokens = {c.request.request_id: TOKEN for c in output.chunks if c.samples}
    s.update_from_output(output, RunnerOutput(sampled_token_ids=tokens))
    return output


def admitted(output: SchedulerOutput) -> list[str]:
    """Requests whose first chunk ran in this step."""
    return [c.request.request_id for c in output.chunks if c.start == 0]


def tokens_by_tenant(output: SchedulerOutput) -> Counter[str | None]:
    counts: Counter[str | None] = Counter()
    for c in output.chunks:
        counts[c.request.context.tenant_id] += c.num_tokens
    return counts


class Flood:
    """Keeps ``backlog`` requests of ``tenant`` waiting, topping up after every step."""

    def __init__(self, s: ContinuousScheduler, tenant: str, backlog: int = 16) -> None:
        self.s, self.tenant, self.backlog, self.sent = s, tenant, backlog, 0

    def top_up(self) -> None:
        waiting = sum(r.context.tenant_id == self.tenant for r in self.s.waiting)
        for _ in range(self.backlog - waiting):
            self.s.add_request(request(f"{self.tenant}{self.sent}", self.tenant))
            self.sent += 1


def saturated_shares(s: ContinuousScheduler, steps: int) -> Counter[str | None]:
    """Tenants A and B both flooding ``s`` for ``steps`` steps: the tokens each got in the
    steps past the first 200 (the start)."""
    floods = [Flood(s, "A"), Flood(s, "B")]
    totals: Counter[str | None] = Counter()
    for i in range(steps):
        for flood in floods:
            flood.top_up()
        counts = tokens_by_tenant(step(s))
        if i >= 200:
            totals += counts
    return totals


# Admission


def test_single_tenant_equal_priority_admits_fcfs() -> None:
    s = scheduler(max_num_seqs=2)
    names = [f"r{i}" for i in range(9)]
    for i, name in enumerate(names):
        s.add_request(request(name, "t", priority=3, max_tokens=1 + i % 3, arrival=float(i)))
    order = []
    while s.has_work():
        order += admitted(step(s))
    assert order == names


def test_a_flooding_tenant_delays_another_by_about_one_request() -> None:
    s = scheduler(max_num_seqs=4)  # a request: 1 prefill step + 15 decode steps
    for i in range(200):
        s.add_request(request(f"a{i}", "A"))
    for _ in range(30):
        step(s)
    s.add_request(request("b", "B"))
    waited = 0
    while "b" not in admitted(step(s)):
        waited += 1
        assert waited < 100, "never admitted"
    # FCFS would make it wait for ~190 / 4 requests of 16 steps each.
    assert waited <= 16 + 2


def test_weights_3_to_1_give_a_3_to_1_token_share_under_saturation() -> None:
    s = scheduler(max_num_seqs=8, tenant_weights={"A": 3.0})
    totals = saturated_shares(s, 1200)
    assert 2.7 <= totals["A"] / totals["B"] <= 3.3


def test_set_tenant_weights_changes_the_share() -> None:
    s = scheduler(max_num_seqs=8)
    s.set_tenant_weights({"B": 2.0})
    totals = saturated_shares(s, 1000)
    assert 1.8 <= totals["B"] / totals["A"] <= 2.2


@pytest.mark.parametrize("weight", [0.0, -1.0, float("nan"), float("inf")])
def test_a_weight_must_be_positive(weight: float) -> None:
    with pytest.raises(InvalidParameterError, match="tenant_weights"):
        scheduler(tenant_weights={"A": weight})
    s = scheduler()
    with pytest.raises(InvalidParameterError):
        s.set_tenant_weights({"A": 1.0, "B": weight})


def test_an_idle_tenant_banks_no_credit() -> None:
    s = scheduler(max_num_seqs=4)
    a = Flood(s, "A")
    for _ in range(400):  # A alone: its virtual time grows by ~4 tokens a step
        a.top_up()
        step(s)
    b = Flood(s, "B")
    shares: list[Counter[str | None]] = []
    for _ in range(80):
        a.top_up()
        b.top_up()
        shares.append(tokens_by_tenant(step(s)))
    # B starts level with A: it gets about half, not the whole batch for ~400 steps.
    later = sum(shares[20:], Counter())
    assert later["A"] >= 0.35 * (later["A"] + later["B"])
    assert later["B"] >= 0.35 * (later["A"] + later["B"])
    # A keeps being admitted soon after B arrives.
    assert sum(shares[:24], Counter())["A"] > 0


def test_a_tenant_idle_for_a_while_rejoins_level_with_the_active_one() -> None:
    s = scheduler(max_num_seqs=4)
    s.add_request(request("b0", "B", max_tokens=4))
    while s.has_work():
        step(s)
    a = Flood(s, "A")
    for _ in range(300):
        a.top_up()
        step(s)
    assert s.virtual_time("B") < s.virtual_time("A") - 500  # B fell behind while idle
    s.add_request(request("b1", "B"))
    assert s.virtual_time("B") == pytest.approx(s.virtual_time("A"), abs=1.0)


def test_the_highest_priority_waiting_request_is_admitted_first() -> None:
    s = scheduler(max_num_seqs=1)
    s.add_request(request("running", priority=5, max_tokens=3))
    step(s)
    s.add_request(request("low", "A", priority=0))
    s.add_request(request("mid", "B", priority=1))
    s.add_request(request("high", "A", priority=2))
    order = []
    while s.has_work():
        order += admitted(step(s))
    assert order == ["high", "mid", "low"]


def test_a_short_budget_goes_first_to_the_tenant_with_less_service() -> None:
    s = scheduler(max_num_seqs=2, budget=16, tenant_weights={"B": 4.0})
    s.add_request(request("a", "A", prompt_len=10))
    s.add_request(request("b", "B", prompt_len=40))
    first = step(s)
    assert [(c.request.request_id, c.start, c.num_tokens) for c in first.chunks] == [
        ("a", 0, 10),
        ("b", 0, 6),
    ]
    # A: 10 tokens at weight 1; B: 6 at weight 4. FCFS would give "a" its decode token first.
    second = step(s)
    assert [(c.request.request_id, c.start, c.num_tokens) for c in second.chunks] == [("b", 6, 16)]


# Preemption


def test_a_higher_priority_request_preempts_the_youngest_lowest_priority_one() -> None:
    s = scheduler(max_num_seqs=3)
    s.add_request(request("old-low", arrival=1.0))
    s.add_request(request("mid", priority=1, arrival=2.0))
    s.add_request(request("young-low", arrival=3.0))
    for _ in range(3):
        step(s)
    victim = next(r for r in s.running if r.request_id == "young-low")
    generated = list(victim.generated_token_ids)
    s.add_request(request("high", priority=2, arrival=4.0))
    output = step(s)
    assert output.preempted == ["young-low"] and "young-low" in output.released
    assert admitted(output) == ["high"]
    assert [r.request_id for r in s.running] == ["mid", "old-low", "high"]  # admission order
    assert [r.request_id for r in s.waiting] == ["young-low"]
    assert victim.num_computed_tokens == 0 and victim.num_preemptions == 1
    assert victim.generated_token_ids == generated  # kept: recomputed, never sent again


def test_equal_priority_never_preempts() -> None:
    s = scheduler(max_num_seqs=2)
    for name in ("a", "b"):
        s.add_request(request(name, priority=1))
    step(s)
    s.add_request(request("c", "other", priority=1))
    output = step(s)
    assert output.preempted == [] and "c" not in admitted(output)


def test_a_preempted_request_recomputes_prompt_and_generated_tokens() -> None:
    s = scheduler(max_num_seqs=1)
    s.add_request(request("low", prompt_len=4, max_tokens=6))
    for _ in range(3):  # prefill + 2 decodes: 3 tokens generated
        step(s)
    s.add_request(request("high", priority=1, max_tokens=2))
    step(s)
    step(s)  # high finishes
    (low,) = s.waiting
    output = s.schedule()
    (chunk,) = output.chunks
    assert (chunk.request.request_id, chunk.start, chunk.num_tokens) == ("low", 0, 7)
    assert chunk.token_ids == [1, 2, 3, 4, TOKEN, TOKEN, TOKEN] and chunk.samples
    s.update_from_output(output, RunnerOutput(sampled_token_ids={"low": TOKEN}))
    assert low.generated_token_ids == [TOKEN] * 4


def test_a_chunked_recompute_samples_only_at_its_last_known_token() -> None:
    s = scheduler(max_num_seqs=1, budget=4)
    s.add_request(request("low", prompt_len=4, max_tokens=8))
    for _ in range(4):  # prefill, then 3 decodes: 4 tokens generated
        step(s)
    s.add_request(request("high", priority=1, max_tokens=1))
    step(s)
    chunks = []
    while len(chunks) < 3:
        output = s.schedule()
        chunks += [(c.start, c.num_tokens, c.samples) for c in output.chunks]
        tokens = {c.request.request_id: TOKEN for c in output.chunks if c.samples}
        s.update_from_output(output, RunnerOutput(sampled_token_ids=tokens))
    # 8 known tokens: two chunks that sample nothing, then the decode of the next token.
    assert chunks == [(0, 4, False), (4, 4, True), (8, 1, True)]


def test_a_recompute_does_not_repeat_prompt_logprobs() -> None:
    s = scheduler(max_num_seqs=1)
    params = SamplingParams(max_tokens=6, prompt_logprobs=True, prompt_top_logprobs=1)
    low = Request("low", [1, 2, 3, 4], params, 0.0)
    s.add_request(low)
    scores = RunnerOutput(
        sampled_token_ids={"low": TOKEN},
        prompt_logprobs={"low": [-1.0, -2.0, -3.0]},
        prompt_top_logprobs={"low": [[(2, -1.0)], [(3, -2.0)], [(4, -3.0)]]},
    )
    s.update_from_output(s.schedule(), scores)
    step(s)
    s.add_request(request("high", priority=1, max_tokens=1))
    assert step(s).preempted == ["low"]
    output = s.schedule()
    assert [(c.request.request_id, c.start) for c in output.chunks] == [("low", 0)]
    s.update_from_output(output, scores)  # the runner scores the prompt again
    assert low.prompt_logprobs == [-1.0, -2.0, -3.0]
    assert low.prompt_top_logprobs == [[(2, -1.0)], [(3, -2.0)], [(4, -3.0)]]
    assert low.generated_token_ids == [TOKEN] * 3


def test_an_aborted_preempted_request_leaves_the_queue() -> None:
    s = scheduler(max_num_seqs=1)
    s.add_request(request("low"))
    step(s)
    s.add_request(request("high", "B", priority=1, max_tokens=2))
    assert step(s).preempted == ["low"]
    aborted = s.abort("low")
    assert aborted is not None and aborted.finish_reason == "abort"
    while s.has_work():
        output = step(s)
        assert "low" not in admitted(output)
    assert s.counts() == (0, 0) and s.room() == s.config.capacity


# With the engine: what clients and observers see


class KVRunner:
    """A fake runner that holds each request's tokens as its "KV cache": a chunk must start
    where the request's cache ends (a preempted request must be released, then start over
    at 0), and the next token depends on every token held, so a recompute that skipped,
    repeated or reordered a token changes the output."""

    def __init__(self) -> None:
        self.kv: dict[str, list[int]] = {}
        self.released: list[str] = []

    def execute(self, batch: SchedulerOutput) -> RunnerOutput:
        sampled = {}
        for c in batch.chunks:
            kv = self.kv.setdefault(c.request.request_id, [])
            assert c.start == len(kv), f"{c.request.request_id}: chunk at {c.start}, kv {len(kv)}"
            kv.extend(c.token_ids)
            if c.samples:
                digest = sum((i + 1) * t for i, t in enumerate(kv)) % 95
                sampled[c.request.request_id] = 3 + 32 + digest  # printable ASCII bytes
        return RunnerOutput(sampled_token_ids=sampled)

    def release(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self.kv.pop(request_id, None)
        self.released.extend(request_ids)


PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def engine(max_num_seqs: int = 2) -> tuple[Engine, KVRunner, ListSink, RecordingObserver]:
    runner, sink, observer = KVRunner(), ListSink(), RecordingObserver()
    config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64)
    clock = ManualClock()
    e = Engine(config, runner, ByteTokenizer(), sink, clock=clock, observer=observer)
    return e, runner, sink, observer


def add(e: Engine, request_id: str, prompt: list[int], priority: int = 0) -> None:
    e.clock.now += 1.0  # type: ignore[attr-defined]
    add_request(e, request_id, prompt, PARAMS, context=RequestContext(priority=priority))


def alone(request_id: str, prompt: list[int]) -> list[int]:
    e, _, sink, _ = engine()
    add(e, request_id, prompt)
    run_to_end(e, max_steps=500)
    return [o.token_id for o in sink.of(request_id) if o.token_id is not None]


PROMPTS = {"old": [40, 41, 42], "young": [50, 51, 52, 53, 54], "vip": [60, 61]}


def test_a_preempted_request_finishes_with_the_tokens_it_would_have_had_each_sent_once() -> None:
    e, runner, sink, observer = engine(max_num_seqs=2)
    add(e, "old", PROMPTS["old"])
    add(e, "young", PROMPTS["young"])
    for _ in range(5):
        e.step()
    add(e, "vip", PROMPTS["vip"], priority=1)
    stats = e.step()
    assert stats.preempted == ("young",) and "young" in runner.released
    assert len(sink.of("young")) == 5
    run_to_end(e, max_steps=500)
    for request_id, prompt in PROMPTS.items():
        outputs = sink.of(request_id)
        tokens = [o.token_id for o in outputs]
        assert tokens == alone(request_id, prompt), request_id
        assert [o.completion_tokens for o in outputs] == list(range(1, 13))  # each once
        assert [o.finished for o in outputs] == [False] * 11 + [True]
    # The high-priority request ran while "young" waited: "young" finished last.
    finished = [r.request_id for step in observer.steps for r in step.finished]
    assert finished == ["old", "vip", "young"]


def test_a_preemption_is_reported_in_step_and_request_stats() -> None:
    e, _, _, observer = engine(max_num_seqs=1)
    add(e, "low", [40, 41, 42, 43])
    for _ in range(4):  # prefill + 3 decodes: 4 tokens generated, the 4th not fed yet
        e.step()
    add(e, "high", [60, 61], priority=5)
    run_to_end(e, max_steps=500)
    preempted = [s.preempted for s in observer.steps if s.preempted]
    assert preempted == [("low",)]
    assert {r.request_id: r.preemptions for r in observer.finished.values()} == {
        "low": 1,
        "high": 0,
    }
    # The recompute of "low" (4 prompt + 4 generated tokens) counts as prefill work.
    rows = [row for s in observer.steps for row in s.rows if row.request_id == "low"]
    recompute = rows[4]
    assert (recompute.prefill_tokens, recompute.decode_tokens) == (8, 0)
    assert [(r.prefill_tokens, r.decode_tokens) for r in rows[5:]] == [(0, 1)] * 7
    decoded = sum(s.scheduler.decode_tokens for s in observer.steps)
    assert decoded == 3 + 11 + 7  # low before, high, low after: no recomputed token counted
