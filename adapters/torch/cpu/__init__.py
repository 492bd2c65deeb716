"""CPU inference: compiled kernels (csrc/) and the fused decode path swapped in after loading."""
