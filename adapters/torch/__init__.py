"""Torch adapter: our own Llama / Qwen3 / Gemma3 implementations, KV cache, sampler, generate()."""

from adapters.torch.cpu.onednn import bound_onednn_caches

# Before any of this package's code runs a oneDNN product (tuning, loading, serving): the
# caches are sized when first used, and unbounded they grow with every row count a step has.
bound_onednn_caches()
