"""vLLM's request extras on /v1/completions and /v1/chat/completions, over the scripted fake
engine: ``stream_options.continuous_usage_stats``, ``return_token_ids``, ``bad_words``,
``truncate_prompt_tokens``, ``include_stop_str_in_output``, ``stop_reason``, custom chat
roles, ``best_of``, and the refusals of each (the torch side: test_http_vllm_extras_torch)."""

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from litestar.testing import TestClient

from adapters.fake.runner import FakeModelRunner, reply_script
from adapters.http import create_app
from domain.request import Request
from domain.scheduler import RunnerOutput, SchedulerOutput
from tests.fakes import fake_async_engine
from tests.support.byte_tokenizer import byte_level_tokenizer
from tests.support.scripted import TOKENIZER, Replies

MODEL = "test/fake-model"
REPLY = "Paris is the capital. END of it"
USER = [{"role": "user", "content": "Capital of France?"}]
EOS = min(TOKENIZER.eos_token_ids)


@pytest.fixture
def replies() -> Replies:
    return Replies(REPLY)


@pytest.fixture
def http(replies: Replies) -> Iterator[TestClient]:
    engine = fake_async_engine(script=replies.script(), tokenizer=TOKENIZER, max_model_len=128)
    with TestClient(app=create_app(engine, MODEL)) as client:
        yield client


