"""CUDA inference: Triton kernels over the paged KV cache and CUDA-graph decode steps."""
