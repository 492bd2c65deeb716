"""GGUF -> HF folder conversion, checked by round trips through tiny random transformers models.

Each tiny model is written to GGUF the way llama.cpp's convert_hf_to_gguf does (its tensor
names, permuted llama q/k, Gemma norms as 1 + w, Llama 3 rope scaling as rope_freqs) and
converted back; the result must hold the original tensors and give the original logits.
"""

import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma3TextConfig,
    LlamaConfig,
    PreTrainedConfig,
    PreTrainedModel,
    Qwen3Config,
)
from transformers.convert_slow_tokenizer import bytes_to_unicode

import adapters.weights.gguf as converter
from adapters.weights import resolve_model
from domain.errors import ModelLoadError

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
INPUT_IDS = torch.tensor([[1, 70, 256, 258, 33, 90, 100, 7, 258, 44, 12, 200]])


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


@pytest.fixture(scope="module")
def converted(request, tmp_path_factory) -> tuple[PreTrainedModel, Path]:
    """(original tiny model, converted folder) for request.param = (arch, quant type)."""
    arch, qtype = request.param
    model = tiny_model(arch)
    folder = tmp_path_factory.mktemp(f"{arch}-{qtype.name}")
    write_gguf(model, folder / "tiny.gguf", qtype)
    (folder / "hf").mkdir()
    converter.convert_gguf(folder / "tiny.gguf", folder / "hf", progress=False)
    return model, folder / "hf"


