"""Llama 3.x (and SmolLM2, which is a Llama): pre-norm blocks, SiLU-gated MLP."""

import torch.nn.functional as F
from torch import Tensor

from adapters.torch.models.config import ModelConfig
from adapters.torch.models.layers import Attention, AttnMask, Cache, GatedMLP, RMSNorm
from adapters.torch.models.transformer import Block, Transformer


class LlamaBlock(Block):
    """``h = x + attn(norm(x)); out = h + mlp(norm(h))``. HF calls the second norm
    ``post_attention_layernorm``; we keep its name so checkpoints map one to one."""

    def __init__(self, config: ModelConfig, layer: int, *, qk_norm: bool = False) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.attn = Attention(config, layer, qk_norm=qk_norm, unit_offset=False)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, F.silu)

    def forward_modules(
        self, x: Tensor, rope: tuple[Tensor, Tensor], mask: AttnMask, cache: Cache | None
    ) -> Tensor:
        h = x + self.attn(self.input_layernorm(x), rope, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(Transformer):
    def __init__(self, config: ModelConfig) -> None:
        blocks: list[Block] = [LlamaBlock(config, i) for i in range(config.num_layers)]
        super().__init__(config, blocks, unit_offset=False)
