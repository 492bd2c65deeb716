// One decoder layer's decode rows in one call, over quantized weights and the paged KV
// pool, for any CPU: what a Llama / Qwen3 / Gemma 3 block's modules do for R rows of one
// token each (RMSNorm, the fused q/k/v projection, QK-norm, RoPE, the pool write by the
// step's slot mapping, paged attention, the output projection, the gated MLP, residuals),
// without the ~40 Python-level ops a step of a small model spends most of its time on.
// The linears are quant_linear.cpp's, the attention paged_attention.cpp's (same library),
// or for bfloat16 the AVX512-BF16 build's (the op infer::paged_attention_bf16, which that
// library registers in the same namespace) where the caller chose it;
// the small elementwise parts are loops here, rounding as the modules do: in the model's
// dtype T (float32 or bfloat16), norms computed in float32.
// Op: torch.ops.infer.quant_decode_layer.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

#include "quant_weight.h"  // bf16_bits

at::Tensor quant_linear(at::Tensor x, at::Tensor qweight, at::Tensor scales,
                        std::optional<at::Tensor> mins, int64_t bits, int64_t group_size,
                        int64_t dense_from_rows);
at::Tensor paged_attention(at::Tensor q, at::Tensor k_pool, at::Tensor v_pool,
                           at::Tensor tables, at::Tensor lengths, int64_t window, double scale);

namespace {

// The norms' weights, in this order (None where the layer has no such norm).
enum Norm { kInput, kPostAttention, kPreMlp, kPostMlp, kQuery, kKey, kNorms };
// The linears, four entries each: qweight, scales, mins?, bias?.
enum Linear { kQkv, kOut, kUpGate, kDown, kLinears };
// meta: n_heads, n_kv, head_dim, unit_offset, gelu, window, the attention (0: this
// library's paged_attention, 1: infer::paged_attention_bf16), then bits, group size and
// dense_from_rows per linear.
constexpr int64_t kMeta = 7 + 3 * kLinears;

// The AVX512-BF16 library's paged attention (csrc/attention.cpp; bfloat16 only, head_dim a
// multiple of 32; ~3x this library's on a Zen 5 at 64 rows), found through the op registry
// where that library is loaded: the two libraries are built apart (that one needs the ISA,
// this one only a compiler), so neither links the other.
at::Tensor paged_attention_bf16(const at::Tensor& q, const at::Tensor& k_pool,
                                const at::Tensor& v_pool, const at::Tensor& tables,
                                const at::Tensor& lengths, int64_t window, double scale) {
  static const auto op = [] {
    const auto handle = c10::Dispatcher::singleton().findSchema({"infer::paged_attention_bf16", ""});
    TORCH_CHECK(handle.has_value(),
                "quant_decode_layer: infer::paged_attention_bf16 is not registered (the "
                "AVX512-BF16 kernels are not loaded)");
    return handle->typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                    const at::Tensor&, const at::Tensor&, int64_t, double)>();
  }();
  return op.call(q, k_pool, v_pool, tables, lengths, window, scale);
}

struct Layer {
  const std::vector<std::optional<at::Tensor>>& norms;
  const std::vector<std::optional<at::Tensor>>& linears;
  const std::vector<int64_t>& meta;
  float eps;

  at::Tensor linear(const at::Tensor& x, int which) const {
    const auto& qw = linears[4 * which];
    const auto& sc = linears[4 * which + 1];
    TORCH_CHECK(qw && sc, "quant_decode_layer: linear ", which, " has no weights");
    auto y = quant_linear(x, *qw, *sc, linears[4 * which + 2], meta[7 + 3 * which],
                          meta[8 + 3 * which], meta[9 + 3 * which]);
    const auto& bias = linears[4 * which + 3];
    if (bias) y.add_(*bias);
    return y;
  }
};

template <typename T>
inline float fl(T v) {
  return static_cast<float>(v);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// 16 values of T as float32 lanes, and back; round_t: a float32 rounded to T and widened
// again, as static_cast<T> then fl round (bfloat16: to nearest even, NaN to 0x7FC0, as
// c10::BFloat16). The elementwise loops below run 16 at a time on these: scalar bfloat16
// conversions were most of this op's own time at 16 rows.
template <typename T>
inline __m512 load16(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(p);
  } else {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

template <typename T>
inline __m512 round_t(__m512 v) {
  if constexpr (std::is_same_v<T, float>)
    return v;
  else
    return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16));
}

template <typename T>
inline void store16(T* p, __m512 v) {
  if constexpr (std::is_same_v<T, float>)
    _mm512_storeu_ps(p, v);
  else
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(v)));
}

