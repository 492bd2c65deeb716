"""vLLM's request extras where the engine's torch path is involved, on a tiny random Llama:
``bad_words`` in the logits processing, ``truncate_prompt_tokens`` (the truncated prompt is
what runs), ``prompt_logprobs`` on chat and completions (the model's own, with ranks)."""

from itertools import pairwise
from pathlib import Path

import pytest
import torch
from litestar.testing import TestClient

from adapters.fake import ByteTokenizer
from adapters.http import create_app
from adapters.torch.loading.loader import load_model
from adapters.torch.runtime.logits import banned_ids, process_logits
from domain.config import EngineConfig
from domain.sampling import SamplingParams
from tests.fakes import torch_async_engine
from tests.support.tiny_models import save_tiny_model

TOKENIZER = ByteTokenizer()
PROMPT = [5, 6, 7, 8]
USER = [{"role": "user", "content": "hi there"}]


def byte(char: str) -> int:
    return TOKENIZER.encode(char, add_special_tokens=False)[0]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    folder: Path = tmp_path_factory.mktemp("llama")
    save_tiny_model("llama", folder)
    return load_model(folder, dtype=torch.float32)


@pytest.fixture(scope="module")
def http(model):
    engine = torch_async_engine(model, EngineConfig(max_num_seqs=4, max_model_len=96))
    with TestClient(app=create_app(engine, "tiny")) as client:
        yield client


def post(http: TestClient, path: str, **body: object) -> dict:
    reply = http.post(path, json={"model": "tiny", "temperature": 0, **body})
    assert reply.status_code == 200, reply.text
    return reply.json()


def complete(http: TestClient, **body: object) -> dict:
    return post(http, "/v1/completions", **{"prompt": PROMPT, "max_tokens": 8, **body})


# --- bad_words ---------------------------------------------------------------------------


def test_banned_ids_follow_vllms_rule() -> None:
    words = [(7,), (1, 2), (1, 2, 3)]
    assert banned_ids(words, []) == [7]  # one token: always; longer: after their prefix
    assert banned_ids(words, [5, 1]) == [7, 2]
    assert banned_ids(words, [1, 2]) == [7, 3]
    rows = torch.zeros(2, 10)
    out = process_logits(
        rows, [SamplingParams(bad_words=((1, 2),)), SamplingParams()], None, [[1], [1]]
    )
    assert out[0, 2] == float("-inf") and torch.isfinite(out[0]).sum() == 9
    assert torch.equal(out[1], rows[1])  # a row without bad words is untouched


def test_a_forced_token_is_never_generated_twice_in_a_row_when_banned(http: TestClient) -> None:
    a = byte("a")
    forced = {"logit_bias": {str(a): 100}, "ignore_eos": True, "return_token_ids": True}
    plain = complete(http, **forced)["choices"][0]
    assert plain["token_ids"] == [a] * 8 and plain["text"] == "a" * 8
    banned = complete(http, **forced, bad_words=["aa"])["choices"][0]
    tokens = banned["token_ids"]
    assert tokens[0] == a and len(tokens) == 8
    assert all(not (x == a and y == a) for x, y in pairwise(tokens))
    assert tokens[::2] == [a] * 4  # 'a' comes back as soon as the word's prefix is gone


def test_a_one_token_bad_word_is_never_generated(http: TestClient) -> None:
    b = byte("b")
    chat = post(
        http,
        "/v1/chat/completions",
        messages=USER,
        max_tokens=6,
        logit_bias={str(b): 100},
        bad_words=["b"],
        return_token_ids=True,
    )["choices"][0]
    assert chat["token_ids"] and b not in chat["token_ids"]


# --- truncate_prompt_tokens --------------------------------------------------------------


def test_the_truncated_prompt_is_what_runs(http: TestClient) -> None:
    long = list(range(10, 100))  # 90 tokens + 8 > 96
    assert http.post("/v1/completions", json={"prompt": long, "max_tokens": 8}).status_code == 400
    cut = complete(http, prompt=long, truncate_prompt_tokens=20, return_token_ids=True)
    alone = complete(http, prompt=long[-20:], return_token_ids=True)
    assert cut["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]
    assert cut["choices"][0]["prompt_token_ids"] == long[-20:]
    assert cut["usage"]["prompt_tokens"] == 20


# --- prompt_logprobs ---------------------------------------------------------------------


def reference(model, prompt: list[int]) -> torch.Tensor:
    """The model's own logprobs at each prompt position (row i predicts token i + 1)."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt]))[0].float(), dim=-1)


def check_prompt_logprobs(rows: list, prompt: list[int], expected: torch.Tensor, k: int) -> None:
    assert len(rows) == len(prompt) and rows[0] is None
    for i in range(1, len(prompt)):
        row, lp, token = rows[i], expected[i - 1], prompt[i]
        rank = int((lp > lp[token]).sum()) + 1
        entry = row[str(token)]
        assert entry["logprob"] == pytest.approx(float(lp[token]), abs=1e-4)
        assert entry["rank"] == rank
        assert entry["decoded_token"] == TOKENIZER.decode([token], skip_special_tokens=False)
        top = lp.topk(k).indices.tolist()
        assert set(row) == {str(t) for t in [token, *top]}
        for r, t in enumerate(top, 1):
            assert row[str(t)]["rank"] == (rank if t == token else r)
        assert next(iter(row)) == str(token)  # the prompt's token first, as vLLM lists it


def test_chat_prompt_logprobs_are_the_models_own_with_ranks(http: TestClient, model) -> None:
    reply = post(http, "/v1/chat/completions", messages=USER, max_tokens=2, prompt_logprobs=2, n=2)
    prompt = TOKENIZER.render_chat(USER)
    check_prompt_logprobs(reply["prompt_logprobs"], prompt, reference(model, prompt), 2)
    zero = post(http, "/v1/chat/completions", messages=USER, max_tokens=1, prompt_logprobs=0)
    assert all(len(row) == 1 for row in zero["prompt_logprobs"][1:])
    assert "prompt_logprobs" not in post(http, "/v1/chat/completions", messages=USER, max_tokens=1)


def test_completion_prompt_logprobs_per_choice_beside_echo(http: TestClient, model) -> None:
    prompts = [PROMPT, [9, 10, 11]]
    reply = complete(http, prompt=prompts, max_tokens=2, prompt_logprobs=1, echo=True, logprobs=3)
    for choice, prompt in zip(reply["choices"], prompts, strict=True):
        check_prompt_logprobs(choice["prompt_logprobs"], prompt, reference(model, prompt), 1)
        echoed = choice["logprobs"]["top_logprobs"][1]  # echo + logprobs 3: three alternatives
        assert len(echoed) >= 3
