// 6-bit weights (GGUF Q6_K's values kept in 6 bits instead of widened to int8): the format,
// its integer dot products for few rows and its dequantized rows for the dense path.
//
// Format (bits 6): group_size 16, K a multiple of 128. Each run of 128 k's (a quad: four
// blocks of 32) is 96 bytes: first the 64 bytes a 4-bit weight keeps for those k's (byte
// 16 j + i of block j holds k i in its low nibble and k 16 + i in its high one), then 32
// bytes of the values' top two bits: byte i (i < 16) holds, in bits 2 j and 2 j + 1, the top
// bits of block j's k i, byte 16 + i those of its k 16 + i. The value u (0..63) stands for
// W[n, k] = (u - 32) * scale[n, k / 16] (+ min[n, k / 16]): Q6_K's q exactly, and a 4-bit
// weight's q + 32 when a fused projection mixes the two (its scale and min repeated for each
// 16 k's).
//
// The products: x quantized to int8 per block of 32 as for 4-bit weights; per quad, the
// values' nibbles and top bits joined into bytes (one broadcast, shift and mask per half),
// one vpdpbusd per half (k 0..15 and 16..31 of the four blocks: one scale each), and the
// -32 offset and any min folded into one float term per 16 k's, (min - 32 scale) times the
// activations' sum dx * sum(q) over those k's. 9 bits a weight as int8 with a float16 scale
// per 16; 7 here (the file's Q6_K: 6.56).
// Part of quant_linear.cpp, its only includer (one translation unit: the helpers stay in an
// anonymous namespace).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#if defined(__SSE__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <vector>

#include "quant_acts.h"
#include "quant_int.h"
#include "quant_weight.h"

namespace {

constexpr int64_t kQuad6 = 128;       // k's in a 6-bit quad
constexpr int64_t kQuad6Bytes = 96;   // its bytes
constexpr int64_t kGroup6 = 16;       // k's a 6-bit scale covers

// Quad q (k's 128 q ..) of row n: 96 bytes, within its super-block's 208 for Q6_K's.
inline const uint8_t* quad6(const Weight& w, int64_t n, int64_t q) {
  return w.super ? w.row(n) + (q / 2) * kSuper6Bytes + (q % 2) * kQuad6Bytes
                 : w.row(n) + q * kQuad6Bytes;
}

// Value u (0..63) of element k of row n.
inline int six_bit(const Weight& w, int64_t n, int64_t k) {
  const uint8_t* q = quad6(w, n, k / kQuad6);
  const int64_t j = (k % kQuad6) / kBlock, i = k % kBlock;
  const uint8_t byte = q[16 * j + i % 16];
  const int nib = i < 16 ? (byte & 0x0F) : (byte >> 4);
  const int top = (q[64 + (i < 16 ? 0 : 16) + i % 16] >> (2 * j)) & 0x03;
  return nib | (top << 4);
}

// Row n of a 6-bit weight dequantized in float32 (scale and min per 16 k's, expand_scales).
inline void dequant_row6(const Weight& w, int64_t n, const float* scale, const float* min,
                         float* out) {
  for (int64_t q = 0; q < w.k / kQuad6; ++q) {
    const uint8_t* nib = quad6(w, n, q);
    const uint8_t* top = nib + 64;
    for (int j = 0; j < 4; ++j)
      for (int i = 0; i < 16; ++i) {
        const int lo = (nib[16 * j + i] & 0x0F) | (((top[i] >> (2 * j)) & 0x03) << 4);
        const int hi = (nib[16 * j + i] >> 4) | (((top[16 + i] >> (2 * j)) & 0x03) << 4);
        const int64_t k0 = q * kQuad6 + j * kBlock + i, g0 = k0 / kGroup6, g1 = g0 + 1;
        out[k0] = static_cast<float>(lo - 32) * scale[g0] + min[g0];
        out[k0 + 16] = static_cast<float>(hi - 32) * scale[g1] + min[g1];
      }
  }
}

#if defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__)
#define INFER_FAST_6BIT 1  // rows_dot_6bit exists: the loader keeps Q6_K in 6 bits

// A quad's 128 values as bytes: lo = the four blocks' k 0..15 (block j in 128-bit lane j),
// hi = their k 16..31, as pair_layout lays the activations out.
struct Quad6 {
  __m512i lo, hi;
  explicit Quad6(const uint8_t* w) {
    const __m512i raw = _mm512_loadu_si512(w);
    const __m512i nib = _mm512_set1_epi8(0x0F), three = _mm512_set1_epi8(0x03);
    // lane j shifts its copy of the top bytes right by 2 j (16-bit shifts: the mask keeps
    // each byte's own two bits)
    const __m512i shift = _mm512_set_epi32(0x60006, 0x60006, 0x60006, 0x60006, 0x40004, 0x40004,
                                           0x40004, 0x40004, 0x20002, 0x20002, 0x20002, 0x20002,
                                           0, 0, 0, 0);
    const auto top = [&](int64_t at) {
      const __m512i t = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + at)));
      return _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(t, shift), three), 4);
    };
    lo = _mm512_or_si512(_mm512_and_si512(raw, nib), top(64));
    hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(raw, 4), nib), top(80));
  }
};

