"""Engine and AsyncEngine with the fake runner and the byte tokenizer (no torch)."""

import asyncio
import threading

import pytest

from adapters.fake import ByteTokenizer
from adapters.fake.runner import FakeModelRunner, reply_script
from application.engine.async_engine import AsyncEngine, QueueOutputSink
from application.engine.engine import STEP_FAILED, Engine
from domain.config import EngineConfig
from domain.errors import (
    EmptyPromptError,
    InvalidParameterError,
    PromptTooLongError,
    QueueFullError,
)
from domain.request import AdmitCall, Request, StepOutput
from domain.sampling import SamplingParams
from tests.fakes import ListSink
from tests.support.engine_calls import add_request
from tests.support.engine_runs import run_to_end, wait_for

TOKENIZER = ByteTokenizer()
EOS = next(iter(TOKENIZER.eos_token_ids))


def scripted(text: str):
    return reply_script(TOKENIZER, text)


def make_engine(text: str = "Hello", **config) -> tuple[Engine, FakeModelRunner, ListSink]:
    runner = FakeModelRunner(script=scripted(text))
    sink = ListSink()
    engine = Engine(EngineConfig(**config), runner, TOKENIZER, sink)
    return engine, runner, sink


def make_async(runner: FakeModelRunner) -> tuple[AsyncEngine, QueueOutputSink]:
    engine = AsyncEngine(EngineConfig(), runner, TOKENIZER)
    return engine, engine.sink


def params(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kwargs)


def test_a_request_streams_its_text_then_finishes_with_usage() -> None:
    engine, runner, sink = make_engine("Hello")
    add_request(engine, "a", "hi", params())
    run_to_end(engine)
    outputs = sink.of("a")
    assert "".join(o.text_delta for o in outputs) == "Hello"
    last = outputs[-1]
    assert (last.finished, last.finish_reason) == (True, "eos")
    assert (last.prompt_tokens, last.completion_tokens) == (3, 6)  # <bos>hi; Hello + EOS
    assert all(not o.finished for o in outputs[:-1])
    engine.step()
    assert runner.live == set()  # the finished request's runner state was released


def test_a_stop_string_across_tokens_ends_the_request_without_its_text() -> None:
    engine, _, sink = make_engine("The answer is 42. END of story")
    add_request(engine, "a", "q", params(stop=("END",)))
    run_to_end(engine)
    outputs = sink.of("a")
    assert "".join(o.text_delta for o in outputs) == "The answer is 42. "
    assert outputs[-1].finish_reason == "stop"


@pytest.mark.parametrize(
    ("reply", "sampling", "text", "finish", "stop_reason"),
    [
        ("The answer is 42. END", params(stop=("42", "END")), "The answer is ", "stop", "42"),
        (
            "ab. cd",
            params(stop_token_ids=(TOKENIZER.encode(".", add_special_tokens=False)[0],)),
            "ab",
            "stop",
            TOKENIZER.encode(".", add_special_tokens=False)[0],
        ),
        ("Hello", params(), "Hello", "eos", None),
        ("Hello", params(max_tokens=3), "Hel", "length", None),
        # The last token allowed completes a stop string: a stop, as in vLLM.
        ("Hello", params(max_tokens=3, stop=("el",)), "H", "stop", "el"),
    ],
)
def test_the_last_output_says_which_stop_string_or_id_stopped_it(
    reply, sampling, text, finish, stop_reason
) -> None:
    engine, _, sink = make_engine(reply)
    add_request(engine, "a", "q", sampling)
    run_to_end(engine)
    outputs = sink.of("a")
    assert "".join(o.text_delta for o in outputs) == text
    assert (outputs[-1].finish_reason, outputs[-1].stop_reason) == (finish, stop_reason)
    assert all(o.stop_reason is None for o in outputs[:-1])


def test_max_tokens_ends_with_length() -> None:
    engine, _, sink = make_engine("Hello world")
    add_request(engine, "a", "q", params(max_tokens=4))
    run_to_end(engine)
    outputs = sink.of("a")
    assert "".join(o.text_delta for o in outputs) == "Hell"
    assert (outputs[-1].finish_reason, outputs[-1].completion_tokens) == ("length", 4)


