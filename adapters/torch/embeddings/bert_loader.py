"""A sentence-transformers folder (a BERT checkpoint, its tokenizer, mean pooling) -> our
:class:`BertModel`.

HF's names map onto ours one to one except query / key / value, which become the fused
``wqkv``; the pooler and the stored ``position_ids`` are not used.
"""

import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor

from adapters.torch.loading.loader import _skipped_init
from adapters.torch.models.bert import BertConfig, BertModel
from domain.errors import ModelLoadError

_RENAMES = {
    "embeddings.word_embeddings": "embeddings.word",
    "embeddings.position_embeddings": "embeddings.position",
    "embeddings.token_type_embeddings": "embeddings.token_type",
    "embeddings.LayerNorm": "embeddings.norm",
}
_LAYER_RENAMES = {
    "attention.output.dense": "wo",
    "attention.output.LayerNorm": "attn_norm",
    "intermediate.dense": "w1",
    "output.dense": "w2",
    "output.LayerNorm": "mlp_norm",
}
_QKV = ("query", "key", "value")
_LAYER_KEY = re.compile(r"^encoder\.layer\.(\d+)\.(.+)\.(weight|bias)$")
_UNUSED = re.compile(r"^(pooler\.|embeddings\.position_ids$)")


def load_bert(folder: Path, device: str | torch.device = "cpu") -> BertModel:
    """Our encoder for ``folder/config.json`` with its ``model.safetensors``, in float32."""
    config = BertConfig.from_folder(folder)
    with torch.device("meta"), _skipped_init():
        model = BertModel(config)
    state = _our_names(_read(folder / "model.safetensors"))
    missing = set(model.state_dict()) - set(state)
    if missing:
        raise ModelLoadError(f"{folder}: weights missing: {', '.join(sorted(missing))}")
    model.load_state_dict(state, assign=True)
    return model.to(device=device, dtype=torch.float32).eval()


def max_seq_length(folder: Path, config: BertConfig) -> int:
    """Tokens one input keeps (special tokens included): sentence-transformers'
    ``max_seq_length`` (it truncates longer text), else every position."""
    path = folder / "sentence_bert_config.json"
    if not path.is_file():
        return config.max_positions
    length = json.loads(path.read_text()).get("max_seq_length") or config.max_positions
    return min(int(length), config.max_positions)


def check_mean_pooling(folder: Path) -> None:
    """The folder's sentence-transformers pooling must be the mean (what we compute)."""
    path = folder / "1_Pooling" / "config.json"
    if not path.is_file():
        return
    pooling = json.loads(path.read_text())
    if not pooling.get("pooling_mode_mean_tokens"):
        raise ModelLoadError(f"{path}: only mean pooling is supported")


def _read(path: Path) -> dict[str, Tensor]:
    try:
        return load_file(path)
    except (OSError, SafetensorError) as e:
        raise ModelLoadError(f"{path}: cannot read the weights ({e})") from e


def _our_names(checkpoint: dict[str, Tensor]) -> dict[str, Tensor]:
    state: dict[str, Tensor] = {}
    qkv: dict[tuple[int, str], dict[str, Tensor]] = {}
    for key, tensor in checkpoint.items():
        key = key.removeprefix("bert.")
        if _UNUSED.match(key):
            continue
        if match := _LAYER_KEY.match(key):
            layer, module, kind = int(match[1]), match[2], match[3]
            if module.startswith("attention.self."):
                qkv.setdefault((layer, kind), {})[module.rsplit(".", 1)[1]] = tensor
                continue
            key = f"layers.{layer}.{_LAYER_RENAMES.get(module, module)}.{kind}"
        else:
            module, kind = key.rsplit(".", 1)
            key = f"{_RENAMES.get(module, module)}.{kind}"
        state[key] = tensor
    for (layer, kind), parts in qkv.items():
        if set(parts) != set(_QKV):
            raise ModelLoadError(f"layer {layer}: query, key and value {kind} are not all there")
        state[f"layers.{layer}.wqkv.{kind}"] = torch.cat([parts[name] for name in _QKV])
    return state
