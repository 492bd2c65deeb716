// CPU kernels for bf16 inference (AVX512-BF16). A decode step of a small model is bound by
// reading its weights and KV cache and by per-op dispatch: a matrix product on panel-packed
// weights that streams them once per call, single calls for RMSNorm and SiLU gating (which
// PyTorch runs as ~9 and ~4 small ops), causal GQA attention for prompt chunks and for decode
// rows over a paged KV pool's block tables, the decode step's pool writes, and a vectorized
// argmax. Results round like the PyTorch path.
#include <torch/library.h>

#include "kernels.h"

// Every op registers in torch.ops.infer, the namespace of the portable library's ops too,
// each named with a _bf16 suffix (the portable library has its own paged_attention).
// Python reaches them through adapters/torch/cpu/kernels.py: cpu_kernels() maps the short
// names (rms_norm, gemm_packed, ...) to these ops.
TORCH_LIBRARY_FRAGMENT(infer, m) {
  // causal GQA attention of a prompt chunk, one query too
  m.def(
      "prompt_attention_bf16(Tensor q, Tensor k, Tensor v, Tensor lengths, int window, float scale) -> Tensor",
      &prompt_attention);
  // weights [N, K] in gemm_packed's panel layout
  m.def("pack_panels_bf16(Tensor w) -> Tensor", &pack_panels);
  // bf16 matrix product on panel-packed weights (AVX512-BF16)
  m.def("gemm_packed_bf16(Tensor x, Tensor panels, int n_out) -> Tensor", &gemm_packed);
  // bf16 RMSNorm computed in float32
  m.def("rms_norm_bf16(Tensor x, Tensor w, float eps, bool unit_offset) -> Tensor", &rms_norm);
  // bf16 silu(gate) * up, gelu_tanh(gate) * up
  m.def("silu_mul_bf16(Tensor gate_up) -> Tensor", &silu_mul);
  m.def("gelu_tanh_mul_bf16(Tensor gate_up) -> Tensor", &gelu_tanh_mul);
  // sample one token per row: top-k, temperature, top-p, min-p, inverse CDF
  m.def(
      "sample_rows_bf16(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor min_p, "
      "Tensor uniforms) -> Tensor",
      &sample_rows);
  // rotate-half RoPE in one pass (bf16)
  m.def("rope_bf16(Tensor x, Tensor cos, Tensor sin) -> Tensor", &rope);
  // per-row argmax of bf16 logits
  m.def("argmax_rows_bf16(Tensor x) -> Tensor", &argmax_rows);
  // whether decode attention may split a row's keys across threads (off: batch-invariant);
  // returns the old setting
  m.def("set_split_keys_bf16(bool on) -> bool", &set_split_keys);
  // one decode step's writes into a paged KV pool layer
  m.def("write_pool_bf16(Tensor(a!) pool, Tensor src, Tensor index) -> ()", &write_pool);
  // Decode attention over a bf16 paged KV pool read through block tables (the op the portable
  // library's quantized decode layer calls where this build is loaded), and one decoder layer
  // for decode rows over a paged KV pool (the whole bf16 layer the decode stack runs over bf16
  // panel copies of the weights).
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
