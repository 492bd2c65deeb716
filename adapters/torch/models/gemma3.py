"""Gemma 3 text: ``(1 + w)`` RMSNorms before and after attention and MLP, QK-norm,
sliding-window local layers with their own rope base, ``query_pre_attn_scalar``, embeddings
scaled by ``sqrt(hidden)``, tanh-GELU MLP, tied embeddings."""

import torch
from torch import Tensor

from adapters.torch.models.config import ModelConfig
from adapters.torch.models.layers import (
    Attention,
    AttnMask,
    Cache,
    GatedMLP,
    RMSNorm,
    gelu_tanh,
)
from adapters.torch.models.transformer import Block, Transformer


class Gemma3Block(Block):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        dim, eps = config.hidden_size, config.rms_norm_eps
        self.sliding = config.is_sliding(layer)
        self.input_layernorm = RMSNorm(dim, eps, unit_offset=True)
        self.attn = Attention(config, layer, qk_norm=True, unit_offset=True)
        self.post_attention_layernorm = RMSNorm(dim, eps, unit_offset=True)
        self.pre_feedforward_layernorm = RMSNorm(dim, eps, unit_offset=True)
        self.mlp = GatedMLP(dim, config.intermediate_size, gelu_tanh)
        self.post_feedforward_layernorm = RMSNorm(dim, eps, unit_offset=True)

    def forward_modules(
        self, x: Tensor, rope: tuple[Tensor, Tensor], mask: AttnMask, cache: Cache | None
    ) -> Tensor:
        h = x + self.post_attention_layernorm(self.attn(self.input_layernorm(x), rope, mask, cache))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Gemma3Model(Transformer):
    def __init__(self, config: ModelConfig) -> None:
        blocks: list[Block] = [Gemma3Block(config, i) for i in range(config.num_layers)]
        super().__init__(config, blocks, unit_offset=True)

    def embed(self, input_ids: Tensor) -> Tensor:
        x = self.embed_tokens(input_ids)
        # HF rounds the scale to the activation dtype before multiplying.
        return x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)

    def logits(self, x: Tensor) -> Tensor:
        logits = self.lm_head(x)
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits
