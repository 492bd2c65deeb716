// Linear layers over infer's quantized weights ("infer-quantized-v1": int8 [N, K] or 4-bit
// packed [N, K/2] in GGUF Q4_0's nibble order, float16 scales and optional mins per group
// of g consecutive k's; W[n, k] = q * scale + min). Two paths, by the caller's row threshold:
//  - few rows (decode, memory-bound): the activations are quantized per block of 32 and
//    each block's dot product with the weights is done in integers, so the weights are read
//    in their compact form, never widened to float: 4-bit ones are 8x smaller than float32.
//    For 4-bit weights x becomes int8 (llama.cpp's Q8_0: dx = max|x| / 127; AVX2 maddubs +
//    madd, two blocks a step; with AVX-512 four, vpdpbusd where the CPU has VNNI, and one row
//    reads its scales straight from the weight's); for int8 weights int16 (dx = max|x| / 32767; int8 weights sign-extended, AVX2
//    madd): int8 x alone cost ~3.5 points of SmolLM2-135M's top-1 next-token agreement
//    with the float model, int16 x moves a layer's output by ~1e-5 of its norm;
//  - many rows (prefill, compute-bound): tiles of the weight are dequantized to float32
//    (bfloat16 where the CPU multiplies it natively) and multiplied with at::mm.
// ATen and the op registry only, like paged_attention.cpp. Ops: torch.ops.infer.
// quant_linear and quant_dequantize.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/Utils.h>
#include <torch/library.h>

#if defined(__SSE__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;  // activation quantization block (and 4-bit packing chunk)
constexpr int kTileRows = 4;    // weight rows a work item: in L1 for every activation row
constexpr int kPrefetchTiles = 1;  // how far ahead the integer path prefetches weights
constexpr int kPrefetchRows = kPrefetchTiles * kTileRows;
// Weight bytes rows_dot_4bit takes for each group of activation rows: they stay in L1.
constexpr int64_t kPanelBytes = 16 << 10;
// Bytes between two activation rows of pair_layout's output: room for a padded last quad
// (its 128 bytes start at most 32 bytes before the row's end: k + 96).
constexpr int64_t quads_stride(int64_t k) { return k + 96; }

// The checked weight arguments as raw pointers.
struct Weight {
  const uint8_t* q;       // row-major; int8 bytes for bits 8, packed nibbles for bits 4
  const at::Half* scales; // [n, groups]
  const at::Half* mins;   // [n, groups] or nullptr
  int64_t n, k, bits, group, groups, row_bytes;

  const uint8_t* row(int64_t r) const { return q + r * row_bytes; }
};

// float16 -> float32 for a run of values (F16C 8 at a time where the CPU has it).
inline void halves_to_floats(const at::Half* src, float* dst, int64_t count) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= count; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
  for (; i < count; ++i) dst[i] = _cvtsh_ss(src[i].x);
#else
  for (; i < count; ++i) dst[i] = static_cast<float>(src[i]);
#endif
}

// One dequantized row of W in float32. q * s is exact in float32 (<= 8-bit q times an
// 11-bit float16 significand), so fused or separate multiply-add give the same float.
void dequant_row(const Weight& w, int64_t n, float* scale, float* min, float* out) {
  halves_to_floats(w.scales + n * w.groups, scale, w.groups);
  if (w.mins != nullptr)
    halves_to_floats(w.mins + n * w.groups, min, w.groups);
  else
    std::fill(min, min + w.groups, 0.0f);
  const uint8_t* q = w.row(n);
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
    const int64_t g = c * kBlock / w.group;
    const float s = scale[g], m = min[g];
    const uint8_t* b = q + c * kBlock / 2;
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

// float32 -> bfloat16 for a run of values, rounded as c10::BFloat16 rounds (to nearest
// even; NaN to 0x7FC0), 16 or 8 at a time with integer vector ops: the scalar conversion
// took most of the dense path's dequantization time.
inline void floats_to_bf16(const float* src, at::BFloat16* dst, int64_t count) {
  int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const __m512i bias = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1);
  const __m512i nan = _mm512_set1_epi32(0x7FC0);
  for (; i + 16 <= count; i += 16) {
    const __m512 v = _mm512_loadu_ps(src + i);
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(bias, lsb)), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), nan);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm512_cvtepi32_epi16(r));
  }
#elif defined(__AVX2__)
  const __m256i bias = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1);
  const __m256i nan = _mm256_set1_epi32(0x7FC0);
  for (; i + 8 <= count; i += 8) {
    const __m256 v = _mm256_loadu_ps(src + i);
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(bias, lsb)), 16);
    r = _mm256_blendv_epi8(r, nan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    // 8 x 32-bit -> 8 x 16-bit (values < 2^16: packus keeps them), lanes back in order
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_castsi256_si128(packed));
  }
