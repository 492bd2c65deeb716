"""Tiny random transformers models of each family, saved as HF folders (parity fixtures)."""

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    PretrainedConfig,
    Qwen3Config,
)

VOCAB = 512


def tiny_config(arch: str, **overrides: object) -> PretrainedConfig:
    """``overrides``: config fields to change (e.g. ``head_dim``)."""
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    common.update(overrides)
    if arch == "llama":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        return LlamaConfig(**common, rope_parameters=rope, tie_word_embeddings=False)
    if arch == "qwen3":
        return Qwen3Config(**common, head_dim=32, tie_word_embeddings=True)
    if arch == "gemma3":
        return Gemma3TextConfig(
            **{**common, "num_hidden_layers": 4},
            head_dim=32,  # a multiple of 32: the CPU decode-attention kernel applies
            sliding_window=6,
            layer_types=[
                "sliding_attention",
                "full_attention",
                "sliding_attention",
                "full_attention",
            ],
            query_pre_attn_scalar=24,
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        )
    raise ValueError(arch)


def save_tiny_model(arch: str, folder: Path, seed: int = 0, **overrides: object) -> torch.nn.Module:
    """Save a tiny random model with every parameter perturbed (norms included) to ``folder``."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.eval()
    model.save_pretrained(folder)
    return model
