"""The default sampling parameters of ``--generation-config`` (vLLM's): read from a
``generation_config.json`` (the model's folder's, or another folder's), the operator's
overrides over them, with the server's output cap."""

import json
from collections.abc import Mapping
from pathlib import Path

import structlog

from application.serving.generation import GenerationDefaults
from domain.errors import InvalidParameterError

log = structlog.get_logger(__name__)
FILE = "generation_config.json"


def generation_defaults(
    model_folder: Path | None,
    mode: str,
    overrides: Mapping[str, object],
    max_output_tokens: int | None,
) -> GenerationDefaults:
    """``mode``: ``auto`` (``model_folder``'s file; None: no model, none), ``vllm`` (no
    file), or a folder holding the file (a missing one is an error naming the flag)."""
    if mode == "vllm":
        found: dict[str, object] = {}
    elif mode == "auto":
        found = _read(model_folder / FILE) if model_folder is not None else {}
    else:
        path = Path(mode).expanduser() / FILE
        if not path.is_file():
            raise InvalidParameterError("generation_config", f"no {FILE} in {mode!r}")
        found = _read(path)
    defaults = GenerationDefaults.of({**found, **overrides}, max_output_tokens)
    if defaults.sampling or defaults.max_tokens is not None:
        log.info(
            "default sampling parameters",
            source=mode,
            **dict(defaults.sampling),
            max_new_tokens=defaults.max_tokens,
        )
    return defaults


def _read(path: Path) -> dict[str, object]:
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise InvalidParameterError("generation_config", f"{path}: {e}") from None
    return value if isinstance(value, dict) else {}
