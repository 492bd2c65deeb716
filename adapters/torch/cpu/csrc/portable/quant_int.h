// Few rows: integer dot products of the quantized activations with the weights in their
// compact form (4-bit rows_dot_4bit, the tiles of dot_tile for the other formats).
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

#include "quant_acts.h"
#include "quant_weight.h"

namespace {

constexpr int kTileRows = 4;    // weight rows a work item: in L1 for every activation row
constexpr int kPrefetchTiles = 1;  // how far ahead the integer path prefetches weights
constexpr int kPrefetchRows = kPrefetchTiles * kTileRows;
// Weight bytes rows_dot_4bit takes for each group of activation rows: they stay in L1.
constexpr int64_t kPanelBytes = 16 << 10;
// Bytes between two activation rows of pair_layout's output: room for a padded last quad
// (its 128 bytes start at most 32 bytes before the row's end: k + 96).
constexpr int64_t quads_stride(int64_t k) { return k + 96; }

// How a tile's weight bytes are laid out for the dot product: packed nibbles (16 bytes a
// block), nibbles unpacked to one byte each (32 bytes a block, once per tile when several
// activation rows reuse it), or int8.
enum class Layout { kPacked4, kUnpacked4, kInt8 };

template <Layout L>
constexpr int64_t block_bytes() {
  return L == Layout::kPacked4 ? kBlock / 2 : kBlock;
}

// The activations' integer type for a weight layout: int16 against int8 weights (int8 x
// costs more accuracy than int8 weights do), int8 against 4-bit ones.
template <Layout L>
using act_t = std::conditional_t<L == Layout::kInt8, int16_t, int8_t>;

#if defined(__AVX2__)
// A 4-bit block's products with int8 x summed into 8 int32 lanes: lanes 0-3 from k 0..15,
// 4-7 from 16..31. Unsigned 0..15 weights times signed x: maddubs cannot overflow.
template <Layout L>
inline __m256i nibble_dot(const uint8_t* w, __m256i x) {
  __m256i wv;
  if constexpr (L == Layout::kPacked4) {  // low nibbles: k 0..15, high nibbles: k 16..31
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
    wv = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw),
                          _mm256_set1_epi8(0x0F));
  } else {
    wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  }
  return _mm256_madd_epi16(_mm256_maddubs_epi16(wv, x), _mm256_set1_epi16(1));
}

// acc + block b's products (weights w, activations x) times its scale(s) cs[b * S + h].
template <Layout L, int S>
inline __m256 block_fma(const uint8_t* w, const act_t<L>* x, const float* cs, int64_t b,
                        __m256 acc) {
  const float* c = cs + b * S;
  if constexpr (L == Layout::kInt8) {
    // int8 weights sign-extended to int16, times int16 x: madd gives 8 int32 lanes per 16
    // k's (|sum| <= 4 * 128 * 32767, far from overflow), lo from k 0..15, hi from 16..31.
    const auto* wb = reinterpret_cast<const __m128i*>(w + b * kBlock);
    const auto* xb = reinterpret_cast<const __m256i*>(x + b * kBlock);
    const __m256i lo = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128(wb)),
                                         _mm256_loadu_si256(xb));
    const __m256i hi = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128(wb + 1)),
                                         _mm256_loadu_si256(xb + 1));
    if constexpr (S == 1)
      return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(lo, hi)),
                             _mm256_broadcast_ss(c), acc);
    else  // one scale per 16 k's
      return _mm256_add_ps(
          acc, _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_broadcast_ss(c + 1),
                               _mm256_mul_ps(_mm256_cvtepi32_ps(lo), _mm256_broadcast_ss(c))));
  } else {
    static_assert(S == 1, "4-bit groups are multiples of 32");
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + b * kBlock));
    const __m256 p = _mm256_cvtepi32_ps(nibble_dot<L>(w + b * block_bytes<L>(), xv));
    return _mm256_fmadd_ps(p, _mm256_broadcast_ss(c), acc);
  }
}

// The four horizontal sums of a0..a3, in order.
inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// The sum of a's 8 lanes.
inline float hsum8(__m256 a) {
  return hsum4(a, _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps())[0];
}

// Packed 4-bit block b of one weight row dotted with one int8 activation row, times its
// float16 scale and the activation block's dx: rows_dot_4bit's blocks past its pairs / quads.
inline float one_block(const uint8_t* w, const int8_t* x, const at::Half* scales,
                       const float* dx, int64_t b) {
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + b * kBlock));
  const __m256 p = _mm256_cvtepi32_ps(nibble_dot<Layout::kPacked4>(w + b * 16, xv));
  return hsum8(p) * (_cvtsh_ss(scales[b].x) * dx[b]);
}

