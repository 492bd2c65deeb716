// The quantized weight as the kernels see it (infer-quantized-v1: see quant_linear.cpp) and
// the float conversions every path shares.
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

namespace {

constexpr int64_t kBlock = 32;  // activation quantization block (and 4-bit packing chunk)
// Super-blocks (GGUF Q4_K / Q6_K kept whole, group_size 256): a row holds, per 256 k's, the
// values in the 4-bit (6-bit) layout and then the sub-block scales as bytes: Q4_K 128 bytes
// of nibbles + 8 scales + 8 mins (u8, 0..63), W = q * (d * sc) + dmin' * m with the
// weight's scales = d and mins = dmin' = -dmin per super-block; Q6_K 192 bytes (two 6-bit
// runs of 128, quant_six.h) + 16 int8 scales, W = (u - 32) * (d * sc). d * sc is exact in
// float32: the file's weights to the bit, in the file's bytes.
constexpr int64_t kSuper = 256, kSuper4Bytes = 144, kSuper6Bytes = 208;

// The checked weight arguments as raw pointers.
struct Weight {
  const uint8_t* q;       // row-major; int8 bytes for bits 8, packed nibbles for bits 4
  const at::Half* scales; // [n, groups]
  const at::Half* mins;   // [n, groups] or nullptr
  int64_t n, k, bits, group, groups, row_bytes;
  bool super = false;  // super-blocks (above)

  const uint8_t* row(int64_t r) const { return q + r * row_bytes; }
  // k's one float scale covers once the sub-block scales are expanded (expand_scales)
  int64_t unit() const { return super ? (bits == 4 ? kBlock : 16) : group; }
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

// Row n's scales and mins as floats, one per unit() k's (k / unit() of each): the float16
// ones of a block format, or a super-block format's d * sub-block scale (and dmin' * m).
inline void expand_scales(const Weight& w, int64_t n, float* scale, float* min) {
  if (!w.super) {
    halves_to_floats(w.scales + n * w.groups, scale, w.groups);
    if (w.mins != nullptr)
      halves_to_floats(w.mins + n * w.groups, min, w.groups);
    else
      std::fill(min, min + w.groups, 0.0f);
    return;
  }
  const uint8_t* q = w.row(n);
  for (int64_t sb = 0; sb < w.groups; ++sb) {
    const float d = static_cast<float>(w.scales[n * w.groups + sb]);
    if (w.bits == 4) {
      const float dmin = static_cast<float>(w.mins[n * w.groups + sb]);
      const uint8_t* sub = q + sb * kSuper4Bytes + 128;
      for (int i = 0; i < 8; ++i) {
        scale[sb * 8 + i] = d * static_cast<float>(sub[i]);
        min[sb * 8 + i] = dmin * static_cast<float>(sub[8 + i]);
      }
    } else {
      const auto* sub = reinterpret_cast<const int8_t*>(q + sb * kSuper6Bytes + 192);
      for (int i = 0; i < 16; ++i) {
        scale[sb * 16 + i] = d * static_cast<float>(sub[i]);
        min[sb * 16 + i] = 0.0f;
      }
    }
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// The bfloat16 of each float32 lane, in its low 16 bits, rounded as c10::BFloat16 rounds
// (to nearest even; NaN to 0x7FC0). decode_layer.cpp's elementwise loops use it too.
inline __m512i bf16_bits(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r =
      _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb)), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}
#endif

// float32 -> bfloat16 for a run of values, rounded as c10::BFloat16 rounds (to nearest
// even; NaN to 0x7FC0), 16 or 8 at a time with integer vector ops: the scalar conversion
// took most of the dense path's dequantization time.
inline void floats_to_bf16(const float* src, at::BFloat16* dst, int64_t count) {
  int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  for (; i + 16 <= count; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm512_cvtepi32_epi16(bf16_bits(_mm512_loadu_ps(src + i))));
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

}  // namespace
