"""The rest of the OpenAI API (issue 14) on a real `infer serve` process on the default
model, through the official openai SDK: logprobs (chat and completions, with echo), n with
seed, min_tokens and logit_bias, structured outputs (response_format and vLLM's fields),
aliases and model cards, embeddings beside the chat model, /tokenize and /detokenize."""

import json
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest

from tests.e2e.server import infer_serve

pytestmark = pytest.mark.slow
MODEL = "smollm2"
ALIAS = "gpt-4o-mini"
EMBEDDINGS = "all-MiniLM-L6-v2"
USER = [{"role": "user", "content": "Name a color."}]


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    # float32: these tests hold sampled text to exact equality (seeds, greedy `n`), and in
    # bfloat16 (`--dtype auto` on an AVX512-BF16 CPU) a prompt computed whole, after a
    # cached prefix, or as a forked choice's last position differs in the logits' last
    # bits, which can flip a sample or a near-tie argmax.
    flags = ("--served-model-name", MODEL, ALIAS, "--max-batch-size", "8", "--dtype", "float32")
    with infer_serve(*flags) as url:
        yield url


def test_chat_logprobs_stream_and_not(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=6, logprobs=True, top_logprobs=3, temperature=0
    )
    content = reply.choices[0].logprobs.content
    assert content and len(content) == reply.usage.completion_tokens
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        assert item.top_logprobs[0].logprob >= item.top_logprobs[-1].logprob
        assert item.bytes == list(item.token.encode())
    assert content[0].logprob == pytest.approx(content[0].top_logprobs[0].logprob)  # greedy
    streamed = []
    for chunk in client.chat.completions.create(
        model=MODEL,
        messages=USER,
        max_tokens=6,
        logprobs=True,
        top_logprobs=3,
        temperature=0,
        stream=True,
    ):
        if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
            streamed += chunk.choices[0].logprobs.content
    assert [t.token for t in streamed] == [t.token for t in content]
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=USER, logprobs=True, top_logprobs=21)
    assert bad.value.body["param"] == "top_logprobs"


def test_completion_logprobs_with_echo(client: openai.OpenAI) -> None:
    prompt = "The capital of France is"
    reply = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, logprobs=2, echo=True, temperature=0
    )
    choice = reply.choices[0]
    assert choice.text.startswith(prompt)
    logprobs = choice.logprobs
    assert logprobs.token_logprobs[0] is None  # the first prompt token has no context
    assert len(logprobs.tokens) == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert all(len(top) == 2 for top in logprobs.top_logprobs[-4:])
    assert logprobs.text_offset == sorted(logprobs.text_offset)


def test_n_choices_with_a_seed(client: openai.OpenAI) -> None:
    def ask(n: int, temperature: float = 1.0) -> list[str]:
        reply = client.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=8, n=n, seed=11, temperature=temperature
        )
        assert [c.index for c in reply.choices] == list(range(n))
        return [c.message.content or "" for c in reply.choices]

    three = ask(3)
    assert ask(3) == three  # reproducible
    assert len(set(three)) > 1  # seed + j: the choices differ
    assert ask(3, temperature=0.0) == ask(1, temperature=0.0) * 3  # greedy: one answer
    indexes = set()
    for chunk in client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=4, n=2, stream=True, seed=3
    ):
        indexes |= {c.index for c in chunk.choices}
    assert indexes == {0, 1}


def test_min_tokens_and_logit_bias(client: openai.OpenAI, base_url: str) -> None:
    body = {"prompt": " yes", "add_special_tokens": False}
    [space] = httpx.post(f"{base_url}/tokenize", json=body).json()["tokens"]
    reply = client.completions.create(
        model=MODEL,
        prompt="Answer:",
        max_tokens=5,
        temperature=0,
        logit_bias={str(space): 100},
        extra_body={"min_tokens": 5},
    )
    assert reply.choices[0].text == " yes" * 5 and reply.usage.completion_tokens == 5


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


def test_structured_outputs(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        response_format=fmt,
        max_tokens=120,
    )
    jsonschema.validate(json.loads(reply.choices[0].message.content or ""), SCHEMA)
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Describe a person as JSON."}],
            response_format=fmt,
            max_tokens=120,
            stream=True,
        )
        if c.choices
    )
    jsonschema.validate(json.loads(streamed), SCHEMA)
    choice = client.completions.create(
        model=MODEL,
        prompt="Is water wet?",
        max_tokens=5,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    assert choice.choices[0].text in ("yes", "no")
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model=MODEL,
            messages=USER,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nope"}},
            },
        )
    assert bad.value.body["param"] == "response_format"


def test_aliases_and_model_cards(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=ALIAS, messages=USER, max_tokens=2)
    assert reply.model == ALIAS
    cards = {m.id: m for m in client.models.list().data}
    assert {MODEL, ALIAS, EMBEDDINGS} <= set(cards)
    assert cards[MODEL].model_extra and cards[MODEL].model_extra["max_model_len"] > 0
    assert client.models.retrieve(ALIAS).id == ALIAS
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=USER)


def test_embeddings_beside_the_chat_model(client: openai.OpenAI) -> None:
    reply = client.embeddings.create(model=EMBEDDINGS, input=["A cat sits.", "Stocks fell."])
    assert [d.index for d in reply.data] == [0, 1]
    assert all(len(d.embedding) == 384 for d in reply.data)
    norm = sum(x * x for x in reply.data[0].embedding)
    assert norm == pytest.approx(1.0, abs=1e-4) and reply.usage.prompt_tokens > 0


def test_tokenize_and_detokenize(base_url: str) -> None:
    tokens = httpx.post(f"{base_url}/tokenize", json={"model": ALIAS, "prompt": "Hello world"})
    ids = tokens.json()["tokens"]
    text = httpx.post(f"{base_url}/detokenize", json={"model": MODEL, "tokens": ids})
    assert text.json()["prompt"].endswith("Hello world")
