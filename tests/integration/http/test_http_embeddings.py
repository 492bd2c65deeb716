"""POST /v1/embeddings through the official openai SDK: the fake embedder through the
composition root, and all-MiniLM-L6-v2 from its wheel."""

import asyncio
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from litestar.testing import TestClient

from adapters.fake.embedder import FakeEmbedder
from adapters.http import HttpServices, create_app
from adapters.torch.embeddings.embedder import TorchEmbedder
from adapters.weights.embedding import MINILM_NAME, resolve_minilm
from application.access.keys import hash_key
from application.serving.embeddings import EmbeddingLimits, EmbeddingService
from entrypoints.config.embedding import EmbeddingSettings
from tests.fakes import fake_async_engine, fake_container

EMBED = "fake-embed"
FAKE = FakeEmbedder()  # computes what the server's own FakeEmbedder answers


def expected(*texts: str) -> list[list[float]]:
    return FAKE.embed(FAKE.tokenize(texts))


def close(a: Sequence[float], b: Sequence[float], tol: float = 1e-6) -> bool:
    return max(abs(x - y) for x, y in zip(a, b, strict=True)) <= tol


@pytest.fixture
def http(tmp_path: Path) -> Iterator[TestClient]:
    container = fake_container(cache_dir=str(tmp_path), embedding_model=EMBED)
    with TestClient(app=container.http_app()) as client:  # type: ignore[arg-type]
        yield client


def test_models_lists_the_chat_and_the_embedding_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["fake", EMBED]


def test_sdk_default_base64_decodes_to_the_vectors(client: openai.OpenAI) -> None:
    reply = client.embeddings.create(model=EMBED, input="hello")  # the SDK asks for base64
    assert reply.object == "list" and reply.model == EMBED
    [item] = reply.data
    assert (item.object, item.index) == ("embedding", 0)
    assert close(item.embedding, expected("hello")[0])
    assert (reply.usage.prompt_tokens, reply.usage.total_tokens) == (7, 7)  # [CLS] 5 [SEP]


def test_float_format_gives_the_same_vectors(http: TestClient) -> None:
    body = {"model": EMBED, "input": ["a", "bc"], "encoding_format": "float"}
    reply = http.post("/v1/embeddings", json=body).json()
    assert [d["index"] for d in reply["data"]] == [0, 1]
    for item, vector in zip(reply["data"], expected("a", "bc"), strict=True):
        assert close(item["embedding"], vector)


def test_strings_token_ids_and_lists_of_ids(client: openai.OpenAI) -> None:
    [[cls, *body, sep]] = FAKE.tokenize(["hi"])
    ids = [cls, *body, sep]
    texts = client.embeddings.create(model=EMBED, input=["hi", "there"])
    one = client.embeddings.create(model=EMBED, input=ids)
    many = client.embeddings.create(model=EMBED, input=[ids, [5, 6, 7]])
    for item, vector in zip(texts.data, expected("hi", "there"), strict=True):
        assert close(item.embedding, vector)
    assert close(one.data[0].embedding, texts.data[0].embedding)
    assert close(many.data[0].embedding, texts.data[0].embedding)
    assert close(many.data[1].embedding, FAKE.embed([[5, 6, 7]])[0])
    assert many.usage.prompt_tokens == len(ids) + 3


def test_model_may_be_left_out_and_dimensions_may_be_the_models(http: TestClient) -> None:
    reply = http.post("/v1/embeddings", json={"input": "x", "dimensions": 8})
    assert reply.status_code == 200 and reply.json()["model"] == EMBED


