"""``n`` choices sharing one prefill, logprobs of the processed distribution, ``echo`` and
``min_tokens``, on a tiny random Llama: in the engine, and through the official openai SDK."""

from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from litestar.testing import TestClient
from torch.testing import assert_close

from adapters.fake import ByteTokenizer
from adapters.fake.tokenizer import EOS_ID
from adapters.http import create_app
from adapters.torch.loading.loader import load_model
from adapters.torch.runtime.generate import stream_generate
from adapters.torch.runtime.runner import TorchModelRunner
from application.engine.engine import Engine
from domain.config import EngineConfig
from domain.request import AdmitCall
from domain.sampling import SamplingParams
from tests.fakes import ListSink, torch_async_engine
from tests.support.tiny_models import save_tiny_model

TOKENIZER = ByteTokenizer()
PROMPT = "The quick brown fox jumps"
MODEL = "tiny"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    folder: Path = tmp_path_factory.mktemp("llama")
    save_tiny_model("llama", folder)
    return load_model(folder, dtype=torch.float32)


def run(model, admit) -> tuple[ListSink, int]:
    """An engine on ``model``; ``admit(engine)`` queues; returns the outputs and the prompt
    tokens computed."""
    config = EngineConfig(max_num_seqs=8, max_model_len=96)
    sink = ListSink()
    engine = Engine(config, TorchModelRunner(model, config), TOKENIZER, sink)
    admit(engine)
    prefill = 0
    while engine.has_work():
        prefill += engine.step().scheduler.prefill_tokens
    return sink, prefill


def tokens(sink: ListSink, request_id: str) -> list[int]:
    return [o.token_id for o in sink.of(request_id) if o.token_id is not None]


def test_n_choices_prefill_once_and_each_equals_its_seeded_request_alone(model) -> None:
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)
    prompt = TOKENIZER.encode(PROMPT)
    ids = [f"c{j}" for j in range(4)]
    sink, prefill = run(model, lambda e: e.admit(AdmitCall(tuple(ids), (prompt,), params, 4)))
    # The prompt once, then per sibling what follows the full blocks it shares (16 each).
    shared = (len(prompt) - 1) // 16 * 16
    assert shared and prefill == len(prompt) + 3 * (len(prompt) - shared)
    choices = [tokens(sink, i) for i in ids]
    for j, got in enumerate(choices):
        alone = stream_generate(model, TOKENIZER, prompt, params.for_choice(j))
        assert got == [c.token_id for c in alone], f"choice {j}"
    assert len({tuple(c) for c in choices}) > 1  # distinct seeds, distinct choices


def _last_logits(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt]))[0, -1].float()


@pytest.mark.parametrize("temperature", [0.7, 0.0])
def test_logprobs_are_log_softmax_of_the_processed_logits(model, temperature) -> None:
    prompt = TOKENIZER.encode(PROMPT)
    bias = ((40, 4.0), (41, -100.0))
    params = SamplingParams(
        temperature=temperature, seed=1, max_tokens=1, logit_bias=bias, logprobs=5
    )
    sink, _ = run(model, lambda e: e.admit(AdmitCall(("r",), (prompt,), params)))
    [out] = sink.of("r")
    logits = _last_logits(model, prompt)
    logits[40] += 4.0
    logits[41] -= 100.0
    expected = torch.log_softmax(logits / (temperature or 1.0), dim=-1)  # greedy: undivided
    assert out.logprob == pytest.approx(float(expected[out.token_id]), abs=1e-4)
    top = expected.topk(5)
    assert out.top_logprobs is not None
    assert [t for t, _ in out.top_logprobs] == top.indices.tolist()
    assert_close(torch.tensor([v for _, v in out.top_logprobs]), top.values, atol=1e-4, rtol=0)