#endif
  for (; i < count; ++i) dst[i] = static_cast<at::BFloat16>(src[i]);
}

// Rows [first, last) of W, dequantized into dst ([last - first, k], T).
template <typename T>
void dequant_rows(const Weight& w, int64_t first, int64_t last, T* dst) {
  std::vector<float> scale(w.groups), min(w.groups), row(w.k);
  for (int64_t n = first; n < last; ++n) {
    T* out = dst + (n - first) * w.k;
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
// (spread four times at dx16 + r * 4 * blocks), its per-block sums of dx * q at
// xs + r * blocks (and as rows_dot_4bit's AVX-512 loop takes them, in the first of each
// block's four lanes, zeros in the others, at xs16 + r * 4 * blocks).
struct RowActs {
  const int8_t* quads;
  const int8_t* q;
  const float* dx16;
  const float* dx;
  const float* xs;
  const float* xs16;
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
// 4-bit weight rows n0 .. n1 - 1 with one float16 scale (and min) per block of 32 against R
// activation rows, y[r * n + row] in T: the quads straight from the weight's scales (four
// converted, spread over their blocks' lanes by one permute, times each row's dx16), no
// per-tile scale buffers; each quad's weights loaded and split once for the R rows; the
// last 1-3 blocks as one quad (masked loads, zeros past the row). The mins' part (sum over
// blocks of min * xs) rides in the same accumulators, one FMA a quad (the mins spread like
// the scales, xs16 holding each block's xs in one of its four lanes): a dot product of its
// own, with a horizontal sum, for every weight row and activation row cost as much as the
// quads at K = 576 (measured: 1.5-1.9x the time at 16 rows). Every row goes through the same
// operations in the same order for any R, so a row's result does not depend on the rows
// beside it.
template <int R, typename T, bool kMins>
inline void rows_dot_4bit(const Weight& wt, int64_t n0, int64_t n1, const RowActs& a, T* y) {
  static_assert(R >= 1 && R <= 4, "the horizontal sums take four rows at a time");
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
      const __m512 s8 = _mm512_castps256_ps512(
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + b))));
      const __m512 s0 = _mm512_permutexvar_ps(spread, s8), s1 = _mm512_permutexvar_ps(spread_hi, s8);
      __m512 m0 = s0, m1 = s1;
      if constexpr (kMins) {
        const __m512 m8 = _mm512_castps256_ps512(
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mins + b))));
        m0 = _mm512_permutexvar_ps(spread, m8), m1 = _mm512_permutexvar_ps(spread_hi, m8);
      }
      const Quad q0(w + b * 16), q1(w + (b + 4) * 16);
      for (int r = 0; r < R; ++r) {
        const float* dx16 = a.dx16 + r * 4 * blocks + b * 4;
        const int8_t* xq = a.quads + r * quads_stride(a.k) + b * 32;
        acc[r][0] = quad_fma(q0, xq, _mm512_mul_ps(s0, _mm512_loadu_ps(dx16)), acc[r][0]);
        acc[r][1] = quad_fma(q1, xq + 128, _mm512_mul_ps(s1, _mm512_loadu_ps(dx16 + 16)), acc[r][1]);
        if constexpr (kMins) {
          const float* xs16 = a.xs16 + r * 4 * blocks + b * 4;
          acc[r][0] = _mm512_fmadd_ps(m0, _mm512_loadu_ps(xs16), acc[r][0]);
          acc[r][1] = _mm512_fmadd_ps(m1, _mm512_loadu_ps(xs16 + 16), acc[r][1]);
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
        acc[r][0] = quad_fma(q0, a.quads + r * quads_stride(a.k) + b * 32,
                             _mm512_mul_ps(s0, _mm512_loadu_ps(a.dx16 + r * 4 * blocks + b * 4)),
                             acc[r][0]);
        if constexpr (kMins)
          acc[r][0] = _mm512_fmadd_ps(m0, _mm512_loadu_ps(a.xs16 + r * 4 * blocks + b * 4), acc[r][0]);
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
      const __mmask16 lanes = static_cast<__mmask16>((1u << (4 * n)) - 1);
      for (int r = 0; r < R; ++r) {
        acc[r][0] = quad_fma(
            q0, a.quads + r * quads_stride(a.k) + b * 32,
            _mm512_mul_ps(s0, _mm512_maskz_loadu_ps(lanes, a.dx16 + r * 4 * blocks + b * 4)),
            acc[r][0]);
        if constexpr (kMins)
          acc[r][0] = _mm512_fmadd_ps(
              m0, _mm512_maskz_loadu_ps(lanes, a.xs16 + r * 4 * blocks + b * 4), acc[r][0]);
      }
    }
    // the horizontal sums four rows at once (zeros for missing ones: each row's sum takes
    // the same additions in the same order whichever its place)
    __m256 h[4];
    for (int r = 0; r < 4; ++r)
      h[r] = r < R ? fold512(_mm512_add_ps(acc[r][0], acc[r][1])) : _mm256_setzero_ps();
    float sums[4];
    _mm_storeu_ps(sums, hsum4(h[0], h[1], h[2], h[3]));
    for (int r = 0; r < R; ++r) y[r * wt.n + row] = static_cast<T>(sums[r]);
  }
}

