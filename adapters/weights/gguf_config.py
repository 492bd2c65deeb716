"""config.json and generation_config.json for a GGUF model, from its metadata.

GGUF keeps the hyperparameters llama.cpp needs; what it leaves out is filled with the values
transformers (and the published configs) use for the family.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from domain.errors import ModelLoadError

# GGUF general.architecture -> (HF model_type, HF architectures[0]).
HF_FAMILIES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
}
# Chat templates end a turn with one of these; generation must stop there as well as at EOS.
END_OF_TURN_TOKENS = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>")
GEMMA3_FULL_ATTENTION_EVERY = 6  # llama.cpp hard-codes it for gemma3 too: GGUF has no key


@dataclass(frozen=True)
class GGUFMetadata:
    path: Path
    values: Mapping[str, Any]  # key -> decoded value; the tokenizer's bulky arrays left out
    tokens: list[str]

    @property
    def arch(self) -> str:
        return str(self.values["general.architecture"])

    def required(self, key: str) -> Any:
        full_key = f"{self.arch}.{key}"
        if full_key not in self.values:
            raise ModelLoadError(f"{self.path}: missing metadata {full_key}")
        return self.values[full_key]

    def optional(self, key: str, default: Any = None) -> Any:
        return self.values.get(f"{self.arch}.{key}", default)


def generation_config(meta: GGUFMetadata) -> dict[str, Any]:
    config = {
        "bos_token_id": meta.values.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": _eos_token_ids(meta),
        "pad_token_id": meta.values.get("tokenizer.ggml.padding_token_id"),
    }
    return {key: value for key, value in config.items() if value is not None}


def _eos_token_ids(meta: GGUFMetadata) -> int | list[int] | None:
    eos = meta.values.get("tokenizer.ggml.eos_token_id")
    template = meta.values.get("tokenizer.chat_template") or ""
    ids = [eos] if eos is not None else []
    ids += [meta.tokens.index(t) for t in END_OF_TURN_TOKENS if t in template and t in meta.tokens]
    unique = list(dict.fromkeys(ids))
    return unique[0] if len(unique) == 1 else (unique or None)


def hf_config(
    meta: GGUFMetadata, shapes: Mapping[str, tuple[int, ...]], rope_freqs: np.ndarray | None
) -> dict[str, Any]:
    """The config.json of the model whose GGUF tensor shapes (torch order) are ``shapes``."""
    model_type, architecture = HF_FAMILIES[meta.arch]
    if "token_embd.weight" not in shapes:
        raise ModelLoadError(f"{meta.path}: no token_embd.weight tensor")
    heads = meta.required("attention.head_count")
    hidden = meta.required("embedding_length")
    head_dim = meta.optional("attention.key_length", hidden // heads)
    config = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": shapes["token_embd.weight"][0],
        "hidden_size": hidden,
        "intermediate_size": meta.required("feed_forward_length"),
        "num_hidden_layers": meta.required("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.optional("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "max_position_embeddings": meta.required("context_length"),
        "rms_norm_eps": meta.required("attention.layer_norm_rms_epsilon"),
        "rope_theta": meta.optional("rope.freq_base", 10000.0),
        "rope_scaling": _rope_scaling(meta, rope_freqs, head_dim),
        "attention_bias": "blk.0.attn_q.bias" in shapes,
        "attention_dropout": 0.0,
        "tie_word_embeddings": "output.weight" not in shapes,
        **{k: v for k, v in generation_config(meta).items() if k != "pad_token_id"},
    }
    return config | _FAMILY_DEFAULTS[meta.arch](meta, config)


def _llama_defaults(meta: GGUFMetadata, config: dict[str, Any]) -> dict[str, Any]:
    return {"hidden_act": "silu", "mlp_bias": False}


def _qwen3_defaults(meta: GGUFMetadata, config: dict[str, Any]) -> dict[str, Any]:
    return {
        "hidden_act": "silu",
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": config["num_hidden_layers"],
    }


def _gemma3_defaults(meta: GGUFMetadata, config: dict[str, Any]) -> dict[str, Any]:
    layers = config["num_hidden_layers"]
    # llama.cpp scales queries by hidden/heads for the 62-layer 27B model, by head_dim otherwise.
    per_head = config["hidden_size"] // config["num_attention_heads"]
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": per_head if layers == 62 else config["head_dim"],
        "sliding_window": meta.required("attention.sliding_window"),
        "layer_types": [
            "full_attention" if (i + 1) % GEMMA3_FULL_ATTENTION_EVERY == 0 else "sliding_attention"
            for i in range(layers)
        ],
        "rope_local_base_freq": 10000.0,
        "final_logit_softcapping": meta.optional("final_logit_softcapping"),
        "attn_logit_softcapping": meta.optional("attn_logit_softcapping"),
        "pad_token_id": meta.values.get("tokenizer.ggml.padding_token_id", 0),
    }


_FAMILY_DEFAULTS = {"llama": _llama_defaults, "qwen3": _qwen3_defaults, "gemma3": _gemma3_defaults}


def _rope_scaling(
    meta: GGUFMetadata, rope_freqs: np.ndarray | None, head_dim: int
) -> dict[str, Any] | None:
    if rope_freqs is not None:
        return _llama3_rope_scaling(meta, rope_freqs, head_dim)
    kind = meta.optional("rope.scaling.type", "none")
    factor = meta.optional("rope.scaling.factor", 1.0)
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        original = meta.required("rope.scaling.original_context_length")
        return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
    if kind != "none":
        raise ModelLoadError(f"{meta.path}: unsupported rope scaling type {kind!r}")
    return None


def _llama3_rope_scaling(
    meta: GGUFMetadata, rope_freqs: np.ndarray, head_dim: int
) -> dict[str, Any]:
    """Llama 3.1+ rope scaling, which llama.cpp stores as per-frequency divisors (rope_freqs).

    Every published Llama 3 checkpoint uses these constants and varies only ``factor``; the
    divisors they imply must match the stored ones, or the file is something else.
    """
    scaling = {
        "rope_type": "llama3",
        "factor": float(rope_freqs.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    theta = meta.optional("rope.freq_base", 10000.0)
    if not np.allclose(llama3_rope_divisors(scaling, theta, head_dim), rope_freqs, rtol=1e-4):
        raise ModelLoadError(
            f"{meta.path}: rope_freqs.weight does not match Llama 3 rope scaling with "
            f"low_freq_factor 1, high_freq_factor 4 and 8192 original positions"
        )
    return scaling


def llama3_rope_divisors(scaling: Mapping[str, Any], theta: float, head_dim: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf writes as rope_freqs: [head_dim // 2] divisors."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelen = 2 * np.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)
    smooth = (original / wavelen - low) / (high - low)
    between = 1 / ((1 - smooth) / factor + smooth)
    divisors = np.where(wavelen > original / low, factor, between)
    return np.where(wavelen < original / high, 1.0, divisors)
