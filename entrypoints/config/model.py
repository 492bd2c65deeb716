"""The model's settings (:class:`ModelSettings`): which model, how it loads (dtype, device,
quantization, threads, the KV budget), the tool-call format, and the ``infer serve`` flags
for the names it is served under: aliases, a pinned version, deprecation dates, and LoRA
adapters served as models of their own."""

import argparse
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

from application.serving.reasoning import PARSERS
from application.serving.served_models import LoraModule
from application.serving.tool_parsers import FORMATS
from domain.config import QUANTIZATION_METHODS
from domain.errors import InvalidParameterError
from domain.memory import KVCacheMemory
from domain.rollout import Rollout, parse_rollout

DEFAULT_MAX_LORAS = 16
# The highest LoRA rank a folder may load with: what the Tinker API trains at most
# (--tinker-max-lora-rank's default), so its checkpoints load.
DEFAULT_MAX_LORA_RANK = 128
DTYPE_NAMES = ("bfloat16", "float16", "float32")
RUNNERS = ("torch", "fake")
QUANTIZATIONS = (None, "none", "auto", *QUANTIZATION_METHODS)
TOOL_CALL_PARSERS = ("auto", *FORMATS)
REASONING_PARSERS = PARSERS
_VERSION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass(frozen=True)
class ModelSettings:
    """The flags of the same names (``--served-model-name``'s first name is
    ``served_model_name``, the model's id; the others are ``aliases``). ``model``: a spec
    of :func:`adapters.weights.resolve_model` (None: the embedded model); ``dtype``: a
    dtype or ``auto``; ``device``: None: CUDA when there is one; ``quantization``: the
    linears as ``int8``, ``int4``, ``gguf`` or ``auto`` (None or ``none``: in ``dtype``);
    ``threads``: intra-op CPU threads (None: torch's; the process entry sets them);
    ``runner``: ``torch``, or ``fake`` (no model loaded: the tests'); ``progress``:
    download bars; ``tool_call_parser``: a format or ``auto`` (the chat template's);
    ``reasoning_parser``: how chats' thinking is told from their answer (``auto``: the
    ``<think>`` parser for a template that writes ``<think>``; ``none``: not at all);
    ``kv_cache_memory``: the torch runner's KV blocks fill this budget (a
    :class:`KVCacheMemory`, ``auto``, or None: the engine's ``num_kv_blocks``);
    ``dense_weights_memory``: ``--dense-weights-memory`` in bytes (None: auto);
    ``enable_lora``: LoRA serving on without ``--lora-modules`` or Tinker (adapters loaded
    at run time); ``max_lora_rank``: the highest rank an adapter folder may have."""

    model: str | None = None
    dtype: str = "auto"
    device: str | None = None
    cache_dir: str | None = None
    quantization: str | None = None
    threads: int | None = None
    runner: str = "torch"
    progress: bool = True
    served_model_name: str | None = None
    aliases: tuple[str, ...] = ()
    model_version: str | None = None
    lora_modules: tuple[LoraModule, ...] = ()
    deprecations: Mapping[str, date] = field(default_factory=dict)
    rollouts: tuple[Rollout, ...] = ()
    max_loras: int = DEFAULT_MAX_LORAS
    enable_lora: bool = False
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    tool_call_parser: str = "auto"
    reasoning_parser: str = "auto"
    kv_cache_memory: KVCacheMemory | str | None = None
    # bf16 panel copies of a quantized model's weights for steps of many rows, at most this
    # many bytes (0: none; None: auto, see adapters.torch.factory.auto_panels_memory)
    dense_weights_memory: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_NAMES and self.dtype != "auto":
            raise ValueError(
                f"dtype must be auto or one of {', '.join(DTYPE_NAMES)}, got {self.dtype!r}"
            )
        if self.quantization not in QUANTIZATIONS:
            choices = ", ".join(q for q in QUANTIZATIONS if q)
            raise ValueError(f"quantization must be one of {choices}, got {self.quantization!r}")
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {self.runner!r}")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                f"got {self.tool_call_parser!r}"
            )
        if self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, "
                f"got {self.reasoning_parser!r}"
            )
        if self.model_version is not None and not _VERSION.fullmatch(self.model_version):
            raise InvalidParameterError(
                "model_version", f"{self.model_version!r}: letters, digits, '.', '_', '-'"
            )
        if self.dense_weights_memory is not None and self.dense_weights_memory < 0:
            raise InvalidParameterError("dense_weights_memory", "must be >= 0 bytes")
        if self.max_lora_rank < 1:
            raise InvalidParameterError(
                "max_lora_rank", f"must be at least 1, got {self.max_lora_rank}"
            )
        if self.max_loras < 1:
            raise InvalidParameterError("max_loras", f"must be at least 1, got {self.max_loras}")
        if len(self.lora_modules) > self.max_loras:
            raise InvalidParameterError(
                "max_loras",
                f"{self.max_loras} is fewer than the {len(self.lora_modules)} --lora-modules",
            )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ModelSettings":
        """``infer serve``'s settings (``InvalidParameterError`` naming a bad flag)."""
        model = args.model
        if args.model_tag is not None:
            if model is not None and model != args.model_tag:
                raise InvalidParameterError(
                    "model", f"given twice: {args.model_tag!r} and --model {model!r}"
                )
            model = args.model_tag
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
        names: Sequence[str] = args.served_model_name or ()
        return cls(
            model=model,
            dtype=args.dtype,
            device=args.device,
            cache_dir=args.cache_dir,
            quantization=args.quantization,
            threads=args.threads,
            served_model_name=names[0] if names else None,
            aliases=tuple(names[1:]),
            model_version=args.model_version,
            lora_modules=tuple(LoraModule(n, Path(path).expanduser()) for n, path in modules),
            deprecations=deprecations,
            rollouts=tuple(parse_rollout(spec) for spec in args.model_rollout or ()),
            max_loras=args.max_loras,
            enable_lora=args.enable_lora,
            max_lora_rank=args.max_lora_rank,
            tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser,
            kv_cache_memory=args.kv_cache_memory,
            dense_weights_memory=args.dense_weights_memory,
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
        "--model-rollout",
        action="append",
        default=None,
        metavar="NAME=MODEL:WEIGHT,MODEL:WEIGHT",
        help="serve NAME as a split of served models by weight (a canary: "
        "support=lora-v1:90,lora-v2:10; the same OpenAI user field, the same model); "
        "moved, pinned to tenants or rolled back at run time with /admin/rollouts (repeatable)",
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
    group.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters loaded at run time (POST /v1/load_lora_adapter, admin "
        "keys); on by itself with --lora-modules or the Tinker API",
    )
    group.add_argument(
        "--max-lora-rank",
        type=int,
        default=DEFAULT_MAX_LORA_RANK,
        help="the highest rank of a LoRA adapter folder served (default %(default)s)",
    )


def _pair(flag: str, spec: str) -> tuple[str, str]:
    name, sep, value = spec.partition("=")
    if not sep or not name.strip() or not value.strip():
        raise InvalidParameterError(flag, f"{spec!r} is not NAME=VALUE")
    return name.strip(), value.strip()
