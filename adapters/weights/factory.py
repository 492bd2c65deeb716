"""What the composition root builds from model specs: the model's folder, the embedding
model's, and the names a model is served under (its id, its aliases and Tinker's)."""

from collections.abc import Sequence
from pathlib import Path

from adapters.weights.embedding import resolve_embedding_model
from adapters.weights.folder import ResolvedModel
from adapters.weights.resolve import resolve_model


def resolve(spec: str | None, cache_dir: str | None, progress: bool = True) -> ResolvedModel:
    """The model ``spec`` names as a local folder (:func:`resolve_model`)."""
    return resolve_model(spec, cache_dir=Path(cache_dir) if cache_dir else None, progress=progress)


def resolve_embedding(spec: str | None) -> ResolvedModel | None:
    """The embedding model's folder (None: no embedding model)."""
    return None if spec is None else resolve_embedding_model(spec)


def model_names(name: str, served: str | None, aliases: Sequence[str]) -> list[str]:
    """The names a model called ``name`` is served under: the served name (default
    ``name``) first, then the Tinker aliases (``--tinker-alias``; none by default: an alias
    tells clients the server hosts a model it does not)."""
    first = served or name
    return [first, *(a for a in aliases if a != first)]
