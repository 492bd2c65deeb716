"""load_model: HF folders (single, sharded), random weights for real configs, bad input."""

from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from adapters.torch.cpu.fused_decode import PackedLinear
from adapters.torch.loading.loader import load_model
from adapters.weights import resolve_model
from domain.errors import ModelLoadError
from tests.support.tiny_models import save_tiny_model

IDS = torch.tensor([[3, 14, 15, 92, 65, 35]])


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("llama")
    save_tiny_model("llama", folder)
    return folder


def test_a_sharded_folder_loads_the_same_weights(llama_folder: Path, tmp_path: Path) -> None:
    reference = save_tiny_model("llama", tmp_path)
    reference.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    sharded = load_model(tmp_path, dtype=torch.float32)
    single = load_model(llama_folder, dtype=torch.float32)
    assert_close(sharded(IDS), single(IDS))


def test_bf16_cpu_inference_models_use_prepacked_linears(llama_folder: Path) -> None:
    packed = load_model(llama_folder, dtype=torch.bfloat16)
    plain = load_model(llama_folder, dtype=torch.bfloat16, prepack=False)
    if not any(isinstance(m, PackedLinear) for m in packed.modules()):
        pytest.skip("this CPU has no oneDNN bf16 support")
    # Within bf16 rounding: a short input may take the small-batch kernel, which sums in
    # another order than F.linear.
    assert_close(packed(IDS), plain(IDS), atol=0.05, rtol=0.02)


@pytest.mark.parametrize("name", ["SmolLM2-135M", "Qwen3-0.6B"])
def test_dummy_weights_build_a_real_size_model(name: str, tmp_path: Path) -> None:
    resolved = resolve_model(f"dummy:{name}", cache_dir=tmp_path, progress=False)
    model = load_model(resolved.path, dtype=torch.bfloat16, random_weights=True)
    logits = model(IDS)
    assert logits.shape == (1, IDS.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()


def test_a_truncated_safetensors_file_is_named_in_the_error(llama_folder: Path, tmp_path) -> None:
    for f in llama_folder.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors"):
        load_model(tmp_path, dtype=torch.float32)


def test_an_unknown_architecture_is_named_in_the_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "mamba", "hidden_size": 8}')
    with pytest.raises(ModelLoadError, match=r"config.json: unsupported architecture 'mamba'"):
        load_model(tmp_path)


def test_a_missing_config_is_named_in_the_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"missing config\.json"):
        load_model(tmp_path)


def test_weights_of_another_shape_are_refused(llama_folder: Path, tmp_path: Path) -> None:
    save_tiny_model("qwen3", tmp_path)
    (tmp_path / "config.json").write_text((llama_folder / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="do not match"):
        load_model(tmp_path, dtype=torch.float32)