// exp of 16 float32 lanes: 2^n * p(f), n = round(x log2 e), p a degree-6 polynomial of the
// fraction (relative error ~1e-7, as expf); below -87 the result is 0-ish, above +88 inf.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// The gated MLP's activation of 16 gate values in float32: SiLU g / (1 + e^-g), or GELU
// tanh, 0.5 g (1 + tanh(u)) = g / (1 + e^(-2u)) with u = sqrt(2/pi) (g + 0.044715 g^3).
// (Scalar expf per value was ~9 % of a 64-row step's CPU time.)
inline __m512 activate16(__m512 g, bool gelu) {
  __m512 z = g;  // the exponent's argument, negated
  if (gelu) {
    const __m512 g3 = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
    const __m512 u = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f),
                                   _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), g3, g));
    z = _mm512_add_ps(u, u);
  }
  const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), z));
  return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e));
}
#define INFER_VEC16 1
#endif

// out[i] = T(fl(a[i]) + fl(b[i])) (out may be a or b): the residual adds.
template <typename T>
void add_rounded(const T* a, const T* b, T* out, int64_t count) {
  int64_t i = 0;
#if defined(INFER_VEC16)
  for (; i + 16 <= count; i += 16)
    store16(out + i, _mm512_add_ps(load16(a + i), load16(b + i)));
#endif
  for (; i < count; ++i) out[i] = static_cast<T>(fl(a[i]) + fl(b[i]));
}

// out[r] = norm(x[r]) over runs of `dim` values, as RMSNorm.forward: x / rms(x) in float32,
// then w * h in T (Llama) or (h * (1 + w)) in float32 (Gemma's unit offset). `rows` runs.
template <typename T>
void rms_norm(const T* x, const T* w, T* out, int64_t rows, int64_t dim, float eps,
              bool unit_offset) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * dim;
    T* o = out + r * dim;
    float ss = 0.0f;
    for (int64_t d = 0; d < dim; ++d) ss += fl(xr[d]) * fl(xr[d]);
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(dim) + eps);
    if (unit_offset) {
      for (int64_t d = 0; d < dim; ++d) o[d] = static_cast<T>(fl(xr[d]) * inv * (1.0f + fl(w[d])));
    } else {
      int64_t d = 0;
#if defined(INFER_VEC16)
      const __m512 iv = _mm512_set1_ps(inv);
      for (; d + 16 <= dim; d += 16)
        store16(o + d, _mm512_mul_ps(load16(w + d), round_t<T>(_mm512_mul_ps(load16(xr + d), iv))));
#endif
      for (; d < dim; ++d) o[d] = static_cast<T>(fl(w[d]) * fl(static_cast<T>(fl(xr[d]) * inv)));
    }
  }
}

// Rotate-half RoPE in place on one head: x * cos + roll(x, dim / 2) * signed_sin.
template <typename T>
void rope(T* x, const T* cos, const T* sin, int64_t dim, float* tmp) {
  const int64_t half = dim / 2;
  for (int64_t d = 0; d < dim; ++d) tmp[d] = fl(x[d]);
#if defined(INFER_VEC16)
  if (half % 16 == 0) {  // the rolled halves in whole vectors
    for (int64_t d = 0; d < dim; d += 16) {
      const __m512 rolled = _mm512_loadu_ps(tmp + (d + half) % dim);
      const __m512 xc = round_t<T>(_mm512_mul_ps(_mm512_loadu_ps(tmp + d), load16(cos + d)));
      store16(x + d, _mm512_fmadd_ps(rolled, load16(sin + d), xc));
    }
    return;
  }
#endif
  for (int64_t d = 0; d < dim; ++d) {
    const float rolled = tmp[(d + half) % dim];
    x[d] = static_cast<T>(fl(static_cast<T>(tmp[d] * fl(cos[d]))) + rolled * fl(sin[d]));
  }
}

// The gated MLP's activation of g in float32 (GELU tanh or SiLU); activate: rounded to T.
inline float activate_raw(float g, bool gelu) {
  float z = g;  // as activate16: GELU tanh as g / (1 + e^(-2u))
  if (gelu) z = 2.0f * (0.7978845608028654f * (g + 0.044715f * g * g * g));
  return g / (1.0f + std::exp(-z));
}

template <typename T>
inline float activate(float g, bool gelu) {
  return fl(static_cast<T>(activate_raw(g, gelu)));
}