// Two packed 4-bit blocks (2p, 2p + 1: 32 contiguous bytes) against one activation row laid
// out by pair_layout: the low nibbles are both blocks' k 0..15, the high nibbles their
// k 16..31, so one load, one shift and two masks feed two maddubs whose int16 sums add
// before one widening (|sum| <= 4 * 15 * 127); lanes 0-3 (block 2p) and 4-7 (2p + 1) take
// their scales from c8 (4 x c_2p, 4 x c_2p+1). Half the multiply-port instructions of two
// block_fma calls, which bound a one-row product on Zen.
struct Pair {
  __m256i lo, hi;
  explicit Pair(const uint8_t* w) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    const __m256i nib = _mm256_set1_epi8(0x0F);
    lo = _mm256_and_si256(raw, nib);
    hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nib);
  }
};

inline __m256 pair_fma(const Pair& p, const int8_t* xp, __m256 c8, __m256 acc) {
  const __m256i xlo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp));
  const __m256i xhi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + 32));
  const __m256i sum16 =
      _mm256_add_epi16(_mm256_maddubs_epi16(p.lo, xlo), _mm256_maddubs_epi16(p.hi, xhi));
  const __m256i sum32 = _mm256_madd_epi16(sum16, _mm256_set1_epi16(1));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum32), c8, acc);
}

inline __m256 pair_fma(const uint8_t* w, const int8_t* xp, __m256 c8, __m256 acc) {
  return pair_fma(Pair(w), xp, c8, acc);
}
#endif

#if defined(__AVX512BW__) && defined(__AVX512VL__)
// Four packed 4-bit blocks (4q .. 4q + 3: 64 contiguous bytes) split into their low and
// high nibbles, once for every activation row that quad_fma takes them to.
struct Quad {
  __m512i lo, hi;
  // the first n blocks (n < 4: the rest zeros)
  explicit Quad(const uint8_t* w, int64_t n = 4) {
    const __m512i raw = n == 4 ? _mm512_loadu_si512(w)
                               : _mm512_maskz_loadu_epi8((__mmask64{1} << (16 * n)) - 1, w);
    const __m512i nib = _mm512_set1_epi8(0x0F);
    lo = _mm512_and_si512(raw, nib);
    hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nib);
  }
};

// A Quad against one activation row laid out by pair_layout's quads (the four blocks' k
// 0..15, then their k 16..31): pair_fma on 512-bit registers, lanes 0-3, 4-7, 8-11, 12-15
// for the four blocks, their scales from c16 (two pairs' c8). With AVX512-VNNI one vpdpbusd
// per half sums u8 x s8 products straight into int32 lanes (maddubs, add and madd otherwise).
inline __m512 quad_fma(const Quad& q, const int8_t* xq, __m512 c16, __m512 acc) {
  const __m512i xlo = _mm512_loadu_si512(xq);
  const __m512i xhi = _mm512_loadu_si512(xq + 64);
#if defined(__AVX512VNNI__)
  const __m512i sum32 =
      _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), q.lo, xlo), q.hi, xhi);
#else
  const __m512i sum16 =
      _mm512_add_epi16(_mm512_maddubs_epi16(q.lo, xlo), _mm512_maddubs_epi16(q.hi, xhi));
  const __m512i sum32 = _mm512_madd_epi16(sum16, _mm512_set1_epi16(1));
#endif
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum32), c16, acc);
}

inline __m512 quad_fma(const uint8_t* w, const int8_t* xq, __m512 c16, __m512 acc) {
  return quad_fma(Quad(w), xq, c16, acc);
}

// The 8 lanes of a + b's two halves.
inline __m256 fold512(__m512 v) {
  return _mm256_add_ps(_mm512_castps512_ps256(v),
                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
#endif

#if defined(__AVX2__) && defined(__F16C__)
// Asks for weight row n, its scales and mins ahead of use (the hardware prefetcher alone
// leaves ~10 % of the memory throughput, measured on Zen).
inline void prefetch_row(const Weight& w, int64_t n) {
  if (n >= w.n) return;
  const auto* q = reinterpret_cast<const char*>(w.row(n));
  for (int64_t i = 0; i < w.row_bytes; i += 64) _mm_prefetch(q + i, _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(w.scales + n * w.groups), _MM_HINT_T0);
  if (w.mins != nullptr) _mm_prefetch(reinterpret_cast<const char*>(w.mins + n * w.groups), _MM_HINT_T0);
}

// R quantized activation rows as rows_dot_4bit reads them: row r's int8 values at q + r * k
// (pair_layout's order at quads + r * quads_stride(k)), its per-block dx at dx + r * blocks
// (spread four times at dx16 + r * 4 * blocks for AVX2's loop), its per-block sums of
// dx * q at xs + r * blocks (per 16 k's for 6-bit weights).
struct RowActs {
  const int8_t* quads;
  const int8_t* q;
  const float* dx16;
  const float* dx;
  const float* xs;
  int64_t k, blocks;
};

// The mins' part of a row: sum over blocks of min[b] * xs[b] (AVX2's rows_dot_4bit; the
// AVX-512 one folds it into its quads).
inline float mins_dot(const at::Half* mins, const float* xs, int64_t blocks) {
  __m256 m = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= blocks; g += 8) {
    const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mins + g)));
    m = _mm256_fmadd_ps(mv, _mm256_loadu_ps(xs + g), m);
  }
  float total = hsum8(m);
  for (; g < blocks; ++g) total += _cvtsh_ss(mins[g].x) * xs[g];
  return total;
}
#endif

