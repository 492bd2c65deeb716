"""The OpenAI endpoints, driven by the official openai SDK over Litestar's test client."""

import asyncio
from collections.abc import Iterator

import openai
import pytest
from litestar.testing import TestClient

from adapters.fake import ByteTokenizer
from adapters.fake.runner import reply_script
from adapters.http import create_app
from application.engine.input_processor import InputProcessor
from tests.fakes import fake_async_engine

MODEL = "test/fake-model"
TOKENIZER = ByteTokenizer()
REPLY = "Paris is the capital."


@pytest.fixture
def http() -> Iterator[TestClient]:
    engine = fake_async_engine(
        script=reply_script(TOKENIZER, REPLY), tokenizer=TOKENIZER, max_model_len=512
    )
    with TestClient(app=create_app(engine, MODEL)) as client:
        yield client


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_completion_returns_the_reply_and_usage(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Capital of France?"}], max_tokens=64
    )
    assert reply.object == "chat.completion"
    assert reply.choices[0].message.content == REPLY
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage is not None and reply.usage.completion_tokens == len(REPLY) + 1
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_chat_streaming_sends_role_deltas_finish_and_usage(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Capital of France?"}],
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == REPLY
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None


def test_completion_honours_max_tokens_and_stop(client: openai.OpenAI) -> None:
    short = client.completions.create(model=MODEL, prompt="Q:", max_tokens=5)
    assert (short.choices[0].text, short.choices[0].finish_reason) == ("Paris", "length")
    stopped = client.completions.create(model=MODEL, prompt="Q:", max_tokens=64, stop=["capital"])
    assert (stopped.choices[0].text, stopped.choices[0].finish_reason) == ("Paris is the ", "stop")


def test_completion_accepts_several_prompts_and_token_ids(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=MODEL, prompt=["a", "b"], max_tokens=5)
    assert [c.index for c in reply.choices] == [0, 1]
    assert all(c.text == "Paris" for c in reply.choices)
    ids = client.completions.create(model=MODEL, prompt=[1, 70, 80], max_tokens=5)
    assert ids.usage is not None and ids.usage.prompt_tokens == 3
    salted = client.completions.create(
        model=MODEL, prompt="Q:", max_tokens=5, extra_body={"cache_salt": "tenant-a"}
    )
    assert salted.choices[0].text == "Paris"


def test_the_model_field_may_be_left_out(http: TestClient) -> None:
    """As vLLM does: a request without ``model`` goes to the served model."""
    reply = http.post("/v1/completions", json={"prompt": "Q:", "max_tokens": 5}).json()
    assert (reply["model"], reply["choices"][0]["text"]) == (MODEL, "Paris")
    chat = http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5},
    ).json()
    assert chat["choices"][0]["message"]["content"] == "Paris"


def test_completion_streaming_ends_with_done(http: TestClient) -> None:
    response = http.post(
        "/v1/completions", json={"model": MODEL, "prompt": "Q:", "max_tokens": 5, "stream": True}
    )
    lines = [line for line in response.text.splitlines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]"
    assert len(lines) == 6  # five tokens, then [DONE]


@pytest.mark.parametrize(
    ("kwargs", "status", "param"),
    [
        ({"model": "other"}, 404, "model"),
        ({"temperature": 5.0}, 400, "temperature"),
        ({"n": 0}, 400, "n"),
        ({"n": 17}, 400, "n"),
        ({"top_logprobs": 2}, 400, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": -1}, 400, "top_logprobs"),
        ({"max_tokens": 4, "extra_body": {"min_tokens": 5}}, 400, "min_tokens"),
        ({"extra_body": {"min_tokens": -1}}, 400, "min_tokens"),
        ({"extra_body": {"cache_salt": ""}}, 400, "cache_salt"),
        ({"extra_body": {"cache_salt": 7}}, 400, "cache_salt"),
        ({"extra_body": {"frobnicate": 1}}, 400, "frobnicate"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            400,
            "tools[0].function.parameters",
        ),
        ({"max_tokens": 0}, 400, "max_tokens"),
        ({"max_completion_tokens": 0}, 400, "max_completion_tokens"),
        ({"stream_options": {"include_usage": True}}, 400, "stream_options"),
        ({"messages": [{"role": "", "content": "hi"}]}, 400, "messages[0].role"),
        ({"messages": [{"role": "user"}]}, 400, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "x" * 600}]}, 400, "messages"),
    ],
)
def test_bad_chat_requests_get_openai_errors(client: openai.OpenAI, kwargs, status, param) -> None:
    request = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **kwargs}
    with pytest.raises(openai.APIStatusError) as error:
        client.chat.completions.create(**request)
    assert error.value.status_code == status
    assert error.value.body["param"] == param  # type: ignore[index]


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"prompt": [1, 2, TOKENIZER.vocab_size]}, "prompt"),
        ({"prompt": [[1], [-1]]}, "prompt"),
        ({"prompt": "Q:", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "Q:", "max_tokens": 600}, "prompt"),
        ({"prompt": [7], "stream": True}, None),  # valid: the contrast for the next case
        ({"prompt": [10**9], "stream": True}, "prompt"),
    ],
)
def test_bad_completion_requests_get_400_before_anything_runs(
    client: openai.OpenAI, http: TestClient, kwargs, param
) -> None:
    """Refused before queueing (a bad token id used to fail the whole batch's forward),
    streamed requests included: an error status, never an error inside a 200 stream."""
    request = {"model": MODEL, "max_tokens": 3, **kwargs}
    if param is None:
        assert "".join(c.choices[0].text for c in client.completions.create(**request)) == "Par"
        return
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(**request)
    assert error.value.body["param"] == param  # type: ignore[index]
    assert http.get("/health").status_code == 200


