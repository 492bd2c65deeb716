"""Model weights: resolve a model spec to a local Hugging Face-format folder."""

from adapters.weights.folder import ResolvedModel
from adapters.weights.resolve import resolve_model

__all__ = ["ResolvedModel", "resolve_model"]