#if defined(__AVX512BW__) && defined(__AVX512VL__)
// The first lane of each block's four: where its xs goes (zeros in the other three).
constexpr __mmask16 kFirstLanes = 0x1111;

// 4-bit weight rows n0 .. n1 - 1 with one float16 scale (and min) per block of 32 against R
// activation rows, y[r * n + row] in T: the quads straight from the weight's scales (four
// converted, spread over their blocks' lanes by one permute, times each row's dx spread the
// same way), no per-tile scale buffers; each quad's weights loaded and split once for the R
// rows; the last 1-3 blocks as one quad (masked loads, zeros past the row). The mins' part
// (sum over blocks of min * xs) rides in the same accumulators, one FMA a quad (the mins
// spread like the scales, each block's xs permuted into the first of its four lanes): a dot
// product of its own, with a horizontal sum, for every weight row and activation row cost as
// much as the quads at K = 576 (measured: 1.5-1.9x the time at 16 rows). dx and xs are read
// compact (4 bytes a block each) and spread in registers: copies spread in memory were 16
// times that, 40 KiB of activations re-read from L2 for every weight row at K = 8,192, and
// made long rows ~1.5x slower per byte. Every row goes through the same operations in the
// same order for any R, so a row's result does not depend on the rows beside it.

// Eight float16 values as the low half of a 512-bit register.
inline __m512 halves8(const at::Half* p) {
  return _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// R rows' two accumulators summed, each row's lanes to one float, y[r * n] = it (the
// horizontal sums four rows at once, zeros for missing ones: each row's sum takes the same
// additions in the same order whichever its place).
template <int R, typename T>
inline void store_row_sums(const __m512 (&acc)[R][2], T* y, int64_t n) {
  __m256 h[4];
  for (int r = 0; r < 4; ++r)
    h[r] = r < R ? fold512(_mm512_add_ps(acc[r][0], acc[r][1])) : _mm256_setzero_ps();
  float sums[4];
  _mm_storeu_ps(sums, hsum4(h[0], h[1], h[2], h[3]));
  for (int r = 0; r < R; ++r) y[r * n] = static_cast<T>(sums[r]);
}

// A super-block's 8 sub-block scales (or mins): bytes times the super-block's float16 (exact).
inline __m512 super_scales(const uint8_t* sub, at::Half d) {
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sub)));
  return _mm512_castps256_ps512(_mm256_mul_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(_cvtsh_ss(d.x))));
}

