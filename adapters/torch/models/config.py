"""Model configuration as data: one dataclass read from an HF ``config.json``.

Family quirks (Gemma 3's sliding-window layers, QK-norm, norm offsets) are fields here so
the model code reads them instead of branching on names.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from domain.errors import ModelLoadError

MODEL_TYPES = {"llama": "llama", "qwen3": "qwen3", "gemma3_text": "gemma3", "gemma3": "gemma3"}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # "llama" | "qwen3" | "gemma3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    # Gemma 3: per-layer "sliding_attention" | "full_attention", local rope, query scale.
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    local_rope: RopeConfig | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    hf: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    @classmethod
    def from_folder(cls, folder: Path) -> "ModelConfig":
        path = folder / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"{path}: missing config.json")
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{path}: cannot read config ({e})") from e
        return cls.from_hf(raw, source=str(path))

    @classmethod
    def from_hf(cls, raw: dict[str, Any], *, source: str = "config") -> "ModelConfig":
        model_type = raw.get("model_type", "?")
        if model_type == "gemma3" and "text_config" in raw:
            raw = {**raw["text_config"], "model_type": "gemma3_text"}
        arch = MODEL_TYPES.get(model_type)
        if arch is None:
            raise ModelLoadError(
                f"{source}: unsupported architecture {model_type!r} "
                f"(supported: {', '.join(sorted(MODEL_TYPES))})"
            )
        try:
            return _build(arch, raw, source)
        except KeyError as e:
            raise ModelLoadError(f"{source}: missing field {e.args[0]!r}") from e


def _build(arch: str, raw: dict[str, Any], source: str) -> ModelConfig:
    hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or hidden // heads
    global_rope, local_rope = _rope_configs(arch, raw, source)
    gemma = arch == "gemma3"
    return ModelConfig(
        arch=arch,
        vocab_size=raw["vocab_size"],
        hidden_size=hidden,
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope=global_rope,
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        tie_word_embeddings=raw.get("tie_word_embeddings", gemma),
        attention_bias=raw.get("attention_bias", False),
        layer_types=tuple(_gemma_layer_types(raw)) if gemma else (),
        sliding_window=raw.get("sliding_window") if gemma else None,
        local_rope=local_rope,
        query_pre_attn_scalar=raw.get("query_pre_attn_scalar", head_dim) if gemma else None,
        final_logit_softcapping=raw.get("final_logit_softcapping") if gemma else None,
        hf=raw,
    )


def _rope_configs(
    arch: str, raw: dict[str, Any], source: str
) -> tuple[RopeConfig, RopeConfig | None]:
    """(global rope, Gemma's local rope) from either transformers-5 ``rope_parameters`` or
    the older ``rope_theta`` / ``rope_scaling`` / ``rope_local_base_freq`` fields."""
    params = raw.get("rope_parameters")
    if arch == "gemma3":
        if params and "full_attention" in params:
            full, sliding = params["full_attention"], params["sliding_attention"]
        else:
            full = {"rope_theta": raw.get("rope_theta", 1e6), **(raw.get("rope_scaling") or {})}
            sliding = {"rope_theta": raw.get("rope_local_base_freq", 10000.0)}
        return _rope(full, source), _rope(sliding, source)
    if not params:
        params = {"rope_theta": raw.get("rope_theta", 10000.0), **(raw.get("rope_scaling") or {})}
    return _rope(params, source), None


def _rope(params: dict[str, Any], source: str) -> RopeConfig:
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(f"{source}: unsupported rope type {rope_type!r}")
    return RopeConfig(
        theta=float(params.get("rope_theta", 10000.0)),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def _gemma_layer_types(raw: dict[str, Any]) -> list[str]:
    if raw.get("layer_types"):
        return list(raw["layer_types"])
    pattern = raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6
    return [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
        for i in range(raw["num_hidden_layers"])
    ]
