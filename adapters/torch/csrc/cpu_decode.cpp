// CPU kernels for the bf16 decode step (AVX512-BF16). A decode step of a small model is
// bound by reading its weights once and by per-op dispatch: a matrix-vector product that
// streams the weights faster than oneDNN's, and single calls for RMSNorm and SiLU-gating,
// which PyTorch runs as ~9 and ~4 small ops. Results round like the PyTorch path.
#include <torch/extension.h>
#include <immintrin.h>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint16_t float_to_bf16(float f) { return c10::BFloat16(f).x; }

inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

const uint16_t* bits(const torch::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
}

uint16_t* bits_mut(torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

void check_bf16(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16 && t.is_contiguous(),
              name, " must be a contiguous bf16 CPU tensor");
}

constexpr int64_t kRows = 16;  // output rows per block: 16 independent accumulators

}  // namespace

// y = x @ w.T for one row: x [in] (any leading dims of size 1), w [out, in], in % 32 == 0.
torch::Tensor gemv(const torch::Tensor& x, const torch::Tensor& w) {
  check_bf16(x, "x");
  check_bf16(w, "w");
  const int64_t out = w.size(0), in = w.size(1);
  TORCH_CHECK(x.numel() == in && in % 32 == 0, "gemv: x must have in = w.size(1) % 32 == 0");
  auto sizes = x.sizes().vec();
  sizes.back() = out;
  auto y = torch::empty(sizes, x.options());
  const uint16_t* W = bits(w);
  const uint16_t* X = bits(x);
  uint16_t* Y = bits_mut(y);
#pragma omp parallel for schedule(static)
  for (int64_t o0 = 0; o0 < out; o0 += kRows) {
    const int64_t rows = std::min(kRows, out - o0);
    __m512 acc[kRows];
    for (int64_t r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t i = 0; i < in; i += 32) {
      const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_loadu_si512(X + i));
      for (int64_t r = 0; r < rows; ++r) {
        const uint16_t* row = W + (o0 + r) * in + i;
        _mm_prefetch(reinterpret_cast<const char*>(row + kRows * in), _MM_HINT_T0);
        const __m512bh wv = reinterpret_cast<__m512bh>(_mm512_loadu_si512(row));
        acc[r] = _mm512_dpbf16_ps(acc[r], wv, xv);
      }
    }
    for (int64_t r = 0; r < rows; ++r) Y[o0 + r] = float_to_bf16(_mm512_reduce_add_ps(acc[r]));
  }
  return y;
}

// RMSNorm of each row of x [..., D] in float32; Gemma's unit_offset multiplies by (1 + w) in
// float32 before rounding, Llama's rounds first and multiplies by w in bf16 (as HF does).
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps, bool unit_offset) {
  check_bf16(x, "x");
  check_bf16(w, "w");
  const int64_t dim = x.size(-1), n = x.numel() / dim;
  auto y = torch::empty_like(x);
  const uint16_t* X = bits(x);
  const uint16_t* Wt = bits(w);
  uint16_t* Y = bits_mut(y);
#pragma omp parallel for schedule(static) if (n > 16)
  for (int64_t row = 0; row < n; ++row) {
    const uint16_t* xr = X + row * dim;
    uint16_t* yr = Y + row * dim;
    float sum = 0.f;
    for (int64_t d = 0; d < dim; ++d) sum += bf16_to_float(xr[d]) * bf16_to_float(xr[d]);
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(dim) + static_cast<float>(eps));
    for (int64_t d = 0; d < dim; ++d) {
      const float h = bf16_to_float(xr[d]) * inv;
      const float wd = bf16_to_float(Wt[d]);
      yr[d] = unit_offset ? float_to_bf16(h * (1.f + wd)) : float_to_bf16(wd * round_bf16(h));
    }
  }
  return y;
}