// kSuper: Q4_K's super-blocks (quant_weight.h), 8 blocks a loop as the others; K % 256 == 0,
// so the loops after the first never run.
template <int R, typename T, bool kMins, bool kSuper = false>
inline void rows_dot_4bit(const Weight& wt, int64_t n0, int64_t n1, const RowActs& a, T* y) {
  static_assert(R >= 1 && R <= 4, "the horizontal sums take four rows at a time");
  static_assert(kMins || !kSuper, "super-blocks have mins");
  const int64_t blocks = a.blocks;
  const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const __m512i spread_hi = _mm512_add_epi32(spread, _mm512_set1_epi32(4));
  for (int64_t row = n0; row < n1; ++row) {
    prefetch_row(wt, row + kPrefetchRows);
    const uint8_t* w = wt.row(row);
    const at::Half* scales = wt.scales + row * wt.groups;
    const at::Half* mins = kMins ? wt.mins + row * wt.groups : nullptr;
    __m512 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= blocks; b += 8) {
      const uint8_t* wb = kSuper ? w + (b / 8) * kSuper4Bytes : w + b * 16;  // 8 blocks' nibbles
      const __m512 s8 =
          kSuper ? super_scales(wb + 128, scales[b / 8]) : halves8(scales + b);
      const __m512 s0 = _mm512_permutexvar_ps(spread, s8), s1 = _mm512_permutexvar_ps(spread_hi, s8);
      __m512 m0 = s0, m1 = s1;
      if constexpr (kMins) {
        const __m512 m8 =
            kSuper ? super_scales(wb + 136, mins[b / 8]) : halves8(mins + b);
        m0 = _mm512_permutexvar_ps(spread, m8), m1 = _mm512_permutexvar_ps(spread_hi, m8);
      }
      const Quad q0(wb), q1(wb + 64);
      for (int r = 0; r < R; ++r) {
        const __m512 dx8 = _mm512_castps256_ps512(_mm256_loadu_ps(a.dx + r * blocks + b));
        const int8_t* xq = a.quads + r * quads_stride(a.k) + b * 32;
        acc[r][0] = quad_fma(q0, xq, _mm512_mul_ps(s0, _mm512_permutexvar_ps(spread, dx8)), acc[r][0]);
        acc[r][1] = quad_fma(q1, xq + 128, _mm512_mul_ps(s1, _mm512_permutexvar_ps(spread_hi, dx8)),
                             acc[r][1]);
        if constexpr (kMins) {
          const __m512 xs8 = _mm512_castps256_ps512(_mm256_loadu_ps(a.xs + r * blocks + b));
          acc[r][0] = _mm512_fmadd_ps(m0, _mm512_maskz_permutexvar_ps(kFirstLanes, spread, xs8), acc[r][0]);
          acc[r][1] = _mm512_fmadd_ps(m1, _mm512_maskz_permutexvar_ps(kFirstLanes, spread_hi, xs8),
                                      acc[r][1]);
        }
      }
    }
    for (; b + 4 <= blocks; b += 4) {
      const __m512 s4 = _mm512_castps128_ps512(
          _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(scales + b))));
      const __m512 s0 = _mm512_permutexvar_ps(spread, s4);
      __m512 m0 = s0;
      if constexpr (kMins)
        m0 = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_cvtph_ps(
                                               _mm_loadl_epi64(reinterpret_cast<const __m128i*>(mins + b)))));
      const Quad q0(w + b * 16);
      for (int r = 0; r < R; ++r) {
        const __m512 dx4 = _mm512_castps128_ps512(_mm_loadu_ps(a.dx + r * blocks + b));
        acc[r][0] = quad_fma(q0, a.quads + r * quads_stride(a.k) + b * 32,
                             _mm512_mul_ps(s0, _mm512_permutexvar_ps(spread, dx4)), acc[r][0]);
        if constexpr (kMins) {
          const __m512 xs4 = _mm512_castps128_ps512(_mm_loadu_ps(a.xs + r * blocks + b));
          acc[r][0] = _mm512_fmadd_ps(m0, _mm512_maskz_permutexvar_ps(kFirstLanes, spread, xs4),
                                      acc[r][0]);
        }
      }
    }
    if (b < blocks) {  // the last 1-3 blocks as a quad (masked loads)
      const int64_t n = std::min<int64_t>(4, blocks - b);
      const __m512 s4 = _mm512_castps128_ps512(_mm_cvtph_ps(
          _mm_maskz_loadu_epi16(static_cast<__mmask8>((1u << n) - 1), scales + b)));
      const __m512 s0 = _mm512_permutexvar_ps(spread, s4);
      __m512 m0 = s0;
      if constexpr (kMins)
        m0 = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_maskz_loadu_epi16(
                                               static_cast<__mmask8>((1u << n) - 1), mins + b))));
      const Quad q0(w + b * 16, n);
      const __mmask16 have = static_cast<__mmask16>((1u << n) - 1);
      const __mmask16 lanes = static_cast<__mmask16>((1u << (4 * n)) - 1);
      for (int r = 0; r < R; ++r) {
        const __m512 dxn = _mm512_maskz_loadu_ps(have, a.dx + r * blocks + b);
        acc[r][0] = quad_fma(q0, a.quads + r * quads_stride(a.k) + b * 32,
                             _mm512_mul_ps(s0, _mm512_maskz_permutexvar_ps(lanes, spread, dxn)),
                             acc[r][0]);
        if constexpr (kMins) {
          const __m512 xsn = _mm512_maskz_loadu_ps(have, a.xs + r * blocks + b);
          acc[r][0] = _mm512_fmadd_ps(
              m0, _mm512_maskz_permutexvar_ps(lanes & kFirstLanes, spread, xsn), acc[r][0]);
        }
      }
    }
    store_row_sums<R>(acc, y + row, wt.n);
  }
}

template <int R, typename T>
inline void rows_dot_4bit(const Weight& wt, int64_t n0, int64_t n1, const RowActs& a, T* y) {
  if (wt.super)
    rows_dot_4bit<R, T, true, true>(wt, n0, n1, a, y);
  else if (wt.mins != nullptr)
    rows_dot_4bit<R, T, true>(wt, n0, n1, a, y);
  else
    rows_dot_4bit<R, T, false>(wt, n0, n1, a, y);
}