def expected_tensors(model: PreTrainedModel) -> dict[str, np.ndarray]:
    """The state dict as the conversion must restore it: tied heads dropped; Gemma norms
    went through (w + 1) - 1 in float32, which is not always w exactly."""
    state = {name: t.numpy() for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        del state["lm_head.weight"]
    if model.config.model_type == "gemma3_text":
        state = {
            n: (w + np.float32(1)) - np.float32(1) if n.endswith("norm.weight") else w
            for n, w in state.items()
        }
    return state


F32 = gguf.GGMLQuantizationType.F32
Q8_0 = gguf.GGMLQuantizationType.Q8_0
ARCHS = list(TINY_CONFIGS)


@pytest.mark.parametrize("converted", [(a, F32) for a in ARCHS], ids=ARCHS, indirect=True)
def test_f32_gguf_converts_back_to_the_exact_tensors(converted):
    model, folder = converted
    tensors = load_file(folder / "model.safetensors")
    expected = expected_tensors(model)
    assert sorted(tensors) == sorted(expected)
    for name, weight in expected.items():
        assert tensors[name].dtype == np.float32
        np.testing.assert_array_equal(tensors[name], weight, err_msg=name)


@pytest.mark.parametrize("converted", [(a, Q8_0) for a in ARCHS], ids=ARCHS, indirect=True)
def test_q8_0_gguf_converts_back_to_close_tensors(converted):
    model, folder = converted
    tensors = load_file(folder / "model.safetensors")
    for name, weight in expected_tensors(model).items():
        # Q8_0: 8-bit steps of max|w| / 127 per block of 32; a permutation would be far off.
        step = np.abs(weight).max() / 127
        np.testing.assert_allclose(tensors[name], weight, rtol=0, atol=step, err_msg=name)


@pytest.mark.parametrize("converted", [(a, F32) for a in ARCHS], ids=ARCHS, indirect=True)
def test_converted_folder_gives_the_original_logits_in_transformers(converted):
    model, folder = converted
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        expected, actual = model(INPUT_IDS).logits, loaded(INPUT_IDS).logits
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("converted", [(a, F32) for a in ARCHS], ids=ARCHS, indirect=True)
def test_converted_config_matches_the_original(converted):
    model, folder = converted
    original, loaded = model.config.to_dict(), AutoConfig.from_pretrained(folder).to_dict()
    # Special token ids come from the tokenizer (checked below); the rest is bookkeeping.
    ignored = {"bos_token_id", "eos_token_id", "pad_token_id", "architectures", "dtype"}
    ignored |= {"transformers_version", "_name_or_path", "use_cache"}
    assert {k: v for k, v in loaded.items() if k not in ignored} == {
        k: v for k, v in original.items() if k not in ignored
    }
    assert loaded["architectures"] == [type(model).__name__]
    assert loaded["eos_token_id"] == [EOS, IM_END]


@pytest.mark.parametrize("converted", [("qwen3", F32)], ids=["qwen3"], indirect=True)
def test_converted_tokenizer_matches_the_gguf_vocabulary(converted):
    _, folder = converted
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer("the the<|im_end|>").input_ids
    assert ids == [TOKENS.index("t"), TOKENS.index("he"), TOKENS.index("Ġthe"), IM_END]
    assert tokenizer.eos_token == "<|endoftext|>"
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n"


@pytest.mark.parametrize("converted", [("qwen3", F32)], ids=["qwen3"], indirect=True)
def test_generation_stops_at_eos_and_at_the_chat_templates_end_of_turn(converted):
    _, folder = converted
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [EOS, IM_END]
    assert generation["bos_token_id"] == TOKENS.index("<|im_start|>")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny-qwen3.gguf"
    write_gguf(tiny_model("qwen3"), path, Q8_0)
    return path


def test_a_gguf_path_is_converted_once_then_served_from_the_cache(tiny_gguf, tmp_path, monkeypatch):
    first = resolve_model(str(tiny_gguf), cache_dir=tmp_path, progress=False)
    assert first.path.parent == tmp_path / "models"
    assert (first.name, first.random_weights, first.has_tokenizer) == ("tiny-qwen3", False, True)

    def fail(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(converter, "convert_gguf", fail)
    assert resolve_model(str(tiny_gguf), cache_dir=tmp_path, progress=False) == first


def test_a_changed_gguf_file_is_converted_again(tiny_gguf, tmp_path):
    copy = tmp_path / "tiny-qwen3.gguf"
    copy.write_bytes(tiny_gguf.read_bytes())
    first = resolve_model(str(copy), cache_dir=tmp_path, progress=False)
    copy.write_bytes(tiny_gguf.read_bytes())  # same content, new mtime
    assert resolve_model(str(copy), cache_dir=tmp_path, progress=False).path != first.path


def test_conversion_shows_a_progress_bar_only_when_asked(tiny_gguf, tmp_path, capsys):
    resolve_model(str(tiny_gguf), cache_dir=tmp_path / "quiet", progress=False)
    assert "converting tiny-qwen3.gguf" not in capsys.readouterr().err
    resolve_model(str(tiny_gguf), cache_dir=tmp_path / "loud", progress=True)
    assert "converting tiny-qwen3.gguf" in capsys.readouterr().err


def write_minimal_gguf(path: Path, arch: str, tensor: np.ndarray, qtype) -> None:
    writer = gguf.GGUFWriter(path, arch)
    writer.add_tensor("token_embd.weight", tensor, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def assert_nothing_cached(cache_dir: Path) -> None:
    """A failed conversion leaves neither a folder nor its scratch space behind."""
    assert list((cache_dir / "models").iterdir()) == []


def test_gguf_of_an_unsupported_architecture_is_refused(tmp_path):
    path = tmp_path / "bert.gguf"
    write_minimal_gguf(path, "bert", np.zeros((4, 32), dtype=np.float32), F32)
    with pytest.raises(ModelLoadError, match=r"bert\.gguf: unsupported GGUF architecture 'bert'"):
        resolve_model(str(path), cache_dir=tmp_path, progress=False)
    assert_nothing_cached(tmp_path)


def test_gguf_with_a_tensor_type_that_cannot_be_dequantized_is_refused(tmp_path):
    path = tmp_path / "q8k.gguf"
    q8_k = gguf.GGMLQuantizationType.Q8_K
    type_size = gguf.GGML_QUANT_SIZES[q8_k][1]
    write_minimal_gguf(path, "llama", np.zeros((4, type_size), dtype=np.uint8), q8_k)
    with pytest.raises(ModelLoadError, match=r"q8k\.gguf: tensor token_embd\.weight has type Q8_K"):
        resolve_model(str(path), cache_dir=tmp_path, progress=False)
    assert_nothing_cached(tmp_path)


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "noise.gguf"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(ModelLoadError, match=r"noise\.gguf: not a readable GGUF file"):
        resolve_model(str(path), cache_dir=tmp_path, progress=False)
    assert_nothing_cached(tmp_path)


def test_gguf_tensor_names_agree_with_llama_cpps_tensor_map():
    """Our GGUF -> HF table inverts gguf's own HF -> GGUF map, family by family."""
    for arch, layer_names in converter.LAYER_NAMES_BY_ARCH.items():
        model_arch = gguf.MODEL_ARCH[arch.upper()]
        tensor_map = gguf.get_tensor_name_map(model_arch, 1)
        in_family = {gguf.TENSOR_NAMES[t].format(bid=0) for t in gguf.MODEL_TENSORS[model_arch]}
        for gguf_name, hf_name in layer_names.items():
            if f"blk.0.{gguf_name}" in in_family:
                assert tensor_map.get_name(f"model.layers.0.{hf_name}") == f"blk.0.{gguf_name}"
