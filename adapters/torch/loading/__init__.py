"""A model built from its weights (HF folders, GGUF, random for a config) and its kernels
installed."""
