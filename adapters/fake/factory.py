"""What the composition root builds from the fakes when no model is loaded: the toy
training backend (which samples itself) and a fake embedding model."""

from collections.abc import Sequence

from adapters.fake.embedder import FakeEmbedder
from adapters.fake.toy_backend import ToyBackend
from application.serving.embeddings import EmbeddingLimits, EmbeddingService
from domain.tinker.custom_loss import CustomLossGradient


def build_toy_backend(
    names: Sequence[str], max_context: int, custom_loss: CustomLossGradient | None = None
) -> ToyBackend:
    """The numpy bigram backend under the served names (no model loaded); ``custom_loss``
    runs stored custom losses."""
    return ToyBackend(
        names[0], aliases=tuple(names[1:]), max_context=max_context, custom_loss=custom_loss
    )


def build_fake_embeddings(spec: str | None, limits: EmbeddingLimits) -> EmbeddingService | None:
    """A :class:`FakeEmbedder` served under ``spec`` as its name; None: no embeddings."""
    return None if spec is None else EmbeddingService(FakeEmbedder(), spec, limits)
