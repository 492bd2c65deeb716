"""Tiny random transformers models written to GGUF the way llama.cpp's convert_hf_to_gguf
does (its tensor names, permuted llama q/k, Gemma norms as 1 + w, Llama 3 rope scaling as
rope_freqs), with a byte-level BPE vocabulary and a ChatML template."""

import math
from pathlib import Path

import gguf
import numpy as np
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    PreTrainedConfig,
    PreTrainedModel,
    Qwen3Config,
)
from transformers.convert_slow_tokenizer import bytes_to_unicode

# A byte-level BPE vocabulary: the 256 byte symbols, three merges, three special tokens.
BYTE_SYMBOLS = list(bytes_to_unicode().values())
MERGES = ["Ġ t", "h e", "Ġt he"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENS = [*BYTE_SYMBOLS, "Ġt", "he", "Ġthe", *SPECIALS]
EOS, IM_END = TOKENS.index("<|endoftext|>"), TOKENS.index("<|im_end|>")
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GGUF_ARCH = {
    "llama": gguf.MODEL_ARCH.LLAMA,
    "qwen3": gguf.MODEL_ARCH.QWEN3,
    "gemma3_text": gguf.MODEL_ARCH.GEMMA3,
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
SIZES = {
    "vocab_size": len(TOKENS),
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "max_position_embeddings": 128,
    "eos_token_id": EOS,
}
TINY_CONFIGS = {
    # Untied, grouped-query, Llama 3 rope scaling: like Llama 3.2.
    "llama": LlamaConfig(
        **(SIZES | {"max_position_embeddings": 16384}),
        num_hidden_layers=2,
        num_key_value_heads=2,
        rope_parameters=LLAMA3_ROPE,
    ),
    # head_dim 32 != hidden / heads, QK-norm, tied: like Qwen3-0.6B.
    "qwen3": Qwen3Config(
        **SIZES,
        num_hidden_layers=2,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=True,
        max_window_layers=2,  # = layers, as published (unused: no sliding window)
    ),
    # Six layers so that the last one is full attention; a window shorter than the test input.
    "gemma3": Gemma3TextConfig(
        **SIZES,
        num_hidden_layers=6,
        num_key_value_heads=1,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=4,
    ),
}


def tiny_model(arch: str) -> PreTrainedModel:
    """A random model with every parameter perturbed, so that norms are not all 1 (or 0)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(TINY_CONFIGS[arch], dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return model.eval()


def llama_cpp_permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute: interleave each head's rotary halves."""
    return (
        weight.reshape(n_heads, 2, weight.shape[0] // n_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def llama_cpp_rope_freqs(config: PreTrainedConfig) -> np.ndarray:
    """convert_hf_to_gguf's rope_freqs for Llama 3 rope scaling (its loop, as written there)."""
    rope = config.rope_parameters
    dim = config.head_dim
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    old_context = rope["original_max_position_embeddings"]
    low, high, factor = rope["low_freq_factor"], rope["high_freq_factor"], rope["factor"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_context / high:
            factors.append(1.0)
        elif wavelen > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def gguf_layout(model_type: str, name: str, weight: np.ndarray, config: PreTrainedConfig):
    if model_type == "llama" and name.endswith("q_proj.weight"):
        return llama_cpp_permute(weight, config.num_attention_heads)
    if model_type == "llama" and name.endswith("k_proj.weight"):
        return llama_cpp_permute(weight, config.num_key_value_heads)
    if model_type == "gemma3_text" and name.endswith("norm.weight"):
        return weight + np.float32(1)
    return weight


def write_gguf(model: PreTrainedModel, path: Path, qtype: gguf.GGMLQuantizationType) -> None:
    config = model.config
    arch = GGUF_ARCH[config.model_type]
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    write_hparams(writer, config)
    write_tokenizer(writer)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        weight = gguf_layout(config.model_type, name, tensor.numpy(), config)
        # llama.cpp quantizes matrices and keeps vectors (norms) in F32.
        kind = qtype if weight.ndim == 2 else gguf.GGMLQuantizationType.F32
        gguf_name = names.get_name(name, try_suffixes=(".weight",))
        writer.add_tensor(gguf_name, gguf.quants.quantize(weight, kind), raw_dtype=kind)
    if config.model_type == "llama":
        writer.add_tensor("rope_freqs.weight", llama_cpp_rope_freqs(config))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_hparams(writer: gguf.GGUFWriter, config: PreTrainedConfig) -> None:
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = config.rope_parameters
    writer.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
    if config.model_type == "gemma3_text":
        writer.add_sliding_window(config.sliding_window)


def write_tokenizer(writer: gguf.GGUFWriter) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(TOKENS)
    writer.add_token_merges(MERGES)
    normal, control = gguf.TokenType.NORMAL, gguf.TokenType.CONTROL
    writer.add_token_types([normal] * (len(TOKENS) - len(SPECIALS)) + [control] * len(SPECIALS))
    writer.add_bos_token_id(TOKENS.index("<|im_start|>"))
    writer.add_eos_token_id(EOS)
    writer.add_chat_template(CHATML)
