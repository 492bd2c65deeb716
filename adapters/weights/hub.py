"""``org/name``: a model snapshot from the Hugging Face Hub, or from its local cache."""

from pathlib import Path

from huggingface_hub import constants, snapshot_download

from adapters.weights.folder import ResolvedModel, resolve_folder
from domain.errors import ModelLoadError

# What a model folder needs: configs, weights, tokenizer files, chat templates.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.jinja", "*.txt"]


def resolve_hub(repo_id: str) -> ResolvedModel:
    """Downloads what is missing; with ``HF_HUB_OFFLINE=1``, only the local cache is used."""
    try:
        folder = snapshot_download(repo_id, allow_patterns=ALLOW_PATTERNS)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{repo_id}: not a local path, and {_why_not_fetched(e)}") from e
    return resolve_folder(Path(folder), repo_id)


def _why_not_fetched(error: Exception) -> str:
    where = f"not in the Hugging Face cache {constants.HF_HUB_CACHE}"
    if constants.HF_HUB_OFFLINE:
        return f"{where} while HF_HUB_OFFLINE is set ({error})"
    return f"{where} nor downloadable from the Hub ({error})"