@pytest.mark.parametrize(
    ("prompt", "sampling", "error"),
    [
        ("", params(max_tokens=4), EmptyPromptError),
        ([], params(max_tokens=4), EmptyPromptError),
        ("x" * 60, params(max_tokens=10), PromptTooLongError),
        ([1, TOKENIZER.vocab_size], params(max_tokens=4), InvalidParameterError),
        ([-1, 2], params(max_tokens=4), InvalidParameterError),
    ],
)
def test_bad_requests_are_refused_before_queueing(prompt, sampling, error) -> None:
    engine, _, _ = make_engine(max_model_len=64)
    with pytest.raises(error) as raised:
        add_request(engine, "a", prompt, sampling)
    assert type(raised.value) is error
    assert not engine.has_work() and list(engine.output) == []


def test_token_ids_are_checked_against_the_models_vocabulary_when_given() -> None:
    """The container passes the model's vocabulary (larger than the tokenizer's for some
    models): an id past the tokenizer's but inside the model's embedding is a valid prompt."""
    sink = ListSink()
    vocab = TOKENIZER.vocab_size + 8
    engine = Engine(EngineConfig(), FakeModelRunner(), TOKENIZER, sink, vocab_size=vocab)
    add_request(engine, "in", [vocab - 1], params(max_tokens=1))
    with pytest.raises(InvalidParameterError, match=f"token id {vocab} is out of vocabulary"):
        add_request(engine, "out", [1, vocab], params(max_tokens=1))
    assert [r.request_id for r in engine.scheduler.waiting] == ["in"]  # type: ignore[attr-defined]


def test_a_full_engine_refuses_with_queue_full() -> None:
    """It holds max_num_seqs running plus max_waiting_requests waiting."""
    engine, _, _ = make_engine(max_waiting_requests=1, max_num_seqs=1)
    add_request(engine, "a", "x", params())
    add_request(engine, "b", "x", params())
    with pytest.raises(QueueFullError):
        add_request(engine, "c", "x", params())
    assert list(engine.output) == ["a", "b"]
    engine.step()  # "a" runs, "b" waits: still full
    with pytest.raises(QueueFullError):
        add_request(engine, "c", "x", params())


def test_prompts_are_admitted_all_together_or_none() -> None:
    engine, _, _ = make_engine(max_waiting_requests=2, max_num_seqs=2)
    add_request(engine, "a", "x", params())
    with pytest.raises(QueueFullError):
        engine.admit(AdmitCall(("b", "c", "d", "e"), tuple([[5]] * 4), params()))
    assert list(engine.output) == ["a"] and engine.scheduler.room() == 3
    engine.admit(AdmitCall(("b", "c", "d"), tuple([[5]] * 3), params()))
    assert engine.scheduler.room() == 0


@pytest.mark.parametrize(
    ("config", "count"),
    [
        ({"max_num_seqs": 2, "max_waiting_requests": 3}, 6),  # beyond the capacity
        ({"max_prompts_per_request": 2}, 3),
    ],
)
def test_more_prompts_than_can_ever_fit_are_invalid_not_a_full_queue(config, count) -> None:
    engine, _, _ = make_engine(**config)
    with pytest.raises(InvalidParameterError) as error:
        engine.admit(
            AdmitCall(tuple([f"r{i}" for i in range(count)]), tuple([[5]] * count), params())
        )
    assert error.value.param == "prompt"
    assert not engine.has_work()


