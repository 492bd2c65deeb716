"""``infer serve`` flags for the names the model is served under: aliases,
a pinned version, deprecation dates, and LoRA adapters served as models of their own."""

import argparse
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

from application.served_models import LoraModule
from domain.errors import InvalidParameterError

DEFAULT_MAX_LORAS = 16
_VERSION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass(frozen=True)
class ModelSettings:
    """The flags of the same names; the first ``--served-model-name`` is the model's id
    (``create_container``'s ``served_model_name``), ``aliases`` the others."""

    aliases: tuple[str, ...] = ()
    model_version: str | None = None
    lora_modules: tuple[LoraModule, ...] = ()
    deprecations: Mapping[str, date] = field(default_factory=dict)
    max_loras: int = DEFAULT_MAX_LORAS

    def __post_init__(self) -> None:
        if self.model_version is not None and not _VERSION.fullmatch(self.model_version):
            raise InvalidParameterError(
                "model_version", f"{self.model_version!r}: letters, digits, '.', '_', '-'"
            )
        if self.max_loras < 1:
            raise InvalidParameterError("max_loras", f"must be at least 1, got {self.max_loras}")
        if len(self.lora_modules) > self.max_loras:
            raise InvalidParameterError(
                "max_loras",
                f"{self.max_loras} is fewer than the {len(self.lora_modules)} --lora-modules",
            )


def add_model_name_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model names (/v1/models)")
    group.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model's id in the API, then its aliases (default: the model's name)",
    )
    group.add_argument(
        "--model-version",
        default=None,
        metavar="VERSION",
        help="also serve the model as <id>-<VERSION>, its pinned version "
        "(e.g. 2026-01-01: smollm2-2026-01-01)",
    )
    group.add_argument(
        "--model-deprecation",
        action="append",
        default=None,
        metavar="NAME=YYYY-MM-DD",
        help="the day a served name (an alias, the pinned version, a LoRA module) stops being "
        "served: until then replies carry Deprecation and Sunset headers (repeatable)",
    )
    group.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        default=None,
        metavar="NAME=PATH",
        help="serve a PEFT LoRA adapter folder as the model NAME (repeatable)",
    )
    group.add_argument(
        "--max-loras",
        type=int,
        default=DEFAULT_MAX_LORAS,
        help="LoRA adapters kept loaded at once: the --lora-modules, and Tinker checkpoints "
        "as they are used (default %(default)s)",
    )


def model_settings(args: argparse.Namespace) -> ModelSettings:
    """The settings the flags ask for (``InvalidParameterError`` naming a bad one)."""
    modules = [_pair("lora_modules", spec) for spec in args.lora_modules or ()]
    deprecations = {}
    for spec in args.model_deprecation or ():
        name, day = _pair("model_deprecation", spec)
        try:
            deprecations[name] = date.fromisoformat(day)
        except ValueError:
            raise InvalidParameterError(
                "model_deprecation", f"{spec!r}: the date must be YYYY-MM-DD"
            ) from None
    return ModelSettings(
        aliases=tuple((args.served_model_name or [])[1:]),
        model_version=args.model_version,
        lora_modules=tuple(LoraModule(name, Path(path).expanduser()) for name, path in modules),
        deprecations=deprecations,
        max_loras=args.max_loras,
    )


def served_model_name(args: argparse.Namespace) -> str | None:
    """The model's id: the first ``--served-model-name``."""
    names: Sequence[str] | None = args.served_model_name
    return names[0] if names else None


def _pair(flag: str, spec: str) -> tuple[str, str]:
    name, sep, value = spec.partition("=")
    if not sep or not name.strip() or not value.strip():
        raise InvalidParameterError(flag, f"{spec!r} is not NAME=VALUE")
    return name.strip(), value.strip()