template <int R, typename T>
inline void rows_dot_4bit(const Weight& wt, int64_t n0, int64_t n1, const RowActs& a, T* y) {
  if (wt.mins != nullptr)
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
// Activation rows' dx spread as rows_dot_4bit takes it: each block's dx four times.
std::vector<float> spread_dx(const float* dx, int64_t rows, int64_t blocks) {
  std::vector<float> out(rows * blocks * 4);
  for (int64_t b = 0; b < rows * blocks; ++b) std::fill_n(out.data() + b * 4, 4, dx[b]);
  return out;
}

// Activation rows' xs as rows_dot_4bit's AVX-512 loop takes them: each block's in the first
// of four lanes, zeros in the other three.
std::vector<float> spread_xs(const float* xs, int64_t rows, int64_t blocks) {
  std::vector<float> out(rows * blocks * 4);  // zeros
  for (int64_t b = 0; b < rows * blocks; ++b) out[b * 4] = xs[b];
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
                   a.dx16 + first * 4 * a.blocks, a.dx + first * a.blocks,
                   a.xs + first * a.blocks,
                   a.xs16 == nullptr ? nullptr : a.xs16 + first * 4 * a.blocks, a.k, a.blocks};
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
  row_dot = L == Layout::kPacked4 && S == 1 && w.group == kBlock;
#endif
  std::vector<int8_t> pairs;
#if defined(__AVX2__)
  if constexpr (L == Layout::kPacked4)
    if (rows == 1 || row_dot)
      pairs = pair_layout(a.q.data(), row_dot ? rows : 1, w.k, quads_stride(w.k), row_dot);
#endif
  const int8_t* x_pairs = pairs.empty() ? nullptr : pairs.data();
  std::vector<float> spread, spread_sums;  // rows_dot_4bit's dx and xs
#if defined(INFER_ROW_DOT)
  if (row_dot) spread = spread_dx(a.d.data(), rows, w.k / kBlock);
  if (row_dot && w.mins != nullptr) spread_sums = spread_xs(a.sum.data(), rows, w.k / kBlock);
#endif
  const float* dx16 = spread.empty() ? nullptr : spread.data();
  const int64_t tiles = (w.n + kTileRows - 1) / kTileRows;
  const int64_t work = std::max<int64_t>(1, rows * (w.k / kBlock) * kTileRows);
  const int64_t grain = std::max<int64_t>(1, 8192 / work);  // tiny layers stay on one thread
#if defined(INFER_ROW_DOT)
  if constexpr (L == Layout::kPacked4 && S == 1) if (row_dot) {
    // panels of weight rows (in L1) against kActRows activation rows at a time
    const RowActs acts{x_pairs,        a.q.data(), dx16, a.d.data(), a.sum.data(),
                       spread_sums.empty() ? nullptr : spread_sums.data(), w.k, w.k / kBlock};
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
  const auto a = quantize_acts<act_t<L>>(x.data_ptr<T>(), rows, w.k, w.group, S);
  int_path<L, S>(w, a, rows, y.data_ptr<T>());
}

template <typename T>
void int_linear(const at::Tensor& x, const Weight& w, at::Tensor& y) {
  if (w.bits == 4)
    quantize_and_multiply<Layout::kPacked4, 1, T>(x, w, y);
  else if (w.group % kBlock == 0)
    quantize_and_multiply<Layout::kInt8, 1, T>(x, w, y);
  else
    quantize_and_multiply<Layout::kInt8, 2, T>(x, w, y);
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

Weight check_weight(const at::Tensor& qweight, const at::Tensor& scales,
                    const std::optional<at::Tensor>& mins, int64_t bits, int64_t group,
                    std::optional<int64_t> k_from_x) {
  TORCH_CHECK(bits == 4 || bits == 8, "quantized weights: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(qweight.device().is_cpu() && scales.device().is_cpu(),
              "quantized weights: tensors must be on the CPU");
  TORCH_CHECK(qweight.dim() == 2, "qweight must be 2-D [N, K] (bits 8) or [N, K/2] (bits 4)");
  const auto want = bits == 8 ? at::kChar : at::kByte;
  TORCH_CHECK(qweight.scalar_type() == want, "bits ", bits, ": qweight must be ",
              bits == 8 ? "int8" : "uint8", ", got ", qweight.scalar_type());
  const int64_t n = qweight.size(0), k = bits == 8 ? qweight.size(1) : 2 * qweight.size(1);
  if (k_from_x)
    TORCH_CHECK(*k_from_x == k, "x has ", *k_from_x, " features but the ", bits,
                "-bit qweight ", qweight.sizes(), " holds K = ", k);
  TORCH_CHECK(k % kBlock == 0, "K must be a multiple of 32, got ", k);
  TORCH_CHECK(group > 0 && k % group == 0, "group_size ", group, " must divide K = ", k);
  const int64_t unit = bits == 8 ? 16 : 32;
  TORCH_CHECK(group % unit == 0, "bits ", bits, ": group_size must be a multiple of ", unit,
              ", got ", group);
  const int64_t groups = k / group;
  TORCH_CHECK(scales.scalar_type() == at::kHalf, "scales must be float16, got ",
              scales.scalar_type());
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == n && scales.size(1) == groups,
              "scales must be [N, K/group_size] = [", n, ", ", groups, "], got ", scales.sizes());
  if (mins) {
    TORCH_CHECK(mins->device().is_cpu(), "quantized weights: tensors must be on the CPU");
    TORCH_CHECK(mins->scalar_type() == at::kHalf, "mins must be float16, got ",
                mins->scalar_type());
    TORCH_CHECK(mins->dim() == 2 && mins->size(0) == n && mins->size(1) == groups,
                "mins must be [N, K/group_size] = [", n, ", ", groups, "], got ", mins->sizes());
  }
  return Weight{reinterpret_cast<const uint8_t*>(qweight.data_ptr()),
                scales.data_ptr<at::Half>(),
                mins ? mins->data_ptr<at::Half>() : nullptr,
                n, k, bits, group, groups, qweight.size(1)};
}

}  // namespace