// u (0..63) x int8 x, summed four products a lane (vpdpbusd, or maddubs: |pair| <= 16002).
inline __m512 dot6(__m512i u, const int8_t* x) {
  const __m512i xv = _mm512_loadu_si512(x);
#if defined(__AVX512VNNI__)
  return _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u, xv));
#else
  return _mm512_cvtepi32_ps(_mm512_madd_epi16(_mm512_maddubs_epi16(u, xv), _mm512_set1_epi16(1)));
#endif
}

// 6-bit weight rows n0 .. n1 - 1 against R activation rows (pair_layout's quads, dx per
// block and xs per 16 k's, compact: spread over the lanes in registers, each half's xs into
// the first lane of its block's four): y[r * n + row] in T. Every row goes through the same
// operations in the same order for any R.
// kSuper: Q6_K's super-blocks, each quad's 8 scales its int8 ones times the float16 d.
template <int R, typename T, bool kMins, bool kSuper = false>
inline void rows_dot_6bit(const Weight& wt, int64_t n0, int64_t n1, const RowActs& a, T* y) {
  static_assert(R >= 1 && R <= 4, "the horizontal sums take four rows at a time");
  const int64_t blocks = a.blocks, quads = blocks / 4;
  const __m512i even = _mm512_set_epi32(6, 6, 6, 6, 4, 4, 4, 4, 2, 2, 2, 2, 0, 0, 0, 0);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const __m512 minus32 = _mm512_set1_ps(-32.0f);
  for (int64_t row = n0; row < n1; ++row) {
    prefetch_row(wt, row + kPrefetchRows);
    const uint8_t* w = wt.row(row);
    const at::Half* scales = wt.scales + row * wt.groups;
    const at::Half* mins = kMins ? wt.mins + row * wt.groups : nullptr;
    __m512 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t q = 0; q < quads; ++q) {
      const uint8_t* wq = kSuper ? w + (q / 2) * kSuper6Bytes + (q % 2) * kQuad6Bytes
                                 : w + q * kQuad6Bytes;
      __m512 s8;
      if constexpr (kSuper) {
        const __m128i sub = _mm_loadl_epi64(
            reinterpret_cast<const __m128i*>(w + (q / 2) * kSuper6Bytes + 192 + (q % 2) * 8));
        s8 = _mm512_castps256_ps512(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sub)),
                                                  _mm256_set1_ps(_cvtsh_ss(scales[q / 2].x))));
      } else {
        s8 = halves8(scales + 8 * q);
      }
      const __m512 s_lo = _mm512_permutexvar_ps(even, s8), s_hi = _mm512_permutexvar_ps(odd, s8);
      // min - 32 scale per 16 k's (32 scale is exact: one rounding, as a separate add's)
      __m512 c_lo = _mm512_mul_ps(minus32, s_lo), c_hi = _mm512_mul_ps(minus32, s_hi);
      if constexpr (kMins) {
        const __m512 m8 = halves8(mins + 8 * q);
        c_lo = _mm512_fmadd_ps(minus32, s_lo, _mm512_permutexvar_ps(even, m8));
        c_hi = _mm512_fmadd_ps(minus32, s_hi, _mm512_permutexvar_ps(odd, m8));
      }
      const Quad6 u(wq);
      for (int r = 0; r < R; ++r) {
        const __m512 d = _mm512_permutexvar_ps(
            spread, _mm512_castps128_ps512(_mm_loadu_ps(a.dx + r * blocks + q * 4)));
        const __m512 xs8 = _mm512_castps256_ps512(_mm256_loadu_ps(a.xs + r * 2 * blocks + q * 8));
        const int8_t* xq = a.quads + r * quads_stride(a.k) + q * kQuad6;
        acc[r][0] = _mm512_fmadd_ps(dot6(u.lo, xq), _mm512_mul_ps(s_lo, d), acc[r][0]);
        acc[r][0] = _mm512_fmadd_ps(c_lo, _mm512_maskz_permutexvar_ps(kFirstLanes, even, xs8), acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(dot6(u.hi, xq + 64), _mm512_mul_ps(s_hi, d), acc[r][1]);
        acc[r][1] = _mm512_fmadd_ps(c_hi, _mm512_maskz_permutexvar_ps(kFirstLanes, odd, xs8), acc[r][1]);
      }
    }
    store_row_sums<R>(acc, y + row, wt.n);
  }
}