#elif defined(__AVX2__) && defined(__F16C__)
// rows_dot_4bit on AVX2: the pairs of pair_fma, their scales straight from the weight's
// (eight converted at a time, a pair's two spread over its lanes by one permute); each
// pair's weights loaded and split once for the R rows.
template <int R, typename T>
inline void rows_dot_4bit(const Weight& wt, int64_t n0, int64_t n1, const RowActs& a, T* y) {
  const int64_t blocks = a.blocks;
  const __m256i spread[4] = {_mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0),
                             _mm256_set_epi32(3, 3, 3, 3, 2, 2, 2, 2),
                             _mm256_set_epi32(5, 5, 5, 5, 4, 4, 4, 4),
                             _mm256_set_epi32(7, 7, 7, 7, 6, 6, 6, 6)};
  for (int64_t row = n0; row < n1; ++row) {
    prefetch_row(wt, row + kPrefetchRows);
    const uint8_t* w = wt.row(row);
    const at::Half* scales = wt.scales + row * wt.groups;
    const at::Half* mins = wt.mins == nullptr ? nullptr : wt.mins + row * wt.groups;
    __m256 acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < 4; ++u) acc[r][u] = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= blocks; b += 8) {
      const __m256 s8 =
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + b)));
      for (int u = 0; u < 4; ++u) {
        const __m256 s = _mm256_permutevar8x32_ps(s8, spread[u]);
        const Pair p(w + (b + 2 * u) * 16);
        for (int r = 0; r < R; ++r) {
          const __m256 c = _mm256_mul_ps(s, _mm256_loadu_ps(a.dx16 + r * 4 * blocks + (b + 2 * u) * 4));
          acc[r][u] = pair_fma(p, a.quads + r * quads_stride(a.k) + (b + 2 * u) * 32, c, acc[r][u]);
        }
      }
    }
    for (; b + 2 <= blocks; b += 2) {
      int32_t two;  // the pair's two float16 scales
      std::memcpy(&two, scales + b, sizeof(two));
      const __m256 s2 = _mm256_castps128_ps256(_mm_cvtph_ps(_mm_cvtsi32_si128(two)));
      const __m256 s = _mm256_permutevar8x32_ps(s2, spread[0]);
      const Pair p(w + b * 16);
      for (int r = 0; r < R; ++r) {
        const __m256 c = _mm256_mul_ps(s, _mm256_loadu_ps(a.dx16 + r * 4 * blocks + b * 4));
        acc[r][0] = pair_fma(p, a.quads + r * quads_stride(a.k) + b * 32, c, acc[r][0]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 sum =
          _mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][1]), _mm256_add_ps(acc[r][2], acc[r][3]));
      float total = hsum8(sum);
      for (int64_t t = b; t < blocks; ++t)
        total += one_block(w, a.q + r * a.k, scales, a.dx + r * blocks, t);
      if (mins != nullptr) total += mins_dot(mins, a.xs + r * blocks, blocks);
      y[r * wt.n + row] = static_cast<T>(total);
    }
  }
}
#endif

#if (defined(__AVX512BW__) && defined(__AVX512VL__)) || (defined(__AVX2__) && defined(__F16C__))
#define INFER_ROW_DOT 1  // rows_dot_4bit exists
// Activation rows' dx spread as AVX2's rows_dot_4bit takes it: each block's dx four times
// (the AVX-512 one spreads it in registers).
std::vector<float> spread_dx(const float* dx, int64_t rows, int64_t blocks) {
  std::vector<float> out(rows * blocks * 4);
  for (int64_t b = 0; b < rows * blocks; ++b) std::fill_n(out.data() + b * 4, 4, dx[b]);
  return out;
}

// Activation rows rows_dot_4bit takes at a time against a panel of weight rows (2 or 4 a
// time measured the same with AVX2; 4 is 1.1-1.5x faster than 2 with AVX-512).
constexpr int kActRows = 4;

// y[i, n] = rows_dot_4bit of weight rows n0 .. n1 - 1 against activation rows
// first .. first + count - 1 (count <= kActRows), for i < count.
template <typename T>
inline void rows_dot(const Weight& w, int64_t n0, int64_t n1, const RowActs& a, int64_t first,
                     int count, T* y) {
  const RowActs at{a.quads + first * quads_stride(a.k), a.q + first * a.k,
                   a.dx16 == nullptr ? nullptr : a.dx16 + first * 4 * a.blocks,
                   a.dx + first * a.blocks, a.xs + first * a.blocks, a.k, a.blocks};
  T* out = y + first * w.n;
  switch (count) {
    case 1: rows_dot_4bit<1>(w, n0, n1, at, out); break;
    case 2: rows_dot_4bit<2>(w, n0, n1, at, out); break;
    case 3: rows_dot_4bit<3>(w, n0, n1, at, out); break;
    case 4: rows_dot_4bit<4>(w, n0, n1, at, out); break;
    default: TORCH_CHECK(false, "rows_dot: ", count, " rows");
  }
}
#endif

