"""Build one of our models from an HF-format folder (or random weights for its config).

Checkpoint names map one to one onto ours except the fused projections: q/k/v become
``attn.wqkv`` and gate/up become ``mlp.w13``.
"""

import json
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from adapters.torch.loading.install import install_kernels
from adapters.torch.models.config import ModelConfig
from adapters.torch.models.gemma3 import Gemma3Model
from adapters.torch.models.llama import LlamaModel
from adapters.torch.models.qwen3 import Qwen3Model
from adapters.torch.models.transformer import Transformer
from adapters.torch.quant import FUSED_LINEARS, QUANTIZED_FILE, keep_dense_head, quantize_model
from domain.errors import ModelLoadError

FAMILIES: dict[str, Callable[[ModelConfig], Transformer]] = {
    "llama": LlamaModel,
    "qwen3": Qwen3Model,
    "gemma3": Gemma3Model,
}
_LAYER_KEY = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.+)\.(weight|bias)$")


def load_model(
    folder: Path,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    random_weights: bool = False,
    seed: int = 0,
    prepack: bool = True,
    quantization: str | None = None,
) -> Transformer:
    """Our model for ``folder/config.json`` with its safetensors weights, for inference.

    Its kernels are installed last (:func:`~adapters.torch.loading.install.install_kernels`, the one
    place that does): ``prepack`` adds the fused ones, which for a bf16 CPU model repack the
    linears (faster, but no longer plain parameters: pass False for a model to train or
    inspect) and with ``quantization`` fuse each layer's decode rows into one call; without
    it the layers only get a paged decode attention kernel.
    ``quantization``: ``int8``, ``int4`` or ``gguf`` (see :mod:`adapters.torch.quant`) swaps
    the linears for quantized ones; None keeps them in ``dtype``.
    """
    config = ModelConfig.from_folder(folder)
    family = FAMILIES[config.arch]
    if random_weights:
        torch.manual_seed(seed)
        with torch.device(device):
            model = family(config).to(dtype)
        _init_random(model)
    else:
        with torch.device("meta"), _skipped_init():
            model = family(config)
        state = _fused_state_dict(folder, dtype, device)
        _check_keys(model, state, folder)
        model.load_state_dict(state, strict=False, assign=True)
        if config.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
    model.setup_rope(dtype, device)
    model.eval().requires_grad_(False)
    if quantization is not None:
        if random_weights and quantization == "gguf":
            raise ModelLoadError("gguf quantization needs a GGUF model, not random weights")
        quantize_model(model, quantization, folder=folder)
        keep_dense_head(model, dtype)
    install_kernels(model, fused=prepack)
    return model


@contextmanager
def _skipped_init() -> Iterator[None]:
    """Parameter init is wasted work before loading weights, and on "meta" tensors it runs
    through torch's reference ops, whose first use imports torch._dynamo (~1 s)."""
    names = ("normal_", "uniform_", "kaiming_uniform_")
    saved = {name: getattr(torch.nn.init, name) for name in names}
    for name in names:
        setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def _init_random(model: Transformer) -> None:
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            continue  # keep the identity init (ones, or zeros for Gemma's 1 + w)
        torch.nn.init.normal_(p, std=0.02)


def _fused_state_dict(
    folder: Path, dtype: torch.dtype, device: str | torch.device
) -> dict[str, Tensor]:
    state: dict[str, Tensor] = {}
    parts: dict[tuple[str, int], Tensor] = {}
    for name, tensor in _read_tensors(folder):
        tensor = tensor.to(device=device, dtype=dtype)
        match = _LAYER_KEY.match(name)
        if match is None:
            state[name.removeprefix("model.")] = tensor
            continue
        layer, module, kind = match.groups()
        target, index = FUSED_LINEARS.get(module, (_rename(module), -1))
        key = f"layers.{layer}.{target}.{kind}"
        if index < 0:
            state[key] = tensor
        else:
            parts[(key, index)] = tensor
    for key in {k for k, _ in parts}:
        pieces = [parts[(key, i)] for i in range(3) if (key, i) in parts]
        state[key] = torch.cat(pieces, dim=0)
    return state


def _rename(module: str) -> str:
    return (
        module.replace("self_attn.", "attn.")
        .replace("o_proj", "wo")
        .replace("mlp.down_proj", "mlp.w2")
    )


def _read_tensors(folder: Path) -> Iterator[tuple[str, Tensor]]:
    for path in _weight_files(folder):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ModelLoadError(f"{path}: cannot read safetensors weights ({e})") from e


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise ModelLoadError(f"{index}: invalid shard index ({e})") from e
        files = [folder / name for name in sorted(set(weight_map.values()))]
    else:
        # quantized.safetensors holds a GGUF's blocks, read only by quantize_model
        files = sorted(p for p in folder.glob("*.safetensors") if p.name != QUANTIZED_FILE)
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors weights found")
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise ModelLoadError(f"{missing[0]}: weight shard listed in the index is missing")
    return files


def _check_keys(model: Transformer, state: dict[str, Tensor], folder: Path) -> None:
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    expected = set(shapes)
    if model.config.tie_word_embeddings:
        expected.discard("lm_head.weight")
        state.pop("lm_head.weight", None)
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise ModelLoadError(
            f"{folder}: weights do not match a {model.config.arch} model "
            f"(missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]})"
        )
    for key, tensor in state.items():
        want = shapes[key]
        if tensor.shape != want:
            raise ModelLoadError(
                f"{folder}: tensor {key} has shape {tuple(tensor.shape)}, "
                f"the config needs {tuple(want)}"
            )
