// Row-wise and element-wise kernels: RMSNorm, the gated MLP activations, RoPE.
#include "common.h"
#include "kernels.h"

// RMSNorm of each row of x [..., D] in float32; Gemma's unit_offset multiplies by (1 + w) in
// float32 before rounding, Llama's rounds first and multiplies by w in bf16 (as HF does).
// Vectorized (the sum of squares in 16 lanes): a prompt's norms were ~6% of its prefill.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps, bool unit_offset) {
  check_bf16(x, "x");
  check_bf16(w, "w");
  const int64_t dim = x.size(-1), n = x.numel() / dim;
  auto y = torch::empty_like(x);
  const uint16_t* X = bits(x);
  const uint16_t* Wt = bits(w);
  uint16_t* Y = bits_mut(y);
  const int64_t vec_end = dim / 16 * 16;
#pragma omp parallel for schedule(static) if (n > 16)
  for (int64_t row = 0; row < n; ++row) {
    const uint16_t* xr = X + row * dim;
    uint16_t* yr = Y + row * dim;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t d = 0; d < vec_end; d += 16) {
      const __m512 v = load_bf16x16(xr + d);
      acc = _mm512_fmadd_ps(v, v, acc);
    }
    float sum = _mm512_reduce_add_ps(acc);
    for (int64_t d = vec_end; d < dim; ++d) sum += bf16_to_float(xr[d]) * bf16_to_float(xr[d]);
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(dim) + static_cast<float>(eps));
    const __m512 inv16 = _mm512_set1_ps(inv), one = _mm512_set1_ps(1.f);
    for (int64_t d = 0; d < vec_end; d += 16) {
      const __m512 h = _mm512_mul_ps(load_bf16x16(xr + d), inv16);
      const __m512 wd = load_bf16x16(Wt + d);
      const __m512 out = unit_offset ? _mm512_mul_ps(h, _mm512_add_ps(one, wd))
                                     : _mm512_mul_ps(wd, round_bf16x16(h));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(yr + d),
                          reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(out)));
    }
    for (int64_t d = vec_end; d < dim; ++d) {
      const float h = bf16_to_float(xr[d]) * inv;
      const float wd = bf16_to_float(Wt[d]);
      yr[d] = unit_offset ? float_to_bf16(h * (1.f + wd)) : float_to_bf16(wd * round_bf16(h));
    }
  }
  return y;
}

// The gating activations of a gated MLP, on 16 floats and on one.
enum class Act { kSilu, kGeluTanh };

constexpr float kGeluC = 0.7978845608028654f;  // sqrt(2 / pi)

template <Act A>
inline __m512 act16(__m512 g) {
  const __m512 one = _mm512_set1_ps(1.f);
  if constexpr (A == Act::kSilu) {
    return _mm512_div_ps(g, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
  } else {
    // 0.5 g (1 + tanh(u)) = g - g / (1 + exp(2u)), u = sqrt(2/pi) (g + 0.044715 g^3)
    const __m512 g3 = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
    const __m512 u = _mm512_mul_ps(_mm512_set1_ps(kGeluC), _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), g3, g));
    const __m512 e = exp512(_mm512_min_ps(_mm512_add_ps(u, u), _mm512_set1_ps(88.f)));
    return _mm512_sub_ps(g, _mm512_div_ps(g, _mm512_add_ps(one, e)));
  }
}

template <Act A>
inline float act1(float g) {
  if constexpr (A == Act::kSilu) {
    return g / (1.f + std::exp(-g));
  } else {
    return 0.5f * g * (1.f + std::tanh(kGeluC * (g + 0.044715f * g * g * g)));
  }
}

