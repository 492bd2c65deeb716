"""GGUF -> HF folder conversion, checked by round trips through tiny random transformers models.

Each tiny model is written to GGUF the way llama.cpp's convert_hf_to_gguf does (its tensor
names, permuted llama q/k, Gemma norms as 1 + w, Llama 3 rope scaling as rope_freqs) and
converted back; the result must hold the original tensors and give the original logits.
"""

import json
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
    PreTrainedModel,
)

import adapters.weights.gguf as converter
from adapters.weights import resolve_model
from domain.errors import ModelLoadError
from tests.support.gguf_files import EOS, IM_END, TINY_CONFIGS, TOKENS, tiny_model, write_gguf

INPUT_IDS = torch.tensor([[1, 70, 256, 258, 33, 90, 100, 7, 258, 44, 12, 200]])


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