template <typename T>
at::Tensor decode_layer(const at::Tensor& x, const Layer& layer, const at::Tensor& k_pool,
                        const at::Tensor& v_pool, const at::Tensor& write_index,
                        const at::Tensor& tables, const at::Tensor& lengths,
                        const at::Tensor& cos, const at::Tensor& sin, double scale) {
  const auto& meta = layer.meta;
  const int64_t rows = x.size(0), hidden = x.size(1);
  const int64_t heads = meta[0], kv_heads = meta[1], dim = meta[2];
  const bool unit_offset = meta[3] != 0, gelu = meta[4] != 0;
  const int64_t window = meta[5];
  const auto& norms = layer.norms;
  auto weight = [&](int which) -> const T* {
    return norms[which] ? norms[which]->data_ptr<T>() : nullptr;
  };
  auto norm_into = [&](const at::Tensor& in, int which) {
    auto out = at::empty_like(in);
    rms_norm<T>(in.data_ptr<T>(), weight(which), out.data_ptr<T>(), in.numel() / hidden, hidden,
                layer.eps, unit_offset);
    return out;
  };
  const T* xp = x.data_ptr<T>();

  // Attention: q/k/v, QK-norm and RoPE per head, keys and values into the pool.
  at::Tensor qkv = layer.linear(norm_into(x, kInput), kQkv);  // [R, (H + 2 Hkv) D]
  const int64_t width = (heads + 2 * kv_heads) * dim;
  TORCH_CHECK(qkv.size(1) == width, "quant_decode_layer: q/k/v width ", qkv.size(1),
              " is not (heads + 2 kv_heads) * head_dim = ", width);
  T* qkvp = qkv.data_ptr<T>();
  auto q = at::empty({rows, heads, 1, dim}, x.options());
  T* qp = q.data_ptr<T>();
  T* kp = k_pool.data_ptr<T>();
  T* vp = v_pool.data_ptr<T>();
  const int64_t* slots = write_index.data_ptr<int64_t>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  std::vector<float> tmp(dim);
  for (int64_t r = 0; r < rows; ++r) {
    T* row = qkvp + r * width;
    if (norms[kQuery]) rms_norm<T>(row, weight(kQuery), row, heads, dim, layer.eps, unit_offset);
    if (norms[kKey])
      rms_norm<T>(row + heads * dim, weight(kKey), row + heads * dim, kv_heads, dim, layer.eps,
                  unit_offset);
    for (int64_t h = 0; h < heads + kv_heads; ++h)
      rope<T>(row + h * dim, cp + r * dim, sp + r * dim, dim, tmp.data());
    std::copy(row, row + heads * dim, qp + r * heads * dim);
    for (int64_t h = 0; h < kv_heads; ++h) {
      const int64_t slot = slots[r * kv_heads + h];
      std::copy(row + (heads + h) * dim, row + (heads + h + 1) * dim, kp + slot * dim);
      std::copy(row + (heads + kv_heads + h) * dim, row + (heads + kv_heads + h + 1) * dim,
                vp + slot * dim);
    }
  }
  const bool bf16_attention = meta[6] != 0 && std::is_same_v<T, at::BFloat16> && dim % 32 == 0;
  auto attended = bf16_attention
                      ? paged_attention_bf16(q, k_pool, v_pool, tables, lengths, window, scale)
                      : paged_attention(q, k_pool, v_pool, tables, lengths, window, scale);
  at::Tensor out = layer.linear(attended.view({rows, heads * dim}), kOut);  // [R, hidden]
  if (norms[kPostAttention]) out = norm_into(out, kPostAttention);
  T* hp = out.data_ptr<T>();
  add_rounded(xp, hp, hp, rows * hidden);

  // The gated MLP: act(gate) * up, then the down projection.
  at::Tensor gate_up = layer.linear(norm_into(out, kPreMlp), kUpGate);  // [R, 2 I]
  const int64_t inter = gate_up.size(1) / 2;
  auto act = at::empty({rows, inter}, x.options());
  const T* gu = gate_up.data_ptr<T>();
  T* ap = act.data_ptr<T>();
  // rows split over the threads (a row's 2 I values per task at least)
  at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / (2 * inter)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = gu + r * 2 * inter;
      const T* up = g + inter;
      T* a = ap + r * inter;
      int64_t i = 0;
#if defined(INFER_VEC16)
      for (; i + 16 <= inter; i += 16)
        store16(a + i, _mm512_mul_ps(round_t<T>(activate16(load16(g + i), gelu)), load16(up + i)));
#endif
      for (; i < inter; ++i) a[i] = static_cast<T>(activate<T>(fl(g[i]), gelu) * fl(up[i]));
    }
  });
  at::Tensor down = layer.linear(act, kDown);
  if (norms[kPostMlp]) down = norm_into(down, kPostMlp);
  add_rounded(hp, down.data_ptr<T>(), hp, rows * hidden);
  return out;
}

}  // namespace

