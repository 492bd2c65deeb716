"""The in-process API: batched generate() and async stream() without HTTP."""

import pytest

from domain.errors import InvalidParameterError
from domain.sampling import SamplingParams
from entrypoints.inprocess import LLM


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    cache = str(tmp_path_factory.mktemp("cache"))
    return LLM("dummy:SmolLM2-135M", dtype="float32", cache_dir=cache)


def test_generate_batches_prompts_and_keeps_their_order(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    results = llm.generate(["first prompt", "second", [1, 70, 71]], params)
    assert [r.prompt for r in results] == ["first prompt", "second", [1, 70, 71]]
    assert all(len(r.token_ids) == 6 and r.finish_reason == "length" for r in results)
    again = llm.generate(["second"], params)
    assert again[0].token_ids == results[1].token_ids  # batched == alone, greedy


async def test_stream_yields_the_same_text_as_generate(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    streamed = "".join([delta async for delta in llm.stream("hello", params)])
    assert streamed == llm.generate(["hello"], params)[0].text


def test_bad_input_raises_the_domain_error(llm: LLM) -> None:
    with pytest.raises(InvalidParameterError):
        llm.generate([""], SamplingParams(max_new_tokens=4))
    assert not llm._container.engine().has_work()