def test_long_text_is_truncated_to_the_models_max_tokens(client: openai.OpenAI) -> None:
    reply = client.embeddings.create(model=EMBED, input="word " * 100)
    assert reply.usage.prompt_tokens == FAKE.max_tokens


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        ({"input": ["ok", ""]}, "input"),
        ({"input": ["text", 5]}, "input"),
        ({"input": [True, False]}, "input"),
        ({"input": [[1, 2], []]}, "input"),
        ({"input": [[1, "a"]]}, "input"),
        ({"input": [1.5]}, "input"),
        ({"input": [{"text": "a"}]}, "input"),
        ({"input": [999]}, "input"),  # outside the vocabulary
        ({"input": list(range(1, 18))}, "input"),  # 17 ids, the model takes 16
        ({"input": 5}, "input"),
        ({}, "input"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "a", "dimensions": 4}, "dimensions"),
        ({"input": "a", "temperature": 1}, "temperature"),
    ],
)
def test_bad_requests_get_400_naming_the_field(
    http: TestClient, body: dict[str, Any], param: str
) -> None:
    reply = http.post("/v1/embeddings", json={"model": EMBED, **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)


def test_other_models_are_404_model_not_found(client: openai.OpenAI) -> None:
    for model in ("fake", "text-embedding-3-small"):
        with pytest.raises(openai.NotFoundError) as caught:
            client.embeddings.create(model=model, input="x")
        assert caught.value.code == "model_not_found"


def test_too_many_inputs_is_a_400(tmp_path: Path) -> None:
    container = fake_container(
        cache_dir=str(tmp_path),
        embeddings=EmbeddingSettings(EMBED, EmbeddingLimits(max_embedding_inputs=2)),
    )
    with TestClient(app=container.http_app()) as http:  # type: ignore[arg-type]
        reply = http.post("/v1/embeddings", json={"input": ["a", "b", "c"]})
    assert reply.status_code == 400
    assert "at most 2" in reply.json()["error"]["message"]


def test_keys_and_model_scopes_apply(tmp_path: Path) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text(
        '{"tenants": ['
        f'{{"id": "a", "keys": ["{hash_key("sk-a")}"]}},'
        f'{{"id": "chat-only", "keys": ["{hash_key("sk-c")}"], "models": ["fake"]}}]}}'
    )
    container = fake_container(
        cache_dir=str(tmp_path), embedding_model=EMBED, api_keys_file=str(keys)
    )
    with TestClient(app=container.http_app()) as http:  # type: ignore[arg-type]

        def post(key: str | None) -> Any:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            return http.post("/v1/embeddings", json={"input": "x"}, headers=headers)

        assert post(None).status_code == 401
        assert post("sk-c").status_code == 403
        assert post("sk-a").status_code == 200
        models = http.get("/v1/models", headers={"Authorization": "Bearer sk-c"}).json()
        assert [m["id"] for m in models["data"]] == ["fake"]


class SlowEmbedder(FakeEmbedder):
    def embed(self, inputs: Sequence[Sequence[int]]) -> list[list[float]]:
        time.sleep(0.05)
        return super().embed(inputs)


async def test_concurrent_requests_are_batched_and_each_gets_its_own() -> None:
    embedder = SlowEmbedder()
    service = EmbeddingService(embedder, EMBED)
    app = create_app(fake_async_engine(), "fake", HttpServices(embeddings=service))
    # httpx's ASGI transport serves the requests concurrently on this loop.
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        client = openai.AsyncOpenAI(
            base_url="http://test/v1", api_key="unused", http_client=http, max_retries=0
        )
        texts = [f"text number {i}" for i in range(12)]
        replies = await asyncio.gather(
            *(client.embeddings.create(model=EMBED, input=[t, t + "!"]) for t in texts)
        )
    await service.stop()
    for text, reply in zip(texts, replies, strict=True):
        for item, vector in zip(reply.data, expected(text, text + "!"), strict=True):
            assert close(item.embedding, vector)
    assert sum(len(call) for call in embedder.calls) == 24
    assert len(embedder.calls) < 12  # requests that waited shared a call


@pytest.fixture(scope="module")
def minilm() -> TorchEmbedder:
    return TorchEmbedder.from_folder(resolve_minilm().path)


def test_minilm_through_the_sdk_equals_the_embedder(minilm: TorchEmbedder) -> None:
    service = EmbeddingService(minilm, MINILM_NAME)
    app = create_app(fake_async_engine(), "fake", HttpServices(embeddings=service))
    texts = ["The cat sits on the mat.", "A completely different sentence about finance."]
    with TestClient(app=app) as http:
        client = openai.OpenAI(
            base_url=f"{http.base_url}/v1", api_key="unused", http_client=http, max_retries=0
        )
        reply = client.embeddings.create(model=MINILM_NAME, input=texts)
        models = {m.id: m for m in client.models.list().data}
    vectors = minilm.embed(minilm.tokenize(texts))
    assert all(len(d.embedding) == 384 for d in reply.data)
    assert all(close(d.embedding, v) for d, v in zip(reply.data, vectors, strict=True))
    assert reply.usage.prompt_tokens == sum(len(ids) for ids in minilm.tokenize(texts))
    assert models[MINILM_NAME].model_extra == {
        "root": MINILM_NAME,
        "parent": None,
        "max_model_len": 256,
        "deprecation_date": None,
        "task": "embed",
    }
