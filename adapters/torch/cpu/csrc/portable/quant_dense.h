// Many rows: the weight dequantized a tile at a time (float32, or bfloat16 where the CPU
// multiplies it natively) and multiplied with at::mm.
// Part of quant_linear.cpp, its only includer (one translation unit: the helpers stay in an
// anonymous namespace).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#if defined(__SSE__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#include <ATen/cpu/Utils.h>

#include "quant_six.h"
#include "quant_weight.h"

namespace {

// Block c's 16 bytes of nibbles in 4-bit row q (inside its super-block for Q4_K's).
inline const uint8_t* nibbles4(const Weight& w, const uint8_t* q, int64_t c) {
  return w.super ? q + (c / 8) * kSuper4Bytes + (c % 8) * 16 : q + c * kBlock / 2;
}

// One dequantized row of W in float32. q * s is exact in float32 (<= 8-bit q times an
// 11-bit float16 significand), so fused or separate multiply-add give the same float.
void dequant_row(const Weight& w, int64_t n, float* scale, float* min, float* out) {
  expand_scales(w, n, scale, min);
  const uint8_t* q = w.row(n);
  if (w.bits == 6) {
    dequant_row6(w, n, scale, min, out);
    return;
  }
  if (w.bits == 8) {  // group % 16 == 0
    const auto* qs = reinterpret_cast<const int8_t*>(q);
    for (int64_t g = 0; g < w.groups; ++g) {
      const float s = scale[g], m = min[g];
      int64_t k = g * w.group;
#if defined(__AVX2__)
      const __m256 sv = _mm256_set1_ps(s), mv = _mm256_set1_ps(m);
      for (; k < (g + 1) * w.group; k += 8) {
        const __m128i q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + k));
        const __m256 qf = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8));
        _mm256_storeu_ps(out + k, _mm256_fmadd_ps(qf, sv, mv));
      }
#endif
      for (; k < (g + 1) * w.group; ++k) out[k] = static_cast<float>(qs[k]) * s + m;
    }
    return;
  }
  for (int64_t c = 0; c < w.k / kBlock; ++c) {  // bits 4: group % 32 == 0, one group a chunk
    const int64_t g = c * kBlock / w.unit();
    const float s = scale[g], m = min[g];
    const uint8_t* b = nibbles4(w, q, c);
    float* o = out + c * kBlock;
#if defined(__AVX2__)
    const __m256 sv = _mm256_set1_ps(s), mv = _mm256_set1_ps(m);
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
    const __m128i nib = _mm_set1_epi8(0x0F);
    const __m128i half[2] = {_mm_and_si128(raw, nib), _mm_and_si128(_mm_srli_epi16(raw, 4), nib)};
    for (int h = 0; h < 2; ++h)  // low nibbles: k 0..15, high: 16..31; 8 k's a store
      for (int e = 0; e < 2; ++e) {
        const __m128i q8 = e == 0 ? half[h] : _mm_srli_si128(half[h], 8);
        const __m256 qf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q8));
        _mm256_storeu_ps(o + h * 16 + e * 8, _mm256_fmadd_ps(qf, sv, mv));
      }
#else
    for (int j = 0; j < kBlock / 2; ++j) {
      o[j] = static_cast<float>(b[j] & 0x0F) * s + m;
      o[j + kBlock / 2] = static_cast<float>(b[j] >> 4) * s + m;
    }
#endif
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// A 4-bit row straight to bfloat16 (each block's 32 values widened, q * s + m, rounded as
// floats_to_bf16 rounds: the same bits as dequant_row then floats_to_bf16, in one pass
// instead of a float32 row written and read again; the dense path's dequantization was
// ~40 % of its time on a 16384 x 2048 weight at 100 rows).
void dequant_row4_bf16(const Weight& w, int64_t n, float* scale, float* min, at::BFloat16* out) {
  expand_scales(w, n, scale, min);
  const uint8_t* q = w.row(n);
  const __m128i nib = _mm_set1_epi8(0x0F);
  for (int64_t c = 0; c < w.k / kBlock; ++c) {
    const int64_t g = c * kBlock / w.unit();
    const __m512 sv = _mm512_set1_ps(scale[g]), mv = _mm512_set1_ps(min[g]);
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(nibbles4(w, q, c)));
    const __m128i half[2] = {_mm_and_si128(raw, nib), _mm_and_si128(_mm_srli_epi16(raw, 4), nib)};
    for (int h = 0; h < 2; ++h) {  // low nibbles: k 0..15, high: 16..31
      const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(half[h])), sv, mv);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c * kBlock + h * 16),
                          _mm512_cvtepi32_epi16(bf16_bits(v)));
    }
  }
}
#endif

