"""The in-process API: batched generate() and async stream() without HTTP."""

import asyncio

import pytest

from domain.errors import InvalidParameterError
from domain.sampling import SamplingParams
from entrypoints.inprocess import LLM


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    cache = str(tmp_path_factory.mktemp("cache"))
    return LLM("dummy:SmolLM2-135M", dtype="float32", cache_dir=cache)


def test_generate_batches_prompts_and_keeps_their_order(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    results = llm.generate(["first prompt", "second", [1, 70, 71]], params)
    assert [r.prompt for r in results] == ["first prompt", "second", [1, 70, 71]]
    assert all(len(r.token_ids) == 6 and r.finish_reason == "length" for r in results)
    again = llm.generate(["second"], params)
    assert again[0].token_ids == results[1].token_ids  # batched == alone, greedy


def test_generate_takes_one_sampling_params_per_prompt(llm: LLM) -> None:
    lengths = [3, 7, 5]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    results = llm.generate(["a", "b", "c"], params)
    assert [len(r.token_ids) for r in results] == lengths
    with pytest.raises(ValueError, match="2 params for 3 prompts"):
        llm.generate(["a", "b", "c"], params[:2])


async def test_stream_yields_the_same_text_as_generate(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    streamed = "".join([delta async for delta in llm.stream("hello", params)])
    assert streamed == llm.generate(["hello"], params)[0].text


def test_bad_input_raises_the_domain_error(llm: LLM) -> None:
    with pytest.raises(InvalidParameterError):
        llm.generate([""], SamplingParams(max_tokens=4))
    assert not llm._container.engine().has_work()


def test_generate_takes_more_prompts_than_the_waiting_queue_holds(llm: LLM) -> None:
    limit = llm._container.engine().config.max_waiting_requests
    prompts: list[str | list[int]] = [[1, 60 + i % 50, 70] for i in range(limit + 9)]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    results = llm.generate(prompts, params)
    assert [r.prompt for r in results] == prompts
    assert all(len(r.token_ids) == 1 for r in results)
    assert results[-1].token_ids == llm.generate([prompts[-1]], params)[0].token_ids
    assert not llm._container.engine().has_work() and len(llm._container.sink()) == 0


def test_a_bad_prompt_anywhere_raises_and_leaves_nothing_queued(llm: LLM) -> None:
    with pytest.raises(InvalidParameterError, match="out of vocabulary"):
        llm.generate(["fine", [1, 10**9]], SamplingParams(max_tokens=4))
    assert not llm._container.engine().has_work() and len(llm._container.sink()) == 0


async def test_concurrent_streams_share_one_engine_loop(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine = llm._container.async_engine()

    async def text(prompt: str) -> str:
        return "".join([delta async for delta in llm.stream(prompt, params)])

    first = asyncio.create_task(text("hello"))
    await asyncio.sleep(0)
    loop_task = engine._task
    second, first_text = await text("world"), await first
    assert engine._task is loop_task  # the second stream did not start another loop
    assert not engine.healthy  # and the last stream to finish stopped it
    expected = llm.generate(["hello", "world"], params)
    assert [first_text, second] == [r.text for r in expected]