def ids(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def post(http: TestClient, path: str, **body: Any) -> dict[str, Any]:
    reply = http.post(path, json={"model": MODEL, **body})
    assert reply.status_code == 200, reply.text
    return reply.json()


def complete(http: TestClient, **body: Any) -> dict[str, Any]:
    return post(http, "/v1/completions", **{"prompt": "Q:", "max_tokens": 40, **body})


def chat(http: TestClient, **body: Any) -> dict[str, Any]:
    return post(http, "/v1/chat/completions", **{"messages": USER, "max_tokens": 40, **body})


def stream(http: TestClient, path: str, **body: Any) -> list[dict[str, Any]]:
    defaults = {"prompt": "Q:"} if path == "/v1/completions" else {"messages": USER}
    reply = http.post(
        path, json={"model": MODEL, "max_tokens": 40, **defaults, **body, "stream": True}
    )
    assert reply.status_code == 200, reply.text
    lines = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def refused(http: TestClient, path: str, param: str, **body: Any) -> None:
    defaults = {"prompt": "Q:"} if path == "/v1/completions" else {"messages": USER}
    reply = http.post(path, json={"model": MODEL, "max_tokens": 4, **defaults, **body})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


PATHS = ["/v1/completions", "/v1/chat/completions"]


# --- stop_reason, include_stop_str_in_output --------------------------------------------


def test_stop_reason_names_the_stop_string_or_id_and_is_null_otherwise(http: TestClient) -> None:
    stopped = complete(http, stop=["capital", "END"])["choices"][0]
    assert (stopped["text"], stopped["finish_reason"], stopped["stop_reason"]) == (
        "Paris is the ",
        "stop",
        "capital",
    )
    dot = ids(".")[0]
    by_id = chat(http, stop_token_ids=[dot])["choices"][0]
    assert by_id["message"]["content"] == "Paris is the capital"
    assert (by_id["finish_reason"], by_id["stop_reason"]) == ("stop", dot)
    for whole in (complete(http), chat(http)):
        assert (whole["choices"][0]["finish_reason"], whole["choices"][0]["stop_reason"]) == (
            "stop",
            None,
        )  # EOS
    assert complete(http, max_tokens=3)["choices"][0]["stop_reason"] is None  # length


@pytest.mark.parametrize("path", PATHS)
def test_streamed_finish_chunks_carry_the_stop_reason(http: TestClient, path: str) -> None:
    chunks = stream(http, path, stop=["END"])
    finishes = [
        (c["choices"][0]["finish_reason"], c["choices"][0]["stop_reason"])
        for c in chunks
        if c["choices"] and c["choices"][0]["finish_reason"]
    ]
    assert finishes == [("stop", "END")]


def test_include_stop_str_in_output_keeps_the_stop_string(http: TestClient) -> None:
    body = {"stop": ["capital"], "include_stop_str_in_output": True}
    assert complete(http, **body)["choices"][0]["text"] == "Paris is the capital"
    assert chat(http, **body)["choices"][0]["message"]["content"] == "Paris is the capital"
    chunks = stream(http, "/v1/completions", **body)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Paris is the capital"
    assert complete(http, stop=["capital"])["choices"][0]["text"] == "Paris is the "


# --- continuous_usage_stats --------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
def test_continuous_usage_puts_the_usage_so_far_on_every_chunk(http: TestClient, path: str) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = stream(http, path, stream_options=options, max_tokens=5)
    *streamed, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 5  # still last
    prompt = last["usage"]["prompt_tokens"]
    counts = [c["usage"]["completion_tokens"] for c in streamed]
    assert all(c["usage"]["prompt_tokens"] == prompt for c in streamed)
    assert all(
        c["usage"]["total_tokens"] == prompt + n for c, n in zip(streamed, counts, strict=True)
    )
    assert counts == sorted(counts) and set(counts) >= {1, 2, 3, 4, 5} and counts[-1] == 5
    if path == "/v1/chat/completions":  # the role chunk: nothing generated yet
        assert counts[0] == 0


@pytest.mark.parametrize("path", PATHS)
def test_without_include_usage_no_chunk_carries_usage(http: TestClient, path: str) -> None:
    """As in vLLM: ``continuous_usage_stats`` takes effect with ``include_usage`` only."""
    chunks = stream(http, path, stream_options={"continuous_usage_stats": True}, max_tokens=3)
    assert all(c.get("usage") is None for c in chunks)
    plain = stream(http, path, stream_options={"include_usage": True}, max_tokens=3)
    assert [c["usage"] is None for c in plain] == [True] * (len(plain) - 1) + [False]


# --- return_token_ids --------------------------------------------------------------------


def test_return_token_ids_on_a_completion(http: TestClient, replies: Replies) -> None:
    reply = complete(http, prompt=["Q:", "R:"], return_token_ids=True, max_tokens=5)
    prompts = [TOKENIZER.encode("Q:"), TOKENIZER.encode("R:")]
    for choice, prompt in zip(reply["choices"], prompts, strict=True):
        assert choice["prompt_token_ids"] == prompt
        assert choice["token_ids"] == ids("Paris")
    whole = complete(http, return_token_ids=True)["choices"][0]
    assert whole["token_ids"] == [*ids(REPLY), EOS]  # the EOS id too, as in vLLM
    plain = complete(http)["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain


def test_return_token_ids_on_a_chat(http: TestClient, replies: Replies) -> None:
    reply = chat(http, return_token_ids=True, stop=["capital"], n=2)
    assert reply["prompt_token_ids"] == replies.requests[-1].prompt_token_ids
    for choice in reply["choices"]:  # a stop string cuts the text, not the ids
        assert choice["token_ids"] == ids("Paris is the capital")
    assert "prompt_token_ids" not in chat(http)


@pytest.mark.parametrize("path", PATHS)
def test_streamed_chunks_carry_their_own_token_ids(
    http: TestClient, replies: Replies, path: str
) -> None:
    chunks = stream(http, path, return_token_ids=True, n=2)
    prompt = replies.requests[-1].prompt_token_ids
    for index in (0, 1):
        mine = [c for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        got = [t for c in mine for t in c["choices"][0].get("token_ids") or []]
        assert got == [*ids(REPLY), EOS]
    if path == "/v1/completions":  # each choice's first chunk
        firsts = [c["choices"][0].get("prompt_token_ids") for c in chunks]
        assert [f for f in firsts if f is not None] == [prompt, prompt]
    else:  # the first chunk of the response
        assert chunks[0]["prompt_token_ids"] == prompt
        assert all("prompt_token_ids" not in c for c in chunks[1:])


# --- bad_words ---------------------------------------------------------------------------


def test_bad_words_reach_the_engine_as_token_ids(http: TestClient, replies: Replies) -> None:
    """Tokenized with and without a leading space (the byte tokenizer: the spaced form has
    another length, so only the bare one; the logits side: test_http_vllm_extras_torch)."""
    complete(http, bad_words=["ab", "  c"])
    words = replies.requests[-1].sampling_params.bad_words
    assert words == (tuple(ids("ab")), tuple(ids("c")))
    chat(http, bad_words=["xy"])
    assert replies.requests[-1].sampling_params.bad_words == (tuple(ids("xy")),)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("words", [[""], ["  "], ["w"] * 65, ["x" * 5000]])
def test_bad_bad_words_are_400s(http: TestClient, path: str, words: list[str]) -> None:
    refused(http, path, "bad_words", bad_words=words)


# --- truncate_prompt_tokens --------------------------------------------------------------


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(
    http: TestClient, replies: Replies
) -> None:
    long = "x" * 100 + "tail"
    refused(http, "/v1/completions", "prompt", prompt=long, max_tokens=30)  # 105 + 30 > 128
    reply = complete(http, prompt=long, max_tokens=30, truncate_prompt_tokens=4, echo=True)
    assert replies.requests[-1].prompt_token_ids == ids("tail")
    assert reply["usage"]["prompt_tokens"] == 4
    assert reply["choices"][0]["text"].startswith("tail")  # the echo is what ran
    complete(http, prompt=TOKENIZER.encode("abc"), truncate_prompt_tokens=10)
    assert replies.requests[-1].prompt_token_ids == TOKENIZER.encode("abc")  # shorter: kept


def test_truncate_prompt_tokens_minus_one_keeps_what_the_context_holds(
    http: TestClient, replies: Replies
) -> None:
    """-1: the last ``max_model_len`` tokens; the prompt and the output must still fit."""
    prompt = list(range(3, 203))
    refused(http, "/v1/completions", "prompt", prompt=prompt, truncate_prompt_tokens=-1)
    complete(http, prompt=prompt, truncate_prompt_tokens=120, max_tokens=4)
    assert replies.requests[-1].prompt_token_ids == prompt[-120:]


def test_a_chat_is_truncated_after_rendering(http: TestClient, replies: Replies) -> None:
    messages = [{"role": "user", "content": "y" * 150}]
    refused(http, "/v1/chat/completions", "messages", messages=messages)
    reply = chat(http, messages=messages, truncate_prompt_tokens=8, max_tokens=None)
    rendered = TOKENIZER.render_chat(messages)
    assert replies.requests[-1].prompt_token_ids == rendered[-8:]
    assert reply["usage"]["prompt_tokens"] == 8
    # Without max_tokens the output may take what the context leaves after the 8.
    assert replies.requests[-1].sampling_params.max_tokens == 128 - 8


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("value", [0, -2])
def test_bad_truncations_are_400s(http: TestClient, path: str, value: int) -> None:
    refused(http, path, "truncate_prompt_tokens", truncate_prompt_tokens=value)


# --- prompt_logprobs (refusals; values: the torch test) ----------------------------------


@pytest.mark.parametrize("path", PATHS)
def test_prompt_logprobs_out_of_range_or_streamed_are_400s(http: TestClient, path: str) -> None:
    refused(http, path, "prompt_logprobs", prompt_logprobs=21)
    refused(http, path, "prompt_logprobs", prompt_logprobs=-1)
    refused(http, path, "prompt_logprobs", prompt_logprobs=2, stream=True)
    assert stream(http, path, prompt_logprobs=0)  # vLLM: 0 is accepted with a stream


# --- custom roles ------------------------------------------------------------------------


def test_a_custom_role_goes_to_the_template(http: TestClient, replies: Replies) -> None:
    messages = [{"role": "reviewer", "content": "Looks fine."}, *USER]
    assert chat(http, messages=messages)["choices"][0]["message"]["content"] == REPLY
    assert "<|reviewer|>\nLooks fine." in replies.prompt()
    for role in ("", 7, None):
        refused(http, "/v1/chat/completions", "messages[0].role", messages=[{"role": role}])


STRICT = (
    "{% for m in messages %}{% if m['role'] not in ['user', 'assistant', 'system'] %}"
    "{{ raise_exception('Unknown role: ' + m['role']) }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_that_refuses_a_role_answers_400() -> None:
    tokenizer = byte_level_tokenizer(STRICT)
    engine = fake_async_engine(
        runner=FakeModelRunner(300, script=reply_script(tokenizer, "ok")), tokenizer=tokenizer
    )
    with TestClient(app=create_app(engine, MODEL)) as http:
        messages = [{"role": "critic", "content": "hm"}, *USER]
        reply = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4})
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == "messages" and "Unknown role: critic" in error["message"]
        assert chat(http, max_tokens=4)["choices"][0]["message"]["content"] == "ok"


# --- best_of -----------------------------------------------------------------------------

# Candidate j (seed + j) writes letter j, each token at logprob LOGPROBS[j].
LOGPROBS = [-3.0, -0.5, -2.0, -0.1, -4.0]


class CandidateRunner(FakeModelRunner):
    """Candidate j of a seeded request (its seed is ``seed + j``) writes ``"ABCDE"[j]``
    three times, then EOS, each token at logprob ``LOGPROBS[j]``."""

    def __init__(self) -> None:
        super().__init__(script=self.token)

    @staticmethod
    def choice(request: Request) -> int:
        seed = request.sampling_params.seed
        assert seed is not None
        return seed - 100

    def token(self, request: Request) -> int:
        if len(request.generated_token_ids) == 3:
            return EOS
        return ids("ABCDE"[self.choice(request)])[0]

    def execute(self, batch: SchedulerOutput) -> RunnerOutput:
        out = super().execute(batch)
        chunks = {c.request.request_id: c.request for c in batch.chunks}
        for request_id in out.sampled_token_ids:
            out.logprobs[request_id] = LOGPROBS[self.choice(chunks[request_id])]
        return out


@pytest.fixture
def candidates() -> Iterator[openai.OpenAI]:
    engine = fake_async_engine(runner=CandidateRunner(), tokenizer=TOKENIZER)
    with TestClient(app=create_app(engine, MODEL)) as http:
        yield openai.OpenAI(
            base_url=f"{http.base_url}/v1", api_key="unused", http_client=http, max_retries=0
        )


def test_best_of_returns_the_n_most_likely_candidates(candidates: openai.OpenAI) -> None:
    reply = candidates.completions.create(
        model=MODEL, prompt=["Q:", "R:"], n=2, max_tokens=8, seed=100, best_of=5
    )
    # Per prompt: D (-0.1 per token), then B (-0.5); each choice's index is its place.
    assert [(c.index, c.text) for c in reply.choices] == [
        (0, "DDD"),
        (1, "BBB"),
        (2, "DDD"),
        (3, "BBB"),
    ]
    assert all(c.logprobs is None for c in reply.choices)  # not asked: not shown
    assert reply.usage is not None and reply.usage.completion_tokens == 4 * 4  # those shown
    scored = candidates.completions.create(
        model=MODEL, prompt="Q:", max_tokens=8, seed=100, best_of=3, logprobs=0
    )
    assert scored.choices[0].text == "BBB"  # the best of A, B, C
    assert scored.choices[0].logprobs is not None
    assert scored.choices[0].logprobs.token_logprobs == [-0.5] * 4
    same = candidates.completions.create(model=MODEL, prompt="Q:", n=2, best_of=2, seed=100)
    assert [c.text for c in same.choices] == ["AAA", "BBB"]  # best_of == n: all, in order


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"best_of": 1, "n": 2}, ">= n"),
        ({"best_of": 3, "stream": True}, "streamed"),
        ({"best_of": 17}, "16"),
    ],
)
def test_bad_best_of_values_are_400s(candidates: openai.OpenAI, body: dict, message: str) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        candidates.completions.create(model=MODEL, prompt="Q:", **body)
    assert error.value.body["param"] == "best_of"  # type: ignore[index]
    assert message in error.value.body["message"]  # type: ignore[index]