@pytest.mark.parametrize(
    ("prompt", "sampling", "param"),
    [
        ("é" * 6, {}, "prompt"),  # 12 bytes of UTF-8, 6 characters
        ("x" * 11, {}, "prompt"),
        ("x", {"stop": ("a",) * 4}, "stop"),
        ("x", {"stop_token_ids": (5,) * 4}, "stop_token_ids"),
        ("x", {"stop": ("abcdef", "ghijk")}, "stop"),  # 11 bytes
    ],
)
def test_request_limits_are_refused_by_name_before_tokenizing(
    prompt, sampling, param, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, _, _ = make_engine(max_prompt_bytes=10, max_stop_strings=3, max_stop_bytes=10)
    monkeypatch.setattr(engine.tokenizer, "encode", lambda *a, **k: pytest.fail("tokenized"))
    with pytest.raises(InvalidParameterError) as error:
        engine.checks.prepare(prompt, params(**sampling))
    assert error.value.param == param


def test_requests_at_the_limits_are_accepted() -> None:
    engine, _, _ = make_engine(max_prompt_bytes=10, max_stop_strings=3, max_stop_bytes=10)
    sampling = params(stop=("abcde", "fghij"), stop_token_ids=(5, 6, 7))
    assert engine.checks.prepare("é" * 5, sampling) == TOKENIZER.encode("é" * 5)


def test_a_failing_forward_fails_its_batch_and_the_engine_goes_on() -> None:
    engine, runner, sink = make_engine("ok")
    calls = {"n": 0}
    execute = runner.execute

    def flaky(batch):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("out of memory")
        return execute(batch)

    runner.execute = flaky  # type: ignore[method-assign]
    add_request(engine, "a", "x", params())
    add_request(engine, "b", "x", params())
    engine.step()
    assert [(o.request_id, o.error) for o in sink.outputs] == [
        ("a", STEP_FAILED),
        ("b", STEP_FAILED),
    ]
    assert "out of memory" not in STEP_FAILED  # no exception text reaches clients
    add_request(engine, "c", "x", params())
    run_to_end(engine)
    assert "".join(o.text_delta for o in sink.of("c")) == "ok"
    assert runner.live == set()


def test_continuous_abort_frees_the_slot_at_the_next_step() -> None:
    engine, runner, sink = make_engine("a long reply", max_num_seqs=1)
    add_request(engine, "a", "x", params())
    add_request(engine, "b", "x", params())
    engine.step()
    assert runner.live == {"a"}
    engine.abort("a")
    engine.step()
    assert runner.live == {"b"}
    run_to_end(engine)
    assert sink.of("a")[-1].finished is False  # no output after the abort
    assert "".join(o.text_delta for o in sink.of("b")) == "a long reply"


def test_static_batch_with_mixed_prompt_lengths_runs_to_completion() -> None:
    engine, runner, sink = make_engine("hey", batching_mode="static", batch_wait_timeout=0.0)
    add_request(engine, "short", "a", params())
    add_request(engine, "long", "a much longer prompt", params(max_tokens=2))
    run_to_end(engine)
    assert all(c.start == 0 for c in runner.steps[0].chunks)  # a new batch: whole prompts
    assert [c.num_tokens for c in runner.steps[0].chunks] == [2, 21]
    assert "".join(o.text_delta for o in sink.of("short")) == "hey"
    assert sink.of("long")[-1].finish_reason == "length"
    engine.step()
    assert runner.live == set()


async def test_async_engine_streams_and_idles_without_polling() -> None:
    runner = FakeModelRunner(script=scripted("Hi!"))
    engine, sink = make_async(runner)
    engine.start()
    try:
        stream = await engine.stream("a", "x", params())
        text = "".join([o.text_delta async for o in stream])
        assert text == "Hi!"
        steps = len(runner.steps)
        await asyncio.sleep(0.05)
        assert len(runner.steps) == steps and engine.healthy
        assert len(sink) == 0
    finally:
        await engine.stop()
    assert not engine.healthy


async def test_the_async_engine_reports_its_load_for_a_fleets_router() -> None:
    """What a replica reports (``load``, ``take_evicted``), read from the loop's engine."""
    runner = FakeModelRunner(script=scripted("x" * 500), step_latency_s=0.005)
    engine, _ = make_async(runner)
    engine.start()
    try:
        prompt = "a long enough prompt to fill a block"
        stream = await engine.stream("a", prompt, params(max_tokens=200))
        await wait_for(lambda: engine.load().running == 1)
        assert engine.load().waiting == 0 and engine.load().kv_usage > 0
        _ = [o async for o in stream]
        await engine.idle()
        load = engine.load()
        assert (load.running, load.waiting) == (0, 0)
        assert load.prefix_queried_tokens > 0  # the prompt was looked up
        assert engine.take_evicted() == [] and engine.take_evicted() == []
    finally:
        await engine.stop()


async def test_each_steps_output_reaches_a_relayed_consumer_before_the_next_step() -> None:
    """Tokens pass through coroutine hand-offs on their way out (as SSE does) and still
    arrive before the next step runs: streams never receive them in bursts."""
    seen: list[StepOutput] = []
    seen_at_step: list[int] = []

    class Recording(FakeModelRunner):
        def execute(self, batch):
            seen_at_step.append(len(seen))
            return super().execute(batch)

    async def relay(outputs):
        async for output in outputs:
            await asyncio.sleep(0)
            yield output

    runner = Recording(script=scripted("Hello!"))
    engine, _ = make_async(runner)
    engine.start()
    try:
        stream = await engine.stream("a", "x", params())
        async for output in relay(relay(stream)):
            seen.append(output)
    finally:
        await engine.stop()
    assert "".join(o.text_delta for o in seen) == "Hello!"
    assert seen_at_step == list(range(len(seen)))


async def test_leaving_a_stream_early_aborts_the_request_and_leaks_nothing() -> None:
    runner = FakeModelRunner(script=scripted("x" * 50), step_latency_s=0.001)
    engine = AsyncEngine(EngineConfig(), runner, TOKENIZER)
    core, sink = engine.engine, engine.sink
    engine.start()
    try:
        stream = await engine.stream("a", "x", params())
        async for output in stream:
            assert output.text_delta == "x"
            break
        await stream.aclose()  # what a client disconnect does to the SSE generator
        assert len(sink) == 0
        # the slot is released at the loop's next step
        await wait_for(lambda: not core.has_work() and not runner.live)
        assert not core.has_work() and runner.live == set()
    finally:
        await engine.stop()


async def test_validation_errors_raise_before_streaming() -> None:
    engine = AsyncEngine(EngineConfig(), FakeModelRunner(), TOKENIZER)
    sink = engine.sink
    with pytest.raises(InvalidParameterError):
        await engine.stream("a", "", params())
    assert len(sink) == 0


async def test_closing_a_group_aborts_its_requests_even_streams_never_read() -> None:
    """A generator that never started cannot clean up after itself: the group does."""
    runner = FakeModelRunner(script=scripted("x" * 500), step_latency_s=0.001)
    engine = AsyncEngine(EngineConfig(max_num_seqs=2, max_waiting_requests=2), runner, TOKENIZER)
    core, sink = engine.engine, engine.sink
    engine.start()
    try:
        group = engine.group()
        streams = group.admit(AdmitCall(("a", "b", "c"), ([5], [6], [7]), params(max_tokens=400)))
        await wait_for(lambda: len(runner.live) == 2)  # until two run
        await streams[0].aclose()  # closing a stream never started does nothing
        assert core.has_work()
        group.close()
        assert len(sink) == 0
        # the slots are released at the loop's next step
        await wait_for(lambda: not core.has_work() and not runner.live)
        assert not core.has_work() and runner.live == set()
        assert core.scheduler.room() == 4
    finally:
        await engine.stop()


async def test_prompts_are_tokenized_off_the_event_loop() -> None:
    threads: list[str] = []

    class Recording(ByteTokenizer):
        def encode(self, text, **kwargs):
            threads.append(threading.current_thread().name)
            return super().encode(text, **kwargs)

        def render_chat(self, messages, **kwargs):
            threads.append(threading.current_thread().name)
            return super().render_chat(messages, **kwargs)

    engine = AsyncEngine(EngineConfig(), FakeModelRunner(), Recording())
    try:
        assert await engine.inputs.prepare("hi", params()) == TOKENIZER.encode("hi")
        await engine.inputs.render_chat([{"role": "user", "content": "hi"}])
    finally:
        await engine.stop()
    assert threads and threading.main_thread().name not in threads


def test_request_ids_are_kept_on_requests() -> None:
    engine, _, _ = make_engine()
    request = add_request(engine, "id-1", [5, 6], params())
    assert isinstance(request, Request) and request.prompt_token_ids == [5, 6]