def test_min_tokens_holds_off_eos_and_stop_ids(model) -> None:
    prompt = TOKENIZER.encode(PROMPT)
    eager = SamplingParams(temperature=0.0, max_tokens=10, logit_bias=((EOS_ID, 100.0),))
    held = SamplingParams(
        temperature=0.0, max_tokens=10, logit_bias=((EOS_ID, 100.0),), min_tokens=3
    )
    stop = SamplingParams(
        temperature=0.0,
        max_tokens=10,
        logit_bias=((77, 100.0),),
        stop_token_ids=(77,),
        min_tokens=2,
    )
    sink, _ = run(
        model,
        lambda e: [
            e.admit(AdmitCall(("eager",), (prompt,), eager)),
            e.admit(AdmitCall(("held",), (prompt,), held)),
            e.admit(AdmitCall(("stop",), (prompt,), stop)),
        ],
    )
    assert tokens(sink, "eager") == [EOS_ID]
    held_tokens = tokens(sink, "held")
    assert len(held_tokens) == 4 and EOS_ID not in held_tokens[:3] and held_tokens[3] == EOS_ID
    assert sink.of("held")[-1].finish_reason == "eos"
    stop_tokens = tokens(sink, "stop")
    assert len(stop_tokens) == 3 and stop_tokens[2] == 77 and 77 not in stop_tokens[:2]


# --- through the SDK ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(model) -> Iterator[openai.OpenAI]:
    engine = torch_async_engine(model, EngineConfig(max_num_seqs=8, max_model_len=96))
    with TestClient(app=create_app(engine, MODEL)) as http:
        yield openai.OpenAI(
            base_url=f"{http.base_url}/v1", api_key="unused", http_client=http, max_retries=0
        )


FIXED = {"ignore_eos": True}


def test_completion_choices_with_logprobs_and_echo(client: openai.OpenAI) -> None:
    prompt_ids = TOKENIZER.encode(PROMPT)
    reply = client.completions.create(
        model=MODEL,
        prompt=[PROMPT, "Hi"],
        n=2,
        max_tokens=4,
        seed=3,
        logprobs=2,
        echo=True,
        extra_body=FIXED,
    )
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(prompt_ids) + len(TOKENIZER.encode("Hi"))  # once
    assert reply.usage.completion_tokens == 4 * 4
    first = reply.choices[0]
    assert first.text.startswith(PROMPT) and reply.choices[2].text.startswith("Hi")
    scores = first.logprobs
    assert scores is not None and scores.tokens is not None
    assert len(scores.tokens) == len(prompt_ids) + 4
    assert scores.token_logprobs is not None and scores.token_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in scores.token_logprobs[1:])
    assert scores.top_logprobs is not None and scores.top_logprobs[0] is None
    # The 2 best and the token itself when not among them (k + 1); alike strings merge.
    for token, top in zip(scores.tokens[1:], scores.top_logprobs[1:], strict=True):
        assert top is not None and 1 <= len(top) <= 3 and token in top
    offsets = scores.text_offset
    assert offsets is not None and offsets[0] == 0
    assert offsets == [sum(len(t) for t in scores.tokens[:i]) for i in range(len(offsets))]
    assert first.text != reply.choices[1].text  # seeds 3 and 4


def test_completion_stream_carries_each_choice_and_its_tokens_logprobs(
    client: openai.OpenAI,
) -> None:
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            n=3,
            max_tokens=5,
            logprobs=1,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=FIXED,
        )
    )
    per_choice: dict[int, list[str]] = defaultdict(list)
    for chunk in chunks[:-1]:
        [choice] = chunk.choices
        assert choice.logprobs is not None and choice.logprobs.tokens is not None
        per_choice[choice.index] += choice.logprobs.tokens
    assert sorted(per_choice) == [0, 1, 2]
    assert all(len(t) == 5 for t in per_choice.values())
    usage = chunks[-1].usage
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(TOKENIZER.encode(PROMPT)), 15)


# Tokens that decode to distinct strings (no two byte tokens reading U+FFFD alike): the
# processed distribution, its alternatives and the samples are these letters.
LETTERS = {str(t): 100 for t in TOKENIZER.encode("abcdefghij", add_special_tokens=False)}