// x [R, hidden] (float32 or bfloat16, the pools' dtype): R decode rows, one token each.
// norms: kNorms entries (None where absent); linears: 4 per linear (qweight, scales, mins?,
// bias?) for wqkv, wo, w13, w2; meta as above. k_pool, v_pool [blocks, Hkv, block_size, D];
// write_index [R * Hkv] int64 (rows of a pool seen as [-1, D]); tables [R, max_blocks]
// int32; lengths [R] int64; cos, sin [R, D] (the rows' positions). -> [R, hidden].
at::Tensor quant_decode_layer(at::Tensor x, std::vector<std::optional<at::Tensor>> norms,
                              std::vector<std::optional<at::Tensor>> linears,
                              std::vector<int64_t> meta, at::Tensor k_pool, at::Tensor v_pool,
                              at::Tensor write_index, at::Tensor tables, at::Tensor lengths,
                              at::Tensor cos, at::Tensor sin, double scale, double eps) {
  at::NoGradGuard no_grad;
  TORCH_CHECK(norms.size() == kNorms, "quant_decode_layer: ", kNorms, " norms expected");
  TORCH_CHECK(linears.size() == 4 * kLinears, "quant_decode_layer: ", 4 * kLinears,
              " linear entries expected");
  TORCH_CHECK(static_cast<int64_t>(meta.size()) == kMeta, "quant_decode_layer: ", kMeta,
              " meta values expected");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be contiguous [rows, hidden]");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "x must be float32 or bfloat16");
  TORCH_CHECK(k_pool.scalar_type() == dtype && v_pool.scalar_type() == dtype &&
                  cos.scalar_type() == dtype && sin.scalar_type() == dtype,
              "pools and rope tables must be in x's dtype");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous(), "pools must be contiguous");
  const int64_t rows = x.size(0), kv_heads = meta[1], dim = meta[2];
  TORCH_CHECK(k_pool.size(1) == kv_heads && k_pool.size(3) == dim, "pool shape ",
              k_pool.sizes(), " does not match kv_heads ", kv_heads, ", head_dim ", dim);
  TORCH_CHECK(write_index.scalar_type() == at::kLong && write_index.is_contiguous() &&
                  write_index.numel() == rows * kv_heads,
              "write_index must be contiguous int64 [rows * kv_heads]");
  const int64_t pool_rows = k_pool.numel() / dim;
  const int64_t* slots = write_index.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows * kv_heads; ++i)
    TORCH_CHECK(slots[i] >= 0 && slots[i] < pool_rows, "write_index out of the pool");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == rows * dim &&
                  sin.numel() == rows * dim,
              "cos and sin must be contiguous [rows, head_dim]");
  for (const auto& n : norms)
    TORCH_CHECK(!n || (n->scalar_type() == dtype && n->is_contiguous()),
                "norm weights must be contiguous, in x's dtype");
  const Layer layer{norms, linears, meta, static_cast<float>(eps)};
  if (dtype == at::kFloat)
    return decode_layer<float>(x, layer, k_pool, v_pool, write_index, tables, lengths, cos, sin,
                               scale);
  return decode_layer<at::BFloat16>(x, layer, k_pool, v_pool, write_index, tables, lengths, cos,
                                    sin, scale);
}

namespace {

// The AVX512-BF16 library's whole decode layer over bf16 panel copies of the weights
// (csrc/decode_layer.cpp), found through the op registry as paged_attention_bf16 is.
at::Tensor decode_layer_bf16(const at::Tensor& x, const std::vector<std::optional<at::Tensor>>& norms,
                             const std::vector<at::Tensor>& panels, bool unit_offset, bool gelu,
                             int64_t intermediate, at::Tensor& k_pool, at::Tensor& v_pool,
                             const at::Tensor& write_index, const at::Tensor& tables,
                             const at::Tensor& lengths, int64_t window, const at::Tensor& cos,
                             const at::Tensor& sin, int64_t heads, int64_t kv_heads, double scale,
                             double eps) {
  using Opt = const std::optional<at::Tensor>&;
  static const auto op = [] {
    const auto handle =
        c10::Dispatcher::singleton().findSchema({"infer::decode_layer_paged_bf16", ""});
    TORCH_CHECK(handle.has_value(),
                "DecodeStack: infer::decode_layer_paged_bf16 is not registered (the "
                "AVX512-BF16 kernels are not loaded)");
    return handle->typed<at::Tensor(
        const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, Opt,
        const at::Tensor&, const at::Tensor&, const at::Tensor&, Opt, Opt, Opt, bool, bool,
        int64_t, at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&,
        const at::Tensor&, int64_t, const at::Tensor&, const at::Tensor&, int64_t, int64_t,
        double, double)>();
  }();
  return op.call(x, *norms[kInput], panels[0], panels[1], norms[kPostAttention], *norms[kPreMlp],
                 panels[2], panels[3], norms[kPostMlp], norms[kQuery], norms[kKey], unit_offset,
                 gelu, intermediate, k_pool, v_pool, write_index, tables, lengths, window, cos,
                 sin, heads, kv_heads, scale, eps);
}

}  // namespace

