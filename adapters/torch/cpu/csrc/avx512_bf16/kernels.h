// The kernels the extension exports (bindings.cpp) and decode_layer composes, one file per
// family: norm_act.cpp (RMSNorm, gated activations, RoPE), attention.cpp (attention, KV pool
// writes), gemm.cpp (panel-packed matrix product), sampling.cpp (argmax, sampling).
#pragma once

#include <torch/extension.h>

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps, bool unit_offset);
torch::Tensor silu_mul(const torch::Tensor& gate_up);
torch::Tensor gelu_tanh_mul(const torch::Tensor& gate_up);
torch::Tensor rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
torch::Tensor prompt_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const torch::Tensor& lengths, int64_t window, double scale);
torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                              const torch::Tensor& tables, const torch::Tensor& lengths, int64_t window,
                              double scale);
// Whether decode attention may split a row's keys across threads (returns the old setting).
bool set_split_keys(bool on);
void write_pool(torch::Tensor& pool, const torch::Tensor& src, const torch::Tensor& index);
torch::Tensor pack_panels(const torch::Tensor& w);
torch::Tensor gemm_packed(const torch::Tensor& x, const torch::Tensor& panels, int64_t n_out);
torch::Tensor argmax_rows(const torch::Tensor& x);
torch::Tensor sample_rows(const torch::Tensor& logits, const torch::Tensor& temperature, const torch::Tensor& top_k,
                          const torch::Tensor& top_p, const torch::Tensor& min_p, const torch::Tensor& uniforms);
torch::Tensor decode_layer_paged(const torch::Tensor& x, const torch::Tensor& w_in, const torch::Tensor& wqkv,
                                 const torch::Tensor& wo, const c10::optional<torch::Tensor>& w_post_attn,
                                 const torch::Tensor& w_mlp, const torch::Tensor& w13, const torch::Tensor& w2,
                                 const c10::optional<torch::Tensor>& w_post_mlp,
                                 const c10::optional<torch::Tensor>& q_norm,
                                 const c10::optional<torch::Tensor>& k_norm, bool unit_offset, bool gelu,
                                 int64_t intermediate, torch::Tensor& k_pool, torch::Tensor& v_pool,
                                 const torch::Tensor& write_index, const torch::Tensor& tables,
                                 const torch::Tensor& lengths, int64_t window, const torch::Tensor& cos,
                                 const torch::Tensor& sin, int64_t n_heads, int64_t n_kv, double scale, double eps);
