"""CPU inference: compiled kernels (csrc/avx512_bf16/, csrc/portable/) and the fused decode path
swapped in after loading."""