// kTileRows weight rows (w[r], block_bytes<L>() a block) dotted with one quantized activation
// row: out[r] = sum over blocks of int_dot * cs[r][b * S + h] (dx * weight scale; S = 2: one
// scale per 16 k's), plus sum over groups of min[r][g] * xs[g] when min is given.
template <Layout L, int S>
void dot_tile(const uint8_t* const* w, const act_t<L>* x, const float* cs, int64_t blocks,
              const float* min, const float* xs, int64_t groups, float* out,
              const int8_t* x_pairs = nullptr, const float* cs8 = nullptr) {
  constexpr int R = kTileRows;
  const int64_t stride = blocks * S;  // of cs, per row
#if defined(__AVX2__)
  static_assert(R == 4, "the AVX2 epilogue sums four rows at once");
  __m256 acc[R];
  // One row after the other, so that the weights stream from memory in order: reading the
  // rows a block each in turn halves the memory throughput (measured on Zen). Four
  // accumulators a row (blocks b % 4) hide the FMA latency when the weights are in cache.
  for (int r = 0; r < R; ++r) {
    __m256 part[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                      _mm256_setzero_ps()};
    const float* c = cs + r * stride;
    int64_t b = 0;
    if constexpr (L == Layout::kPacked4) {
      if (x_pairs != nullptr) {  // two blocks a step, 8 a loop; an odd last block below
        const float* c8 = cs8 + r * (blocks / 2) * 8;
#if defined(__AVX512BW__) && defined(__AVX512VL__)
        // four blocks a step (16 a loop) on 512-bit registers; the pair and block after
        __m512 wide[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                          _mm512_setzero_ps()};
        for (; b + 16 <= blocks; b += 16)
          for (int u = 0; u < 4; ++u)
            wide[u] = quad_fma(w[r] + (b + 4 * u) * 16, x_pairs + (b + 4 * u) * 32,
                               _mm512_loadu_ps(c8 + (b / 2 + 2 * u) * 8), wide[u]);
        for (; b + 4 <= blocks; b += 4)
          wide[1] = quad_fma(w[r] + b * 16, x_pairs + b * 32, _mm512_loadu_ps(c8 + (b / 2) * 8),
                             wide[1]);
        part[2] = fold512(_mm512_add_ps(_mm512_add_ps(wide[0], wide[1]),
                                        _mm512_add_ps(wide[2], wide[3])));
#endif
        for (; b + 8 <= blocks; b += 8)
          for (int u = 0; u < 4; ++u)
            part[u] = pair_fma(w[r] + (b + 2 * u) * 16, x_pairs + (b + 2 * u) * 32,
                               _mm256_loadu_ps(c8 + (b / 2 + u) * 8), part[u]);
        for (; b + 2 <= blocks; b += 2)
          part[1] = pair_fma(w[r] + b * 16, x_pairs + b * 32, _mm256_loadu_ps(c8 + (b / 2) * 8),
                             part[1]);
      }
    }
    for (; b + 4 <= blocks; b += 4)
      for (int u = 0; u < 4; ++u) part[u] = block_fma<L, S>(w[r], x, c, b + u, part[u]);
    // The last blocks into one accumulator: an index known only at run time (part[u] in a
    // loop of unknown length) would put all four on the stack, every FMA of the main loop
    // then waiting on a store and a load (profiled: a third of the time).
    for (; b < blocks; ++b) part[0] = block_fma<L, S>(w[r], x, c, b, part[0]);
    acc[r] = _mm256_add_ps(_mm256_add_ps(part[0], part[1]), _mm256_add_ps(part[2], part[3]));
  }
  float tail[R] = {};  // the groups past the last multiple of 8
  if (min != nullptr) {
    const int64_t vec = groups / 8 * 8;
    for (int64_t g = 0; g < vec; g += 8) {
      const __m256 xg = _mm256_loadu_ps(xs + g);
      for (int r = 0; r < R; ++r)
        acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(min + r * groups + g), xg, acc[r]);
    }
    for (int r = 0; r < R; ++r)
      for (int64_t g = vec; g < groups; ++g) tail[r] += min[r * groups + g] * xs[g];
  }
  _mm_storeu_ps(out, _mm_add_ps(hsum4(acc[0], acc[1], acc[2], acc[3]), _mm_loadu_ps(tail)));
#else
  constexpr int64_t wbytes = block_bytes<L>();
  for (int r = 0; r < R; ++r) {
    float acc = 0.0f;
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* wb = w[r] + b * wbytes;
      const act_t<L>* xb = x + b * kBlock;
      int32_t half[2] = {0, 0};
      for (int j = 0; j < kBlock; ++j) {
        int32_t q;
        if constexpr (L == Layout::kPacked4)
          q = j < 16 ? (wb[j] & 0x0F) : (wb[j - 16] >> 4);
        else if constexpr (L == Layout::kUnpacked4)
          q = wb[j];
        else
          q = static_cast<int8_t>(wb[j]);
        half[j / 16] += q * xb[j];
      }
      const float* c = cs + r * stride + b * S;
      if constexpr (S == 1)
        acc += static_cast<float>(half[0] + half[1]) * c[0];
      else
        acc += static_cast<float>(half[0]) * c[0] + static_cast<float>(half[1]) * c[1];
    }
    for (int64_t g = 0; min != nullptr && g < groups; ++g) acc += min[r * groups + g] * xs[g];
    out[r] = acc;
  }
#endif
}

// Per-thread buffers of the integer path for one tile: its scales expanded to one per scale
// slot (S per 32-block, [row][slot]), its mins ([row][group]), the scales times one
// activation row's dx, and its 4-bit weights unpacked to bytes.
struct Scratch {
  std::vector<float> scale, min, cs, cs8;
  std::vector<uint8_t> unpacked;
  Scratch(const Weight& w, int64_t slots)
      : scale(kTileRows * slots), min(kTileRows * w.groups), cs(kTileRows * slots),
        cs8(w.bits == 4 ? kTileRows * (slots / 2) * 8 : 0),
        unpacked(w.bits == 4 ? kTileRows * w.k : 0) {}
};

// A 4-bit row's nibbles as one byte per k (the chunk layout: low nibbles first).
void unpack_row(const uint8_t* q, int64_t k, uint8_t* out) {
  for (int64_t c = 0; c < k / kBlock; ++c) {
    const uint8_t* in = q + c * kBlock / 2;
    uint8_t* o = out + c * kBlock;
#if defined(__AVX2__)
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in));
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o),
                        _mm256_and_si256(both, _mm256_set1_epi8(0x0F)));
