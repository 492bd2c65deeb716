"""What the composition root builds from model specs: the model's folder, the embedding
model's, and the names a model is served under (its id, its aliases and Tinker's)."""

from collections.abc import Sequence
from pathlib import Path

from adapters.weights.embedding import resolve_embedding_model
from adapters.weights.folder import ResolvedModel
from adapters.weights.packaged import SMOLLM2_NAME
from adapters.weights.resolve import resolve_model

# Names under which a model is also advertised to Tinker clients, so that tinker-cookbook
# recipes (which look renderers up by exact model name) find one that writes the model's
# chat format: SmolLM2 uses ChatML, as the Qwen3 instruct renderer does.
DEFAULT_TINKER_ALIASES = {SMOLLM2_NAME: ("Qwen/Qwen3-4B-Instruct-2507",)}


def resolve(spec: str | None, cache_dir: str | None, progress: bool = True) -> ResolvedModel:
    """The model ``spec`` names as a local folder (:func:`resolve_model`)."""
    return resolve_model(spec, cache_dir=Path(cache_dir) if cache_dir else None, progress=progress)


def resolve_embedding(spec: str | None) -> ResolvedModel | None:
    """The embedding model's folder (None: no embedding model)."""
    return None if spec is None else resolve_embedding_model(spec)


def model_names(name: str, served: str | None, aliases: Sequence[str] | None) -> list[str]:
    """The names a model called ``name`` is served under: the served name (default
    ``name``) first, then the Tinker aliases (None: :data:`DEFAULT_TINKER_ALIASES`')."""
    first = served or name
    extra = DEFAULT_TINKER_ALIASES.get(name, ()) if aliases is None else aliases
    return [first, *(a for a in extra if a != first)]