// silu(gate) * up for gate_up [..., 2I] laid out as [gate | up].
torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  check_bf16(gate_up, "gate_up");
  const int64_t inter = gate_up.size(-1) / 2, n = gate_up.numel() / (2 * inter);
  auto sizes = gate_up.sizes().vec();
  sizes.back() = inter;
  auto y = torch::empty(sizes, gate_up.options());
  const uint16_t* G = bits(gate_up);
  uint16_t* Y = bits_mut(y);
#pragma omp parallel for schedule(static) if (n > 16)
  for (int64_t row = 0; row < n; ++row) {
    for (int64_t i = 0; i < inter; ++i) {
      const float g = bf16_to_float(G[row * 2 * inter + i]);
      const float u = bf16_to_float(G[row * 2 * inter + inter + i]);
      Y[row * inter + i] = float_to_bf16(round_bf16(g / (1.f + std::exp(-g))) * u);
    }
  }
  return y;
}

// Attention of one query per head over a float32 cache, heads grouped per KV head (GQA):
// q [1, H, 1, D] bf16, k and v [1, Hkv, L, D] float32 with contiguous rows -> [1, H, 1, D] bf16.
// One call instead of SDPA plus two dtype conversions.
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               double scale) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kFloat &&
                  v.scalar_type() == at::kFloat && q.size(0) == 1 && q.size(2) == 1,
              "decode_attention: one bf16 query row over a float32 cache");
  const int64_t heads = q.size(1), kv_heads = k.size(1), len = k.size(2), dim = q.size(3);
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1 && k.stride(2) == dim && v.stride(2) == dim &&
                  q.stride(3) == 1 && dim % 16 == 0,
              "decode_attention: rows must be contiguous and head_dim a multiple of 16");
  auto out = torch::empty({1, heads, 1, dim}, q.options());
  const uint16_t* Q = bits(q);
  const float* K = k.data_ptr<float>();
  const float* V = v.data_ptr<float>();
  uint16_t* O = bits_mut(out);
  const int64_t group = heads / kv_heads, q_stride = q.stride(1);
  const int64_t k_stride = k.stride(1), v_stride = v.stride(1);
#pragma omp parallel for schedule(static)
  for (int64_t h = 0; h < heads; ++h) {
    std::vector<float> qf(dim), scores(len), acc(dim, 0.f);
    for (int64_t d = 0; d < dim; ++d) qf[d] = bf16_to_float(Q[h * q_stride + d]);
    const float* kh = K + (h / group) * k_stride;
    const float* vh = V + (h / group) * v_stride;
    float best = -INFINITY;
    for (int64_t l = 0; l < len; ++l) {
      __m512 dot = _mm512_setzero_ps();
      for (int64_t d = 0; d < dim; d += 16)
        dot = _mm512_fmadd_ps(_mm512_loadu_ps(qf.data() + d), _mm512_loadu_ps(kh + l * dim + d), dot);
      scores[l] = _mm512_reduce_add_ps(dot) * static_cast<float>(scale);
      best = std::max(best, scores[l]);
    }
    float total = 0.f;
    for (int64_t l = 0; l < len; ++l) total += (scores[l] = std::exp(scores[l] - best));
    for (int64_t l = 0; l < len; ++l) {
      const __m512 p = _mm512_set1_ps(scores[l] / total);
      for (int64_t d = 0; d < dim; d += 16)
        _mm512_storeu_ps(acc.data() + d, _mm512_fmadd_ps(p, _mm512_loadu_ps(vh + l * dim + d),
                                                          _mm512_loadu_ps(acc.data() + d)));
    }
    for (int64_t d = 0; d < dim; ++d) O[h * dim + d] = float_to_bf16(acc[d]);
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "one-query GQA attention over a float32 cache");
  m.def("gemv", &gemv, "bf16 matrix-vector product (AVX512-BF16)");
  m.def("rms_norm", &rms_norm, "bf16 RMSNorm computed in float32");
  m.def("silu_mul", &silu_mul, "bf16 silu(gate) * up");
}
