"""OpenAI's ``logit_bias`` on the wire: applied to its request's rows on a real (tiny)
model, other requests untouched; bad keys and ids are 400s naming ``logit_bias``."""

from pathlib import Path

import pytest
import torch
from litestar.testing import TestClient

from adapters.fake import ByteTokenizer
from adapters.http import create_app
from adapters.torch.loading.loader import load_model
from domain.config import EngineConfig
from tests.fakes import torch_async_engine
from tests.support.tiny_models import VOCAB, save_tiny_model

PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def http(tmp_path_factory: pytest.TempPathFactory):
    folder: Path = tmp_path_factory.mktemp("llama")
    save_tiny_model("llama", folder)
    model = load_model(folder, dtype=torch.float32)
    engine = torch_async_engine(model, EngineConfig(max_num_seqs=4, max_model_len=64))
    with TestClient(app=create_app(engine, "tiny")) as client:
        yield client


def complete(http: TestClient, **body: object) -> dict:
    reply = http.post(
        "/v1/completions",
        json={"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0, **body},
    )
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_a_large_bias_forces_the_token_and_a_ban_removes_one(http: TestClient) -> None:
    target = 42
    forced = complete(http, logit_bias={str(target): 100})
    assert forced["choices"][0]["text"] == ByteTokenizer().decode([target] * 6)
    plain = complete(http)["choices"][0]["text"]
    assert plain != forced["choices"][0]["text"]  # the bias stayed on its own request
    first = ByteTokenizer().encode(plain, add_special_tokens=False)[0]
    banned = complete(http, logit_bias={str(first): -100})["choices"][0]["text"]
    assert ByteTokenizer().encode(banned, add_special_tokens=False)[0] != first


@pytest.mark.parametrize(
    "bias", [{"abc": 1}, {"5": 101}, {"-1": 1}, {str(VOCAB): 1}, {"5": "high"}]
)
def test_bad_biases_are_400s_naming_logit_bias(http: TestClient, bias: dict) -> None:
    reply = http.post(
        "/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "logit_bias": bias},
    )
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"].startswith("logit_bias")