#if defined(INFER_FAST_6BIT)
// A 6-bit row straight to bfloat16: per quad the values joined into bytes as the integer
// path joins them (Quad6), each 16 widened, (u - 32) * s + m, rounded as floats_to_bf16
// rounds (the same bits as dequant_row6 then floats_to_bf16).
void dequant_row6_bf16(const Weight& w, int64_t n, float* scale, float* min, at::BFloat16* out) {
  expand_scales(w, n, scale, min);
  const __m512i offset = _mm512_set1_epi32(32);
  for (int64_t q = 0; q < w.k / kQuad6; ++q) {
    const Quad6 u(quad6(w, n, q));
    const auto store = [&](__m128i bytes, int64_t k0) {
      const int64_t g = k0 / kGroup6;
      const __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(bytes), offset));
      const __m512 r = _mm512_fmadd_ps(v, _mm512_set1_ps(scale[g]), _mm512_set1_ps(min[g]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k0), _mm512_cvtepi32_epi16(bf16_bits(r)));
    };
    const int64_t base = q * kQuad6;
    store(_mm512_extracti32x4_epi32(u.lo, 0), base);
    store(_mm512_extracti32x4_epi32(u.hi, 0), base + 16);
    store(_mm512_extracti32x4_epi32(u.lo, 1), base + 32);
    store(_mm512_extracti32x4_epi32(u.hi, 1), base + 48);
    store(_mm512_extracti32x4_epi32(u.lo, 2), base + 64);
    store(_mm512_extracti32x4_epi32(u.hi, 2), base + 80);
    store(_mm512_extracti32x4_epi32(u.lo, 3), base + 96);
    store(_mm512_extracti32x4_epi32(u.hi, 3), base + 112);
  }
}
#endif

// Rows [first, last) of W, dequantized into dst ([last - first, k], T).
template <typename T>
void dequant_rows(const Weight& w, int64_t first, int64_t last, T* dst) {
  std::vector<float> scale(w.k / w.unit()), min(w.k / w.unit()), row(w.k);
  for (int64_t n = first; n < last; ++n) {
    T* out = dst + (n - first) * w.k;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      if (w.bits == 4) {
        dequant_row4_bf16(w, n, scale.data(), min.data(), out);
        continue;
      }
    }
#endif
#if defined(INFER_FAST_6BIT)
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      if (w.bits == 6) {
        dequant_row6_bf16(w, n, scale.data(), min.data(), out);
        continue;
      }
    }
#endif
    if constexpr (std::is_same_v<T, float>) {
      dequant_row(w, n, scale.data(), min.data(), out);
    } else if constexpr (std::is_same_v<T, at::BFloat16>) {
      dequant_row(w, n, scale.data(), min.data(), row.data());
      floats_to_bf16(row.data(), out, w.k);
    } else {  // quant_dequantize's other dtypes
      dequant_row(w, n, scale.data(), min.data(), row.data());
      for (int64_t k = 0; k < w.k; ++k) out[k] = static_cast<T>(row[k]);
    }
  }
}

// y = x @ W.T with W dequantized a tile of rows at a time into T: each thread dequantizes a
// tile (kept in its cache) and multiplies it with at::mm, single-threaded inside the
// parallel region, straight into its columns of y. Worker threads do not inherit the
// caller's autograd / inference-mode state: InferenceMode lets them write into y whichever
// mode made it.
template <typename T>
void dense_tiles(const at::Tensor& x, const Weight& w, at::Tensor& y) {
  const int64_t threads = at::get_num_threads();
  // Tiles of ~1 MiB: at M = 256, 256 KiB ones ran 20-40 % behind F.linear, 1 MiB ones even.
  const int64_t target = std::clamp<int64_t>((1 << 20) / (w.k * sizeof(T)), 16, 1024);
  int64_t tiles = (w.n + target - 1) / target;
  tiles = (tiles + threads - 1) / threads * threads;  // an equal share per thread
  const int64_t tile = (w.n + tiles - 1) / tiles;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    c10::InferenceMode inference;
    at::Tensor buf = at::empty({tile, w.k}, x.options());
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * tile, n1 = std::min(w.n, n0 + tile);
      if (n0 >= n1) break;
      dequant_rows(w, n0, n1, buf.data_ptr<T>());
      at::Tensor cols = y.narrow(1, n0, n1 - n0);
      at::mm_out(cols, x, buf.narrow(0, 0, n1 - n0).t());
    }
  });
}

// Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16, AMX): elsewhere a bfloat16
// GEMM is emulated and several times slower than a float32 one.
bool native_bf16() {
  static const bool has = [] {
    const auto caps = at::cpu::get_cpu_capabilities();
    auto on = [&](const char* key) {
      const auto it = caps.find(key);
      return it != caps.end() && it->second.isBool() && it->second.toBool();
    };
    return on("avx512_bf16") || on("amx_bf16");
  }();
  return has;
}

// The dense path in float32, or in bfloat16 for bfloat16 x where the CPU has it natively.
at::Tensor dense_linear(const at::Tensor& x, const Weight& w) {
  if (x.scalar_type() == at::kBFloat16 && native_bf16()) {
    auto y = at::empty({x.size(0), w.n}, x.options());
    dense_tiles<at::BFloat16>(x, w, y);
    return y;
  }
  const auto xf = x.to(at::kFloat);
  auto y = at::empty({x.size(0), w.n}, xf.options());
  dense_tiles<float>(xf, w, y);
  return y.to(x.scalar_type());
}

}  // namespace
