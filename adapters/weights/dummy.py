"""``dummy:<name>``: a real model's config with no weights, for benchmarks at real sizes."""

from importlib.resources import files
from pathlib import Path

from adapters.weights.cache import building, model_folder
from adapters.weights.folder import ResolvedModel
from domain.errors import ModelLoadError

# dummy_configs/<short name>.json holds the published config.json of this hub model.
HUB_IDS = {
    "Llama-3.2-1B": "meta-llama/Llama-3.2-1B-Instruct",
    "Qwen3-0.6B": "Qwen/Qwen3-0.6B",
    "Qwen3-1.7B": "Qwen/Qwen3-1.7B",
    "Gemma-3-1B": "google/gemma-3-1b-it",
    "SmolLM2-135M": "HuggingFaceTB/SmolLM2-135M",
}


def resolve_dummy(name: str, cache_dir: Path) -> ResolvedModel:
    """A folder holding only ``config.json``; the loader initialises random weights."""
    short = _short_name(name)
    config = files("adapters.weights").joinpath(f"dummy_configs/{short}.json").read_text()
    folder = model_folder(cache_dir, f"dummy-{short}", config)
    if not folder.is_dir():
        with building(folder) as scratch:
            (scratch / "config.json").write_text(config)
    return ResolvedModel(folder, f"dummy:{short}", random_weights=True, has_tokenizer=False)


def _short_name(name: str) -> str:
    """``Llama-3.2-1B``, ``meta-llama/Llama-3.2-1B-Instruct`` or its basename, any case."""
    wanted = name.strip().lower()
    for short, hub_id in HUB_IDS.items():
        if wanted in {short.lower(), hub_id.lower(), hub_id.split("/")[1].lower()}:
            return short
    raise ModelLoadError(
        f"dummy:{name}: unknown model; dummy models are {', '.join(HUB_IDS)} "
        f"(or their hub ids {', '.join(HUB_IDS.values())})"
    )