template <typename T>
inline void rows_dot6(const Weight& w, int64_t n0, int64_t n1, const RowActs& a, int64_t first,
                      int count, T* y) {
  const RowActs at{a.quads + first * quads_stride(a.k), a.q + first * a.k, nullptr,
                   a.dx + first * a.blocks, a.xs + first * 2 * a.blocks, a.k, a.blocks};
  T* out = y + first * w.n;
  if (w.super) {
    switch (count) {
      case 1: rows_dot_6bit<1, T, false, true>(w, n0, n1, at, out); break;
      case 2: rows_dot_6bit<2, T, false, true>(w, n0, n1, at, out); break;
      case 3: rows_dot_6bit<3, T, false, true>(w, n0, n1, at, out); break;
      case 4: rows_dot_6bit<4, T, false, true>(w, n0, n1, at, out); break;
      default: TORCH_CHECK(false, "rows_dot6: ", count, " rows");
    }
    return;
  }
  const bool mins = w.mins != nullptr;
  switch (count * 2 + (mins ? 1 : 0)) {
    case 2: rows_dot_6bit<1, T, false>(w, n0, n1, at, out); break;
    case 3: rows_dot_6bit<1, T, true>(w, n0, n1, at, out); break;
    case 4: rows_dot_6bit<2, T, false>(w, n0, n1, at, out); break;
    case 5: rows_dot_6bit<2, T, true>(w, n0, n1, at, out); break;
    case 6: rows_dot_6bit<3, T, false>(w, n0, n1, at, out); break;
    case 7: rows_dot_6bit<3, T, true>(w, n0, n1, at, out); break;
    case 8: rows_dot_6bit<4, T, false>(w, n0, n1, at, out); break;
    case 9: rows_dot_6bit<4, T, true>(w, n0, n1, at, out); break;
    default: TORCH_CHECK(false, "rows_dot6: ", count, " rows");
  }
}
#endif

// x @ W.T for a 6-bit W and few rows of x: the integer products above (a plain loop where
// the CPU lacks AVX-512BW: the loader widens Q6_K to int8 there instead).
template <typename T>
void int_linear_6bit(const at::Tensor& x, const Weight& w, at::Tensor& y) {
  const int64_t rows = x.size(0), blocks = w.k / kBlock, groups = w.k / kGroup6;
  const auto a = quantize_acts<int8_t>(x.data_ptr<T>(), rows, w.k, kGroup6, 1);
  T* out = y.data_ptr<T>();
  const int64_t grain = std::max<int64_t>(1, 8192 / std::max<int64_t>(1, rows * blocks));
#if defined(INFER_FAST_6BIT)
  const auto quads = pair_layout(a.q.data(), rows, w.k, quads_stride(w.k), true);
  const RowActs acts{quads.data(), a.q.data(), nullptr, a.d.data(), a.sum.data(), w.k, blocks};
  const int64_t panel = std::max<int64_t>(kTileRows, kPanelBytes / w.row_bytes);
  at::parallel_for(0, w.n, std::max<int64_t>(grain, kTileRows), [&](int64_t begin, int64_t end) {
    for (int64_t n0 = begin; n0 < end; n0 += panel)
      for (int64_t m0 = 0; m0 < rows; m0 += kActRows)
        rows_dot6(w, n0, std::min(n0 + panel, end), acts, m0,
                  static_cast<int>(std::min<int64_t>(kActRows, rows - m0)), out);
  });
#else
  at::parallel_for(0, w.n, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scale(groups), min(groups);
    for (int64_t n = begin; n < end; ++n) {
      expand_scales(w, n, scale.data(), min.data());
      for (int64_t m = 0; m < rows; ++m) {
        const int8_t* xq = a.q.data() + m * w.k;
        float acc = 0.0f;
        for (int64_t g = 0; g < groups; ++g) {
          int32_t dot = 0;
          for (int64_t k = g * kGroup6; k < (g + 1) * kGroup6; ++k) dot += six_bit(w, n, k) * xq[k];
          acc += static_cast<float>(dot) * (scale[g] * a.d[m * blocks + g / 2]) +
                 (min[g] - 32.0f * scale[g]) * a.sum[m * groups + g];
        }
        out[m * w.n + n] = static_cast<T>(acc);
      }
    }
  });
#endif
}

}  // namespace