#else
    for (int j = 0; j < kBlock / 2; ++j) {
      o[j] = in[j] & 0x0F;
      o[j + kBlock / 2] = in[j] >> 4;
    }
#endif
  }
}

// Asks for the next tile's weights, scales and mins while this one computes (the hardware
// prefetcher alone leaves ~10 % of the memory throughput, measured on Zen).
void prefetch_tile(const Weight& w, int64_t n0) {
#if defined(__SSE__) || defined(__AVX2__)
  if (n0 >= w.n) return;
  const int64_t rows = std::min<int64_t>(kTileRows, w.n - n0);
  const auto* q = reinterpret_cast<const char*>(w.row(n0));
  for (int64_t i = 0; i < rows * w.row_bytes; i += 64) _mm_prefetch(q + i, _MM_HINT_T0);
  const int64_t half_bytes = rows * w.groups * 2;
  const auto* sc = reinterpret_cast<const char*>(w.scales + n0 * w.groups);
  for (int64_t i = 0; i < half_bytes; i += 64) _mm_prefetch(sc + i, _MM_HINT_T0);
  const auto* mn = reinterpret_cast<const char*>(w.mins + n0 * w.groups);
  for (int64_t i = 0; w.mins != nullptr && i < half_bytes; i += 64)
    _mm_prefetch(mn + i, _MM_HINT_T0);
#endif
}

// Output columns [n0, n0 + 4) (fewer at the end: the last row stands in for missing ones)
// for every activation row: the tile's weights are read from memory once and reused from
// L1 for all of them.
template <Layout L, int S, typename T>
void int_tile(const Weight& w, const Acts<act_t<L>>& a, int64_t rows, int64_t n0, Scratch& sc,
              T* y, const int8_t* x_pairs, const float* dx16) {
  constexpr int R = kTileRows;
  const int64_t blocks = w.k / kBlock, slots = blocks * S, per_group = slots / w.groups;
  const bool unpack = L == Layout::kPacked4 && rows > 1;
  prefetch_tile(w, n0 + kPrefetchTiles * R);
  const uint8_t* wr[R];
  for (int r = 0; r < R; ++r) {
    const int64_t n = std::min(n0 + r, w.n - 1);
    wr[r] = w.row(n);
    if (unpack) {
      unpack_row(wr[r], w.k, sc.unpacked.data() + r * w.k);
      wr[r] = sc.unpacked.data() + r * w.k;
    }
    float* scale = sc.scale.data() + r * slots;
    halves_to_floats(w.scales + n * w.groups, scale, w.groups);
    for (int64_t g = w.groups - 1; per_group > 1 && g >= 0; --g) {  // slot i: group i / per
      const float v = scale[g];  // expanded in place from the back
      std::fill(scale + g * per_group, scale + (g + 1) * per_group, v);
    }
    if (w.mins != nullptr)
      halves_to_floats(w.mins + n * w.groups, sc.min.data() + r * w.groups, w.groups);
  }
  const float* min = w.mins != nullptr ? sc.min.data() : nullptr;
  const int valid = static_cast<int>(std::min<int64_t>(R, w.n - n0));
  for (int64_t m = 0; m < rows; ++m) {
    const float* dx = a.d.data() + m * slots;
    for (int r = 0; r < R; ++r) {
      float* cs = sc.cs.data() + r * slots;
      const float* scale = sc.scale.data() + r * slots;
      for (int64_t i = 0; i < slots; ++i) cs[i] = scale[i] * dx[i];
    }
    float dot[R];
    const act_t<L>* x = a.q.data() + m * w.k;
    const float* xs = a.sum.data() + m * w.groups;
    if constexpr (L == Layout::kPacked4) {
      if (unpack) {
        dot_tile<Layout::kUnpacked4, S>(wr, x, sc.cs.data(), blocks, min, xs, w.groups, dot);
      } else if (x_pairs != nullptr) {
#if defined(__AVX2__)
        const int64_t pairs = blocks / 2;
        for (int r = 0; r < R; ++r) {
          const float* c = sc.cs.data() + r * slots;
          float* c8 = sc.cs8.data() + r * pairs * 8;
          for (int64_t p = 0; p < pairs; ++p)
            _mm256_storeu_ps(c8 + p * 8, _mm256_set_m128(_mm_set1_ps(c[2 * p + 1]),
                                                         _mm_set1_ps(c[2 * p])));
        }
#endif
        dot_tile<L, S>(wr, x, sc.cs.data(), blocks, min, xs, w.groups, dot, x_pairs,
                       sc.cs8.data());
      } else {
        dot_tile<L, S>(wr, x, sc.cs.data(), blocks, min, xs, w.groups, dot);
      }
    } else {
      dot_tile<L, S>(wr, x, sc.cs.data(), blocks, min, xs, w.groups, dot);
    }
    for (int r = 0; r < valid; ++r) y[m * w.n + n0 + r] = static_cast<T>(dot[r]);
  }
}

