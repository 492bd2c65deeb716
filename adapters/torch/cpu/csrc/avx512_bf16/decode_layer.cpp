// One decoder layer for decode rows, composed of the other kernels.
#include "common.h"
#include "kernels.h"

namespace {

// The layer around its attention: `attend(q [R, H, 1, D], k, v [R, Hkv, 1, D])` writes the
// rows' keys and values to the cache and returns their attention [R, H, 1, D].
template <class Attend>
torch::Tensor layer_around(const torch::Tensor& x, const torch::Tensor& w_in, const torch::Tensor& wqkv,
                           const torch::Tensor& wo, const c10::optional<torch::Tensor>& w_post_attn,
                           const torch::Tensor& w_mlp, const torch::Tensor& w13, const torch::Tensor& w2,
                           const c10::optional<torch::Tensor>& w_post_mlp,
                           const c10::optional<torch::Tensor>& q_norm, const c10::optional<torch::Tensor>& k_norm,
                           bool unit_offset, bool gelu, int64_t intermediate, int64_t head_dim,
                           const torch::Tensor& cos, const torch::Tensor& sin, int64_t n_heads, int64_t n_kv,
                           double eps, const Attend& attend) {
  const int64_t rows = x.size(0), hidden = x.size(1);
  TORCH_CHECK(x.dim() == 2 && q_norm.has_value() == k_norm.has_value(),
              "decode_layer: x [R, hidden], both QK norms or none");
  const auto qkv = gemm_packed(rms_norm(x, w_in, eps, unit_offset), wqkv, (n_heads + 2 * n_kv) * head_dim)
                       .view({rows, 1, n_heads + 2 * n_kv, head_dim});
  auto qk = qkv.narrow(2, 0, n_heads + n_kv);
  if (q_norm.has_value()) {
    qk = torch::cat({rms_norm(qk.narrow(2, 0, n_heads).contiguous(), *q_norm, eps, unit_offset),
                     rms_norm(qk.narrow(2, n_heads, n_kv).contiguous(), *k_norm, eps, unit_offset)},
                    2);
  }
  const auto rotated =
      rope(qk, cos.reshape({rows, 1, 1, head_dim}), sin.reshape({rows, 1, 1, head_dim})).transpose(1, 2);
  const auto y = attend(rotated.narrow(1, 0, n_heads), rotated.narrow(1, n_heads, n_kv),
                        qkv.narrow(2, n_heads + n_kv, n_kv).transpose(1, 2));
  auto attn = gemm_packed(y.transpose(1, 2).reshape({rows, n_heads * head_dim}), wo, hidden);
  if (w_post_attn.has_value()) attn = rms_norm(attn, *w_post_attn, eps, unit_offset);
  const auto h = x + attn;
  const auto gate_up = gemm_packed(rms_norm(h, w_mlp, eps, unit_offset), w13, 2 * intermediate);
  auto mlp = gemm_packed(gelu ? gelu_tanh_mul(gate_up) : silu_mul(gate_up), w2, hidden);
  if (w_post_mlp.has_value()) mlp = rms_norm(mlp, *w_post_mlp, eps, unit_offset);
  return h + mlp;
}

}  // namespace

// One decoder layer for R decode rows, each one new token: x [R, hidden]. Llama / Qwen3:
// h = x + attn(norm_in(x)), out = h + mlp(norm_mlp(h)); Gemma 3 also normalizes the attention
// and MLP outputs (post_attn, post_mlp) and uses (1 + w) norms (unit_offset) and tanh-GELU.
// Optional per-head QK-norm (q_norm, k_norm) before RoPE. No biases. Over one layer of a
// paged KV pool (k_pool, v_pool [blocks, Hkv, block_size, D]): row r's key and value heads go
// to rows write_index[r * Hkv + h] of the pool seen as [-1, D], and it attends to its keys
// < lengths[r] (within `window`, 0 = all) through its block table (tables [R, max_blocks]
// int32), as the modules' path does with paged_attention; cos, sin [R, 1, 1, D] at the rows'
// positions. The modules' kernels in their order, so the result is identical: one call
// instead of ~40-50 Python-level ops (~1.5 ms of a ~8 ms single-row step).
torch::Tensor decode_layer_paged(const torch::Tensor& x, const torch::Tensor& w_in, const torch::Tensor& wqkv,
                                 const torch::Tensor& wo, const c10::optional<torch::Tensor>& w_post_attn,
                                 const torch::Tensor& w_mlp, const torch::Tensor& w13, const torch::Tensor& w2,
                                 const c10::optional<torch::Tensor>& w_post_mlp,
                                 const c10::optional<torch::Tensor>& q_norm,
                                 const c10::optional<torch::Tensor>& k_norm, bool unit_offset, bool gelu,
                                 int64_t intermediate, torch::Tensor& k_pool, torch::Tensor& v_pool,
                                 const torch::Tensor& write_index, const torch::Tensor& tables,
                                 const torch::Tensor& lengths, int64_t window, const torch::Tensor& cos,
                                 const torch::Tensor& sin, int64_t n_heads, int64_t n_kv, double scale, double eps) {
  TORCH_CHECK(k_pool.dim() == 4, "decode_layer_paged: pools [blocks, Hkv, block_size, D]");
  return layer_around(x, w_in, wqkv, wo, w_post_attn, w_mlp, w13, w2, w_post_mlp, q_norm, k_norm, unit_offset, gelu,
                      intermediate, k_pool.size(3), cos, sin, n_heads, n_kv, eps,
                      [&](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
                        write_pool(k_pool, k, write_index);
                        write_pool(v_pool, v, write_index);
                        return paged_attention(q, k_pool, v_pool, tables, lengths, window, scale);
                      });
}