// A model's decode layers held once, run in one call per step (torch.classes.infer.
// DecodeStack): each layer as quant_decode_layer with its arguments kept here, or, for steps
// of at least its panels_from rows, the AVX512-BF16 layer over its weights' bf16 panels. A
// step's per-layer Python (the block, the op's argument lists: ~1 ms of a 6.5 ms one-row
// step of SmolLM2-135M) is then paid once. `view`: which of the step's per-view tables,
// lengths and rope tables a layer reads (Gemma 3's sliding and global layers).
struct DecodeStack : torch::CustomClassHolder {
  struct Entry {
    std::vector<std::optional<at::Tensor>> norms, linears;
    std::vector<int64_t> meta;
    at::Tensor k_pool, v_pool;
    int64_t view;
    std::vector<at::Tensor> panels;
    int64_t panels_from, intermediate;
    double scale, eps;
  };
  std::vector<Entry> layers;

  void add(std::vector<std::optional<at::Tensor>> norms, std::vector<std::optional<at::Tensor>> linears,
           std::vector<int64_t> meta, at::Tensor k_pool, at::Tensor v_pool, int64_t view,
           std::vector<at::Tensor> panels, int64_t panels_from, int64_t intermediate, double scale,
           double eps) {
    TORCH_CHECK(panels.empty() || panels.size() == 4, "DecodeStack.add: 4 panels or none");
    TORCH_CHECK(view >= 0, "DecodeStack.add: view >= 0");
    layers.push_back({std::move(norms), std::move(linears), std::move(meta), std::move(k_pool),
                      std::move(v_pool), view, std::move(panels), panels_from, intermediate,
                      scale, eps});
  }

  int64_t size() const { return static_cast<int64_t>(layers.size()); }

  at::Tensor run(at::Tensor x, at::Tensor write_index, std::vector<at::Tensor> tables,
                 std::vector<at::Tensor> lengths, std::vector<at::Tensor> cos,
                 std::vector<at::Tensor> sin) {
    const int64_t rows = x.size(0);
    for (auto& e : layers) {
      TORCH_CHECK(e.view < static_cast<int64_t>(tables.size()) &&
                      e.view < static_cast<int64_t>(lengths.size()) &&
                      e.view < static_cast<int64_t>(cos.size()) &&
                      e.view < static_cast<int64_t>(sin.size()),
                  "DecodeStack.run: no tables, lengths or rope for view ", e.view);
      const auto v = static_cast<size_t>(e.view);
      if (!e.panels.empty() && rows >= e.panels_from) {
        x = decode_layer_bf16(x, e.norms, e.panels, e.meta[3] != 0, e.meta[4] != 0,
                              e.intermediate, e.k_pool, e.v_pool, write_index, tables[v],
                              lengths[v], e.meta[5], cos[v], sin[v], e.meta[0], e.meta[1],
                              e.scale, e.eps);
      } else {
        x = quant_decode_layer(x, e.norms, e.linears, e.meta, e.k_pool, e.v_pool, write_index,
                               tables[v], lengths[v], cos[v], sin[v], e.scale, e.eps);
      }
    }
    return x;
  }
};

TORCH_LIBRARY_FRAGMENT(infer, m) {
  m.def(
      "quant_decode_layer(Tensor x, Tensor?[] norms, Tensor?[] linears, int[] meta, "
      "Tensor k_pool, Tensor v_pool, Tensor write_index, Tensor tables, Tensor lengths, "
      "Tensor cos, Tensor sin, float scale, float eps) -> Tensor",
      &quant_decode_layer);
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<>())
      .def("add", &DecodeStack::add)
      .def("size", &DecodeStack::size)
      .def("run", &DecodeStack::run);
}
