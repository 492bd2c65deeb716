"""Torch adapter: our own Llama / Qwen3 / Gemma3 implementations, KV cache, sampler, generate()."""
