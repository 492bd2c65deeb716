"""A model spec (what the user typed) -> a local Hugging Face-format folder."""

import re
from pathlib import Path

from adapters.weights.cache import default_cache_dir
from adapters.weights.dummy import resolve_dummy
from adapters.weights.folder import ResolvedModel, resolve_folder
from adapters.weights.packaged import (
    GEMMA3_270M_NAME,
    SMOLLM2_NAME,
    resolve_gemma3_270m,
    resolve_gguf_file,
    resolve_smollm2,
)
from domain.errors import ModelLoadError

DEFAULT_SPECS = {"default", "smollm2", SMOLLM2_NAME.lower()}
GEMMA3_270M_SPECS = {"gemma-3-270m", GEMMA3_270M_NAME.lower()}
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
ACCEPTED_FORMS = (
    "'default' (or 'smollm2', SmolLM2-135M-Instruct), 'gemma-3-270m', "
    "'dummy:<name>' (random weights for a known config), a Hugging Face model folder, "
    "a .gguf file, or a hub id 'org/name'"
)


def resolve_model(
    spec: str | None, *, cache_dir: Path | None = None, progress: bool = True
) -> ResolvedModel:
    """The HF-format folder for ``spec``, converting (once, cached) or downloading as needed.

    ``progress`` shows a progress bar on stderr while a GGUF file is converted.
    """
    spec = (spec or "default").strip()
    cache = cache_dir or default_cache_dir()
    if spec.lower() in DEFAULT_SPECS:
        return resolve_smollm2(cache, progress=progress)
    if spec.lower() in GEMMA3_270M_SPECS:
        return resolve_gemma3_270m(cache, progress=progress)
    if spec.lower().startswith("dummy:"):
        return resolve_dummy(spec.partition(":")[2], cache)
    path = Path(spec).expanduser()
    if path.is_dir():
        return resolve_folder(path, path.resolve().name)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return resolve_gguf_file(path, path.stem, cache, progress=progress)
    if path.is_file():
        raise ModelLoadError(f"{path}: not a model folder or a .gguf file")
    if _looks_like_path(spec):
        raise ModelLoadError(f"no such file or directory: {spec}")
    if HUB_ID.fullmatch(spec):
        # Imported here: huggingface_hub's client adds 0.25 s to every start-up otherwise.
        from adapters.weights.hub import resolve_hub

        return resolve_hub(spec)
    raise ModelLoadError(f"unknown model {spec!r}: expected {ACCEPTED_FORMS}")


def _looks_like_path(spec: str) -> bool:
    """A hub id is exactly ``org/name``; anything else with a slash or a .gguf is a path."""
    return spec.startswith(("/", ".", "~")) or spec.count("/") > 1 or spec.endswith(".gguf")
