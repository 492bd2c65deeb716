"""What the composition root builds from the fakes when no model is loaded: the toy
training backend (which samples itself) and a fake embedding model."""

from collections.abc import Sequence

from adapters.fake.embedder import FakeEmbedder
from adapters.fake.toy_backend import ToyBackend
from application.embeddings import EmbeddingLimits, EmbeddingService


def build_toy_backend(names: Sequence[str], max_context: int) -> ToyBackend:
    """The numpy bigram backend under the served names (no model loaded)."""
    return ToyBackend(names[0], aliases=tuple(names[1:]), max_context=max_context)


def build_fake_embeddings(spec: str | None, limits: EmbeddingLimits) -> EmbeddingService | None:
    """A :class:`FakeEmbedder` served under ``spec`` as its name; None: no embeddings."""
    return None if spec is None else EmbeddingService(FakeEmbedder(), spec, limits)