template <Layout L, int S, typename T>
void int_path(const Weight& w, const Acts<act_t<L>>& a, int64_t rows, T* y) {
  // 4-bit weights with a scale per block: rows_dot_4bit for every row; other 4-bit ones:
  // one row two blocks a step, several unpacked
  bool row_dot = false;
#if defined(INFER_ROW_DOT)
  row_dot = L == Layout::kPacked4 && S == 1 && (w.group == kBlock || w.super);
#endif
  std::vector<int8_t> pairs;
#if defined(__AVX2__)
  if constexpr (L == Layout::kPacked4)
    if (rows == 1 || row_dot)
      pairs = pair_layout(a.q.data(), row_dot ? rows : 1, w.k, quads_stride(w.k), row_dot);
#endif
  const int8_t* x_pairs = pairs.empty() ? nullptr : pairs.data();
  std::vector<float> spread;  // AVX2's rows_dot_4bit's dx
#if defined(INFER_ROW_DOT) && !(defined(__AVX512BW__) && defined(__AVX512VL__))
  if (row_dot) spread = spread_dx(a.d.data(), rows, w.k / kBlock);
#endif
  const float* dx16 = spread.empty() ? nullptr : spread.data();
  const int64_t tiles = (w.n + kTileRows - 1) / kTileRows;
  const int64_t work = std::max<int64_t>(1, rows * (w.k / kBlock) * kTileRows);
  const int64_t grain = std::max<int64_t>(1, 8192 / work);  // tiny layers stay on one thread
#if defined(INFER_ROW_DOT)
  if constexpr (L == Layout::kPacked4 && S == 1) if (row_dot) {
    // panels of weight rows (in L1) against kActRows activation rows at a time
    const RowActs acts{x_pairs, a.q.data(), dx16, a.d.data(), a.sum.data(), w.k, w.k / kBlock};
    const int64_t panel = std::max<int64_t>(kTileRows, kPanelBytes / w.row_bytes);
    at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
      const int64_t last = std::min(end * kTileRows, w.n);
      for (int64_t n0 = begin * kTileRows; n0 < last; n0 += panel)
        for (int64_t m0 = 0; m0 < rows; m0 += kActRows)
          rows_dot(w, n0, std::min(n0 + panel, last), acts, m0,
                   static_cast<int>(std::min<int64_t>(kActRows, rows - m0)), y);
    });
    return;
  }
#endif
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    Scratch sc(w, (w.k / kBlock) * S);
    for (int64_t t = begin; t < end; ++t)
      int_tile<L, S>(w, a, rows, t * kTileRows, sc, y, x_pairs, dx16);
  });
}

// x quantized to the layout's activation type, then the integer path with S scale slots.
template <Layout L, int S, typename T>
void quantize_and_multiply(const at::Tensor& x, const Weight& w, at::Tensor& y) {
  const int64_t rows = x.size(0);
  // super-blocks' mins are per block of 32: their sums too
  const auto a = quantize_acts<act_t<L>>(x.data_ptr<T>(), rows, w.k, w.super ? kBlock : w.group, S);
  int_path<L, S>(w, a, rows, y.data_ptr<T>());
}

#if !(defined(__AVX512BW__) && defined(__AVX512VL__))
// 4-bit super-blocks without AVX-512 (the loader keeps Q4_K as float16 scales per block
// there; this serves a direct call): a plain loop, x as int8 per 32.
template <typename T>
void super4_loop(const at::Tensor& x, const Weight& w, at::Tensor& y) {
  const int64_t rows = x.size(0), blocks = w.k / kBlock;
  const auto a = quantize_acts<int8_t>(x.data_ptr<T>(), rows, w.k, kBlock, 1);
  T* out = y.data_ptr<T>();
  at::parallel_for(0, w.n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scale(blocks), min(blocks);
    for (int64_t n = begin; n < end; ++n) {
      expand_scales(w, n, scale.data(), min.data());
      for (int64_t m = 0; m < rows; ++m) {
        float acc = 0.0f;
        for (int64_t c = 0; c < blocks; ++c) {
          const uint8_t* nib = w.row(n) + (c / 8) * kSuper4Bytes + (c % 8) * 16;
          const int8_t* xq = a.q.data() + m * w.k + c * kBlock;
          int32_t dot = 0;
          for (int j = 0; j < 16; ++j) dot += (nib[j] & 0x0F) * xq[j] + (nib[j] >> 4) * xq[16 + j];
          acc += static_cast<float>(dot) * (scale[c] * a.d[m * blocks + c]) +
                 min[c] * a.sum[m * blocks + c];
        }
        out[m * w.n + n] = static_cast<T>(acc);
      }
    }
  });
}
#endif

template <typename T>
void int_linear(const at::Tensor& x, const Weight& w, at::Tensor& y) {
#if !(defined(__AVX512BW__) && defined(__AVX512VL__))
  if (w.super) return super4_loop<T>(x, w, y);
#endif
  if (w.bits == 4)
    quantize_and_multiply<Layout::kPacked4, 1, T>(x, w, y);
  else if (w.group % kBlock == 0)
    quantize_and_multiply<Layout::kInt8, 1, T>(x, w, y);
  else
    quantize_and_multiply<Layout::kInt8, 2, T>(x, w, y);
}

}  // namespace
