// The activations quantized per block of 32 for the integer path, and laid out as its
// pair / quad dot products read them.
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

#include "quant_weight.h"

namespace {

// The activations quantized per block of 32 to Q (int8 or int16): q = round(x / dx),
// dx = max|x| / Q's max, dx repeated for each of a block's S weight-scale slots (S = 2 when
// a scale covers 16 k's); and per weight group, sum(dx * q) over the group (what a group's
// min multiplies).
template <typename Q>
struct Acts {
  std::vector<Q> q;        // [m, k]
  std::vector<float> d;    // [m, k / 32 * S]
  std::vector<float> sum;  // [m, groups]
};

#if defined(__AVX2__) && defined(__F16C__)
// 8 values of x as floats (exactly: float32, bfloat16 and float16 all widen exactly).
template <typename T>
inline __m256 load8(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(p);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
  } else {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
}

// One block of 32 values to int8 as the scalar loop of quantize_acts does it (the same
// float operations: max |x|, d = max / 127, q = round-to-nearest-even(x * (1 / d)) clamped),
// returning d; sums[h] = the sum of q over k 16 h .. 16 h + 15.
template <typename T>
inline float quantize_block_int8(const T* x, int8_t* q, int32_t* sums) {
  __m256 v[4];
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = load8(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  const float d = _mm_cvtss_f32(m) / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
  const __m256 scale = _mm256_set1_ps(id), hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
  __m256i qi[4];
  for (int i = 0; i < 4; ++i)  // round (the current mode: to nearest even), then the clamp
    qi[i] = _mm256_cvtps_epi32(_mm256_max_ps(lo, _mm256_min_ps(hi, _mm256_round_ps(
        _mm256_mul_ps(v[i], scale), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))));
  for (int h = 0; h < 2; ++h) {
    const __m256i t = _mm256_add_epi32(qi[2 * h], qi[2 * h + 1]);
    __m128i u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
    u = _mm_hadd_epi32(u, u);
    sums[h] = _mm_cvtsi128_si32(_mm_hadd_epi32(u, u));
  }
  // int32 -> int8 in order: packs interleave the 128-bit lanes, one permute restores them
  const __m256i p16 = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(p16, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  return d;
}
#endif

template <typename Q, typename T>
Acts<Q> quantize_acts(const T* x, int64_t rows, int64_t k, int64_t group, int S) {
  const int64_t blocks = k / kBlock, halves = k / 16, groups = k / group;
  constexpr float qmax = std::numeric_limits<Q>::max();
  Acts<Q> a{std::vector<Q>(rows * k), std::vector<float>(rows * blocks * S),
            std::vector<float>(rows * groups, 0.0f)};
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> half_sum(halves);  // sum(dx * q) per 16 k's: group may be 16
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t b = 0; b < blocks; ++b) {
#if defined(__AVX2__) && defined(__F16C__)
        if constexpr (std::is_same_v<Q, int8_t>) {
          int32_t s[2];
          const float d = quantize_block_int8(x + r * k + b * kBlock, a.q.data() + r * k + b * kBlock, s);
          for (int i = 0; i < S; ++i) a.d[(r * blocks + b) * S + i] = d;
          half_sum[2 * b] = d * static_cast<float>(s[0]);
          half_sum[2 * b + 1] = d * static_cast<float>(s[1]);
          continue;
        }
#endif
        float v[kBlock];
        float amax = 0.0f;
        for (int j = 0; j < kBlock; ++j) {
          v[j] = static_cast<float>(x[r * k + b * kBlock + j]);
          amax = std::max(amax, std::fabs(v[j]));
        }
        const float d = amax / qmax, id = d > 0.0f ? 1.0f / d : 0.0f;
        Q* q = a.q.data() + r * k + b * kBlock;
        int32_t s[2] = {0, 0};
        for (int j = 0; j < kBlock; ++j) {  // |v * id| <= qmax up to rounding: clamp it
          q[j] = static_cast<Q>(std::clamp(std::nearbyint(v[j] * id), -qmax, qmax));
          s[j / 16] += q[j];
        }
        for (int i = 0; i < S; ++i) a.d[(r * blocks + b) * S + i] = d;
        half_sum[2 * b] = d * static_cast<float>(s[0]);
        half_sum[2 * b + 1] = d * static_cast<float>(s[1]);
      }
      float* sum = a.sum.data() + r * groups;
      for (int64_t h = 0; h < halves; ++h) sum[h * 16 / group] += half_sum[h];
    }
  });
  return a;
}

// Quantized activation rows ([rows, k]) laid out for pair_fma, row r at r * k: per pair of
// blocks, the two blocks' k 0..15, then their k 16..31 (an odd last block is left out:
// block_fma takes it). With AVX-512 the whole quads of blocks come first for quad_fma, per
// quad the four blocks' k 0..15 then their k 16..31; block b's bytes start at 32 b either way.
// With tail_quad (AVX-512, rows_dot_4bit) the last 1-3 blocks are laid out as a quad too,
// zeros for the missing blocks: rows are then stride >= k + 96 bytes apart.
std::vector<int8_t> pair_layout(const int8_t* xs, int64_t rows, int64_t k, int64_t stride,
                                bool tail_quad) {
  const int64_t blocks = k / kBlock, pairs = blocks / 2;
  std::vector<int8_t> all(rows * stride);  // zeros
  for (int64_t r = 0; r < rows; ++r) {
    const int8_t* x = xs + r * k;
    int8_t* out = all.data() + r * stride;
    int64_t p = 0;
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    for (; p * 2 < blocks && (p + 2 <= pairs || tail_quad); p += 2) {
      int8_t* o = out + p * 2 * kBlock;
      for (int j = 0; j < 4 && p * 2 + j < blocks; ++j) {
        const int8_t* blk = x + (p * 2 + j) * kBlock;
        std::copy(blk, blk + 16, o + 16 * j);
        std::copy(blk + 16, blk + 32, o + 64 + 16 * j);
      }
    }
#endif
    for (; p < pairs; ++p) {
      const int8_t* a = x + 2 * p * kBlock;
      const int8_t* b = a + kBlock;
      int8_t* o = out + p * 2 * kBlock;
      std::copy(a, a + 16, o);
      std::copy(b, b + 16, o + 16);
      std::copy(a + 16, a + 32, o + 32);
      std::copy(b + 16, b + 32, o + 48);
    }
  }
  return all;
}

}  // namespace
