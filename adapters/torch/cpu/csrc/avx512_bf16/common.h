// Shared by the CPU kernels (AVX512-BF16): bf16 bit helpers, argument checks, and the
// 16-lane exp / load / round primitives. Compiled with the flags of adapters/torch/cpu/kernels.py.
#pragma once

#include <torch/extension.h>
#include <immintrin.h>
#include <omp.h>
#include <algorithm>
#include <functional>
#include <memory>
#include <cmath>
#include <cstring>
#include <vector>

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint16_t float_to_bf16(float f) { return c10::BFloat16(f).x; }

inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

inline uint32_t float_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  return b;
}

inline const uint16_t* bits(const torch::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
}

inline uint16_t* bits_mut(torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

inline void check_bf16(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16 && t.is_contiguous(),
              name, " must be a contiguous bf16 CPU tensor");
}

// bf16 CPU tensor whose last dimension is contiguous (other dimensions may be strided).
inline void check_bf16_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16 && t.dim() == 4 &&
                  t.stride(3) == 1,
              name, " must be a 4-d bf16 CPU tensor with a contiguous last dimension");
}

// The output of a linear on x [..., in]: [..., out], x's dtype and device.
inline torch::Tensor linear_output(const torch::Tensor& x, int64_t out) {
  auto sizes = x.sizes().vec();
  sizes.back() = out;
  return torch::empty(sizes, x.options());
}

// exp(x) for 16 floats: 2^(x log2 e) split into 2^n * 2^f, f in [-0.5, 0.5], with a degree-6
// polynomial for 2^f (relative error ~1e-7); inputs below -87 flush to 0.
inline __m512 exp512(__m512 x) {
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

// 16 bf16 values -> 16 floats.
inline __m512 load_bf16x16(const uint16_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// 16 floats rounded to the nearest bf16 (ties to even), as floats.
inline __m512 round_bf16x16(__m512 x) {
  const __m256i h = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
