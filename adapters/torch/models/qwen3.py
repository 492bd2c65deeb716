"""Qwen3: the Llama block with RMSNorm on each query and key head before RoPE (QK-norm)."""

from adapters.torch.models.config import ModelConfig
from adapters.torch.models.llama import LlamaBlock
from adapters.torch.models.transformer import Block, Transformer


class Qwen3Model(Transformer):
    def __init__(self, config: ModelConfig) -> None:
        blocks: list[Block] = [
            LlamaBlock(config, i, qk_norm=True) for i in range(config.num_layers)
        ]
        super().__init__(config, blocks, unit_offset=False)