// x [M, K] float32 or bfloat16 -> x @ W.T [M, N] in x's dtype; M < dense_from_rows takes the
// integer path (int8 x for 4-bit weights, int16 x for int8 ones), larger M the
// dequantize-and-GEMM one. Inference only: no gradient.
at::Tensor quant_linear(at::Tensor x, at::Tensor qweight, at::Tensor scales,
                        std::optional<at::Tensor> mins, int64_t bits, int64_t group_size,
                        int64_t dense_from_rows) {
  at::NoGradGuard no_grad;
  TORCH_CHECK(x.device().is_cpu(), "quant_linear: x must be on the CPU");
  TORCH_CHECK(x.dim() == 2, "quant_linear: x must be 2-D [M, K], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "quant_linear: x must be float32 or bfloat16, got ", x.scalar_type());
  auto qw = qweight.contiguous();
  auto sc = scales.contiguous();
  std::optional<at::Tensor> mn;
  if (mins) mn = mins->contiguous();
  const Weight w = check_weight(qw, sc, mn, bits, group_size, x.size(1));
  auto xc = x.contiguous();
  if (xc.size(0) >= dense_from_rows && xc.size(0) > 0 && w.n > 0) return dense_linear(xc, w);
  auto y = at::empty({xc.size(0), w.n}, xc.options());
  if (xc.size(0) == 0 || w.n == 0) return y;
  if (xc.scalar_type() == at::kFloat)
    int_linear<float>(xc, w, y);
  else
    int_linear<at::BFloat16>(xc, w, y);
  return y;
}

// The dense [N, K] weight in dtype (float32, bfloat16 or float16).
at::Tensor quant_dequantize(at::Tensor qweight, at::Tensor scales, std::optional<at::Tensor> mins,
                            int64_t bits, int64_t group_size, at::ScalarType dtype) {
  auto qw = qweight.contiguous();
  auto sc = scales.contiguous();
  std::optional<at::Tensor> mn;
  if (mins) mn = mins->contiguous();
  const Weight w = check_weight(qw, sc, mn, bits, group_size, std::nullopt);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "quant_dequantize: dtype must be float32, bfloat16 or float16, got ", dtype);
  auto out = at::empty({w.n, w.k}, qw.options().dtype(dtype));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "quant_dequantize", [&] {
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, w.n, 16, [&](int64_t begin, int64_t end) {
      dequant_rows(w, begin, end, dst + begin * w.k);
    });
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(infer, m) {
  m.def(
      "quant_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, int bits, "
      "int group_size, int dense_from_rows) -> Tensor",
      &quant_linear);
  m.def(
      "quant_dequantize(Tensor qweight, Tensor scales, Tensor? mins, int bits, int group_size, "
      "ScalarType dtype) -> Tensor",
      &quant_dequantize);
}
