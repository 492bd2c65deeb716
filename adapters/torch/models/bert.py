"""A BERT encoder for sentence embeddings (all-MiniLM-L6-v2 and its family).

Post-norm layers (attention, then an erf-GELU MLP, each added to its input and then
LayerNorm-ed), absolute position and token-type embeddings, a padding mask, and mean pooling
over the real tokens followed by L2 normalization, as sentence-transformers computes them.
Query, key and value are one fused projection (``wqkv``).
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int = 30522
    dim: int = 384
    n_layers: int = 6
    n_heads: int = 12
    intermediate_size: int = 1536
    max_positions: int = 512
    type_vocab_size: int = 2
    norm_eps: float = 1e-12

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "BertConfig":
        return cls(
            vocab_size=hf["vocab_size"],
            dim=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=hf["num_attention_heads"],
            intermediate_size=hf["intermediate_size"],
            max_positions=hf["max_position_embeddings"],
            type_vocab_size=hf.get("type_vocab_size", 2),
            norm_eps=hf.get("layer_norm_eps", 1e-12),
        )

    @classmethod
    def from_folder(cls, folder: Path) -> "BertConfig":
        return cls.from_hf(json.loads((folder / "config.json").read_text()))


class BertEmbeddings(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.word = nn.Embedding(config.vocab_size, config.dim)
        self.position = nn.Embedding(config.max_positions, config.dim)
        self.token_type = nn.Embedding(config.type_vocab_size, config.dim)
        self.norm = nn.LayerNorm(config.dim, eps=config.norm_eps)

    def forward(self, ids: Tensor) -> Tensor:
        """``ids`` ``[B, T]`` -> ``[B, T, D]``; every token is of type 0 (one sentence)."""
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.word(ids) + self.position(positions) + self.token_type.weight[0]
        return self.norm(x)


class BertLayer(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.wqkv = nn.Linear(config.dim, 3 * config.dim)
        self.wo = nn.Linear(config.dim, config.dim)
        self.attn_norm = nn.LayerNorm(config.dim, eps=config.norm_eps)
        self.w1 = nn.Linear(config.dim, config.intermediate_size)
        self.w2 = nn.Linear(config.intermediate_size, config.dim)
        self.mlp_norm = nn.LayerNorm(config.dim, eps=config.norm_eps)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        """``x`` ``[B, T, D]``, ``mask`` ``[B, 1, 1, T]`` (True: a real token) -> ``[B, T, D]``."""
        x = self.attn_norm(x + self.attention(x, mask))
        return self.mlp_norm(x + self.w2(F.gelu(self.w1(x))))

    def attention(self, x: Tensor, mask: Tensor) -> Tensor:
        b, t, d = x.shape
        # [B, T, 3D] -> 3 x [B, H, T, head_dim]
        q, k, v = self.wqkv(x).view(b, t, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(y.transpose(1, 2).reshape(b, t, d))


class BertModel(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.n_layers))

    def forward(self, ids: Tensor, mask: Tensor) -> Tensor:
        """``ids`` ``[B, T]``, ``mask`` ``[B, T]`` bool (False: padding) -> ``[B, T, D]``."""
        x = self.embeddings(ids)
        attn_mask = mask[:, None, None, :]
        for layer in self.layers:
            x = layer(x, attn_mask)
        return x

    def embed(self, ids: Tensor, mask: Tensor) -> Tensor:
        """Unit-length sentence embeddings ``[B, D]``: the mean over real tokens."""
        return F.normalize(mean_pool(self(ids, mask), mask), dim=-1)


def mean_pool(hidden: Tensor, mask: Tensor) -> Tensor:
    """``hidden`` ``[B, T, D]``, ``mask`` ``[B, T]`` -> ``[B, D]``, padding left out."""
    weights = mask.to(hidden.dtype).unsqueeze(-1)
    return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