@pytest.mark.parametrize(
    ("method", "path", "status", "message"),
    [
        ("POST", "/v1/nothing-here", 404, "Invalid URL (POST /v1/nothing-here)"),
        ("GET", "/v1/completions", 405, "Method GET is not allowed for /v1/completions"),
    ],
)
def test_routing_errors_use_the_openai_error_schema(
    http: TestClient, method: str, path: str, status: int, message: str
) -> None:
    response = http.request(method, path)
    assert response.status_code == status
    assert response.json() == {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "param": None,
            "code": None,
        }
    }


def test_completion_honours_vllm_extensions(client: openai.OpenAI) -> None:
    """ignore_eos and stop_token_ids, sent as extra body fields as vLLM's clients do."""
    long = client.completions.create(
        model=MODEL, prompt="Q:", max_tokens=40, extra_body={"ignore_eos": True}
    )
    assert long.choices[0].finish_reason == "length"
    assert long.usage is not None and long.usage.completion_tokens == 40
    (space,) = TOKENIZER.encode(" ", add_special_tokens=False)
    cut = client.completions.create(
        model=MODEL, prompt="Q:", max_tokens=40, extra_body={"stop_token_ids": [space]}
    )
    assert (cut.choices[0].text, cut.choices[0].finish_reason) == ("Paris", "stop")


async def test_leaving_a_merged_stream_early_closes_every_stream() -> None:
    """A client leaving a multi-prompt stream closes all its engine streams, none running."""
    from adapters.http.streaming import merge_streams

    closed: list[int] = []

    async def endless(index: int):
        try:
            while True:
                await asyncio.sleep(0)
                yield index
        finally:
            closed.append(index)

    merged = merge_streams([endless(0), endless(1)])
    assert (await anext(merged))[1] in (0, 1)
    await merged.aclose()  # raised "aclose(): asynchronous generator is already running"
    assert sorted(closed) == [0, 1]


@pytest.mark.parametrize(
    ("path", "field"),
    [("/v1/completions", '"prompt": '), ("/v1/chat/completions", '"messages": [{"content": ')],
)
def test_deeply_nested_json_is_a_400_not_a_crash(http: TestClient, path: str, field: str) -> None:
    """Fields that take any JSON (a prompt's lists, a message) nested past msgspec's limit."""
    close = "}]}" if "messages" in field else "}"
    body = "{" + field + "[" * 5000 + "]" * 5000 + close
    response = http.post(path, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "malformed JSON: nested too deeply"


def test_an_unexpected_exception_is_a_500_in_the_openai_schema(
    http: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_: object, **__: object) -> list[int]:
        raise RuntimeError("template exploded")

    monkeypatch.setattr(InputProcessor, "render_chat", broken)
    response = http.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert response.status_code == 500
    assert response.json()["error"] == {
        "message": "Internal server error",
        "type": "server_error",
        "param": None,
        "code": None,
    }
    assert http.get("/health").status_code == 200


def test_usage_counts_the_prompt_tokens_found_in_the_prefix_cache(
    client: openai.OpenAI,
) -> None:
    # A long prompt asked three times: the first computes it, the others find its full
    # blocks (16 tokens each, short of its last token) in the prefix cache.
    messages = [{"role": "user", "content": "Tell me about Paris. " * 8}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
    streamed = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
    )[-1]
    text = client.completions.create(model=MODEL, prompt="Tell me about Paris. " * 8, max_tokens=8)
    text_again = client.completions.create(
        model=MODEL, prompt="Tell me about Paris. " * 8, max_tokens=8, n=2
    )
    assert first.usage is not None and first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    prompt = first.usage.prompt_tokens
    full_blocks = (prompt - 1) // 16 * 16
    for usage in (again.usage, streamed.usage):
        assert usage is not None and usage.prompt_tokens_details is not None
        assert (usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens) == (
            prompt,
            full_blocks,
        )
    assert text.usage is not None and text.usage.prompt_tokens_details is not None
    cached = text_again.usage.prompt_tokens_details  # type: ignore[union-attr]
    assert cached is not None and cached.cached_tokens == (text.usage.prompt_tokens - 1) // 16 * 16