// act(gate) * up for gate_up [..., 2I] laid out as [gate | up]; the activation rounds to
// bf16 before the product, as PyTorch's two bf16 ops do.
template <Act A>
torch::Tensor gated_act(const torch::Tensor& gate_up) {
  check_bf16(gate_up, "gate_up");
  const int64_t inter = gate_up.size(-1) / 2, n = gate_up.numel() / (2 * inter);
  auto sizes = gate_up.sizes().vec();
  sizes.back() = inter;
  auto y = torch::empty(sizes, gate_up.options());
  const uint16_t* G = bits(gate_up);
  uint16_t* Y = bits_mut(y);
  const int64_t vec_end = inter / 16 * 16;
#pragma omp parallel for schedule(static) if (n > 4)
  for (int64_t row = 0; row < n; ++row) {
    const uint16_t* g_row = G + row * 2 * inter;
    const uint16_t* u_row = g_row + inter;
    uint16_t* y_row = Y + row * inter;
    for (int64_t i = 0; i < vec_end; i += 16) {
      const __m512 prod = _mm512_mul_ps(round_bf16x16(act16<A>(load_bf16x16(g_row + i))), load_bf16x16(u_row + i));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y_row + i),
                          reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(prod)));
    }
    for (int64_t i = vec_end; i < inter; ++i) {
      y_row[i] = float_to_bf16(round_bf16(act1<A>(bf16_to_float(g_row[i]))) * bf16_to_float(u_row[i]));
    }
  }
  return y;
}

torch::Tensor silu_mul(const torch::Tensor& gate_up) { return gated_act<Act::kSilu>(gate_up); }

torch::Tensor gelu_tanh_mul(const torch::Tensor& gate_up) { return gated_act<Act::kGeluTanh>(gate_up); }

// Rotate-half RoPE as the PyTorch ops compute it in bf16 (x * cos rounded, then + roll(x) *
// signed_sin rounded once): x [B, T, H, D] (any strides but a contiguous D), cos and
// signed_sin [B or 1, T, 1, D] (contiguous D). One pass instead of roll (a copy), a multiply
// and an addcmul. Returns a contiguous [B, T, H, D].
torch::Tensor rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && cos.scalar_type() == at::kBFloat16 &&
                  sin.scalar_type() == at::kBFloat16 && x.dim() == 4 && cos.dim() == 4 && sin.dim() == 4 &&
                  x.stride(3) == 1 && cos.stride(3) == 1 && sin.stride(3) == 1 && x.size(3) % 32 == 0 &&
                  cos.sizes() == sin.sizes() && cos.size(1) == x.size(1) && cos.size(3) == x.size(3) &&
                  (cos.size(0) == 1 || cos.size(0) == x.size(0)),
              "rope: bf16 x [B, T, H, D] (D % 32 == 0), cos/sin [B or 1, T, 1, D], contiguous D");
  const int64_t batch = x.size(0), tokens = x.size(1), heads = x.size(2), dim = x.size(3), half = dim / 2;
  auto out = torch::empty({batch, tokens, heads, dim}, x.options());
  const uint16_t* X = bits(x);
  const uint16_t* C = bits(cos);
  const uint16_t* S = bits(sin);
  uint16_t* O = bits_mut(out);
  const int64_t cb = cos.size(0) == 1 ? 0 : cos.stride(0), sb = sin.size(0) == 1 ? 0 : sin.stride(0);
#pragma omp parallel for schedule(static) collapse(2) if (batch * tokens * heads * dim > 65536)
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t t = 0; t < tokens; ++t) {
      const uint16_t* c = C + b * cb + t * cos.stride(1);
      const uint16_t* sn = S + b * sb + t * sin.stride(1);
      for (int64_t h = 0; h < heads; ++h) {
        const uint16_t* xr = X + b * x.stride(0) + t * x.stride(1) + h * x.stride(2);
        uint16_t* o = O + ((b * tokens + t) * heads + h) * dim;
        for (int64_t d = 0; d < dim; d += 16) {
          const int64_t partner = d < half ? d + half : d - half;  // roll by half
          const __m512 xc = round_bf16x16(_mm512_mul_ps(load_bf16x16(xr + d), load_bf16x16(c + d)));
          const __m512 r = _mm512_fmadd_ps(load_bf16x16(xr + partner), load_bf16x16(sn + d), xc);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + d), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(r)));
        }
      }
    }
  return out;
}