def _completion_scores(
    client: openai.OpenAI, k: int, stream: bool, max_tokens: int = 12
) -> tuple[list[str], list[float], list[dict[str, float]]]:
    """Each generated token, its logprob and its ``top_logprobs`` dict (``logprobs: k``)."""
    request = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "logprobs": k,
        "seed": 5,
        "logit_bias": LETTERS,
        "extra_body": FIXED,
    }
    chunks = (
        list(client.completions.create(**request, stream=True))  # type: ignore[call-overload]
        if stream
        else [client.completions.create(**request)]  # type: ignore[call-overload]
    )
    tokens: list[str] = []
    values: list[float] = []
    tops: list[dict[str, float]] = []
    for chunk in chunks:
        for choice in chunk.choices:
            scores = choice.logprobs
            assert scores is not None
            tokens += scores.tokens or []
            values += [v for v in scores.token_logprobs or [] if v is not None]
            tops += [t for t in scores.top_logprobs or [] if t is not None]
    assert len(tokens) == len(values) == len(tops) == max_tokens
    return tokens, values, tops


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completion_logprobs_0_gives_each_token_its_own_entry(
    client: openai.OpenAI, stream: bool
) -> None:
    """The k + 1 rule at k = 0 (vLLM, the legacy OpenAI API): not an empty dict."""
    tokens, values, tops = _completion_scores(client, 0, stream)
    assert tops == [{t: v} for t, v in zip(tokens, values, strict=True)]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completion_logprobs_k_gives_the_k_best_and_the_token_itself(
    client: openai.OpenAI, stream: bool
) -> None:
    tokens, values, tops = _completion_scores(client, 2, stream)
    *_, wider = _completion_scores(client, 5, stream)  # the same seed: the same tokens
    sizes = set()
    for token, value, top, five in zip(tokens, values, tops, wider, strict=True):
        assert top[token] == pytest.approx(value)
        best = sorted(top.values(), reverse=True)[:2]
        assert best == pytest.approx(sorted(five.values(), reverse=True)[:2])  # the 2 best
        if len(top) == 3:  # the token was not among them: it comes on top of the 2
            assert value < min(v for t, v in top.items() if t != token) + 1e-6
        else:
            assert len(top) == 2 and value >= best[1] - 1e-6
        sizes.add(len(top))
    assert sizes == {2, 3}  # both cases seen


def test_chat_top_logprobs_0_gives_each_token_its_logprob_and_no_alternatives(
    client: openai.OpenAI,
) -> None:
    """OpenAI's chat: ``top_logprobs`` holds the k best only, an empty list at 0."""
    request = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5,
        "logprobs": True,
        "top_logprobs": 0,
        "extra_body": FIXED,
    }
    reply = client.chat.completions.create(**request)  # type: ignore[call-overload]
    content = reply.choices[0].logprobs.content
    streamed = [
        item
        for chunk in client.chat.completions.create(**request, stream=True)  # type: ignore[call-overload]
        for choice in chunk.choices
        if choice.logprobs is not None
        for item in choice.logprobs.content or []
    ]
    for items in (content, streamed):
        assert len(items) == 5
        assert all(item.top_logprobs == [] and item.logprob <= 0 for item in items)


def test_chat_choices_with_token_logprobs(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "héllo"}]
    reply = client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        n=2,
        max_tokens=6,
        logprobs=True,
        top_logprobs=3,
        extra_body=FIXED,
    )
    assert [c.index for c in reply.choices] == [0, 1]
    for choice in reply.choices:
        assert choice.logprobs is not None and choice.logprobs.content is not None
        assert len(choice.logprobs.content) == 6
        for item in choice.logprobs.content:
            assert item.bytes == list(item.token.encode())
            values = [t.logprob for t in item.top_logprobs]
            assert len(values) == 3 and values == sorted(values, reverse=True)
            assert item.logprob <= values[0] + 1e-6


def test_chat_stream_carries_the_choice_index_and_logprobs(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            n=2,
            max_tokens=4,
            logprobs=True,
            stream=True,
            extra_body=FIXED,
        )
    )
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role]
    assert roles == [0, 1]
    scored: dict[int, int] = defaultdict(int)
    finishes = []
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.logprobs is not None and choice.logprobs.content:
                assert choice.logprobs.content[0].top_logprobs == []
                scored[choice.index] += len(choice.logprobs.content)
            if choice.finish_reason:
                finishes.append(choice.index)
    assert scored == {0: 4, 1: 4}
    assert sorted(finishes) == [0, 1]


def test_a_token_holding_part_of_a_character_reads_like_vllm(client: openai.OpenAI) -> None:
    """The byte tokenizer splits "é" in two: each token decodes alone to U+FFFD."""
    reply = client.completions.create(
        model=MODEL, prompt="é", max_tokens=1, logprobs=0, echo=True, extra_body=FIXED
    )
    scores = reply.choices[0].logprobs
    assert scores is not None and scores.tokens is not None
    assert scores.tokens[1:3] == ["\ufffd", "\ufffd"]  # after the BOS token
    assert reply.choices[0].text.startswith("é")
