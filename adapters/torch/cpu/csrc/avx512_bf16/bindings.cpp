// CPU kernels for bf16 inference (AVX512-BF16). A decode step of a small model is bound by
// reading its weights and KV cache and by per-op dispatch: a matrix product on panel-packed
// weights that streams them once per call, single calls for RMSNorm and SiLU gating (which
// PyTorch runs as ~9 and ~4 small ops), causal GQA attention for prompt chunks and for decode
// rows over a paged KV pool's block tables, the decode step's pool writes, and a vectorized
// argmax. Results round like the PyTorch path.
#include <torch/library.h>

#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("prompt_attention", &prompt_attention, "causal GQA attention of a prompt chunk, one query too");
  m.def("pack_panels", &pack_panels, "weights [N, K] in gemm_packed's panel layout");
  m.def("gemm_packed", &gemm_packed, "bf16 matrix product on panel-packed weights (AVX512-BF16)");
  m.def("rms_norm", &rms_norm, "bf16 RMSNorm computed in float32");
  m.def("silu_mul", &silu_mul, "bf16 silu(gate) * up");
  m.def("gelu_tanh_mul", &gelu_tanh_mul, "bf16 gelu_tanh(gate) * up");
  m.def("sample_rows", &sample_rows, "sample one token per row: top-k, temperature, top-p, min-p, inverse CDF");
  m.def("rope", &rope, "rotate-half RoPE in one pass (bf16)");
  m.def("argmax_rows", &argmax_rows, "per-row argmax of bf16 logits");
  m.def("paged_attention", &paged_attention, "decode attention over a bf16 paged KV pool, read through block tables");
  m.def("set_split_keys", &set_split_keys,
        "whether decode attention may split a row's keys across threads (off: batch-invariant)");
  m.def("write_pool", &write_pool, "one decode step's writes into a paged KV pool layer");
  m.def("decode_layer_paged", &decode_layer_paged, "one decoder layer for decode rows over a paged KV pool");
}

// The op the portable library's quantized decode layer calls where this build is loaded
// (torch.ops.infer, the namespace of the portable ops too).
// and the whole bf16 layer its decode stack runs over bf16 panel copies of the weights.
TORCH_LIBRARY_FRAGMENT(infer, m) {
  m.def(
      "paged_attention_bf16(Tensor q, Tensor k_pool, Tensor v_pool, Tensor tables, "
      "Tensor lengths, int window, float scale) -> Tensor",
      &paged_attention);
  m.def(
      "decode_layer_paged_bf16(Tensor x, Tensor w_in, Tensor wqkv, Tensor wo, Tensor? w_post_attn, "
      "Tensor w_mlp, Tensor w13, Tensor w2, Tensor? w_post_mlp, Tensor? q_norm, Tensor? k_norm, "
      "bool unit_offset, bool gelu, int intermediate, Tensor(a!) k_pool, Tensor(b!) v_pool, "
      "Tensor write_index, Tensor tables, Tensor lengths, int window, Tensor cos, Tensor sin, "
      "int n_heads, int n_kv, float scale, float eps) -> Tensor",
      &decode_layer_paged);
}
