"""A local Hugging Face-format model folder, checked before anything tries to load it."""

import json
from dataclasses import dataclass
from pathlib import Path

from domain.errors import ModelLoadError

INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class ResolvedModel:
    path: Path  # the HF-format folder
    name: str  # served model id, e.g. "HuggingFaceTB/SmolLM2-135M-Instruct"
    random_weights: bool  # True for dummy: the folder has config.json only, the loader random-inits
    has_tokenizer: bool


def has_tokenizer(folder: Path) -> bool:
    return (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file()


def resolve_folder(folder: Path, name: str) -> ResolvedModel:
    """``folder`` as it is, once it has a config and every safetensors file it names."""
    config = folder / "config.json"
    if not config.is_file():
        raise ModelLoadError(f"{folder}: missing config.json")
    if (folder / INDEX_FILE).is_file():
        _check_shards(folder / INDEX_FILE)
    elif not any(folder.glob("*.safetensors")):
        raise ModelLoadError(f"{folder}: no *.safetensors weights and no {INDEX_FILE}")
    return ResolvedModel(folder, name, random_weights=False, has_tokenizer=has_tokenizer(folder))


def _check_shards(index: Path) -> None:
    try:
        shards = set(json.loads(index.read_text())["weight_map"].values())
    except (OSError, ValueError, KeyError, AttributeError) as e:
        raise ModelLoadError(f"{index}: not a safetensors index ({e!r})") from e
    missing = sorted(shard for shard in shards if not (index.parent / shard).is_file())
    if missing:
        raise ModelLoadError(f"{index}: names missing shard files {', '.join(missing)}")
