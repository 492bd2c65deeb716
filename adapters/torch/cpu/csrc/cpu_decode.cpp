// CPU kernels for bf16 inference (AVX512-BF16). A decode step of a small model is bound by
// reading its weights and KV cache and by per-op dispatch: a matrix product on panel-packed
// weights that streams them once per call, single calls for RMSNorm and SiLU gating (which
// PyTorch runs as ~9 and ~4 small ops), causal GQA attention over the bf16 cache for decode
// rows and prompt chunks, the decode step's cache writes, and a vectorized argmax. Results
// round like the PyTorch path.
#include <torch/extension.h>
#include <immintrin.h>
#include <omp.h>
#include <algorithm>
#include <functional>
#include <memory>
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

inline uint32_t float_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  return b;
}

const uint16_t* bits(const torch::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
}

uint16_t* bits_mut(torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

void check_bf16(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16 && t.is_contiguous(),
              name, " must be a contiguous bf16 CPU tensor");
}

// bf16 CPU tensor whose last dimension is contiguous (other dimensions may be strided).
void check_bf16_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16 && t.dim() == 4 &&
                  t.stride(3) == 1,
              name, " must be a 4-d bf16 CPU tensor with a contiguous last dimension");
}

// The output of a linear on x [..., in]: [..., out], x's dtype and device.
torch::Tensor linear_output(const torch::Tensor& x, int64_t out) {
  auto sizes = x.sizes().vec();
  sizes.back() = out;
  return torch::empty(sizes, x.options());
}

constexpr int64_t kMinSplitKeys = 128;  // keys per piece, at least, when decode splits a row's keys
constexpr int64_t kKeyBlock = 16;  // keys per rearranged block of the prompt path
constexpr int64_t kPartPairs = 1024;  // gemm_packed: k-pairs per part of a long panel (256 KiB)
constexpr int64_t kPanel = 64;  // output columns per gemm_packed panel: 4 vectors of 16
constexpr int64_t kRowBlockBytes = 256 * 1024;  // gemm_packed's inputs per row block

}  // namespace

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

// In place: s[0..n) -> exp(s - max), vectorized (the tail is padded with -inf by a mask);
// returns the sum, and the max in *top_out.
float exp_inplace(float* s, int64_t n, float* top_out) {
  __m512 best = _mm512_set1_ps(-INFINITY);
  for (int64_t l = 0; l < n; l += 16) {
    const __mmask16 m = n - l >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - l)) - 1);
    best = _mm512_max_ps(best, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m, s + l));
  }
  *top_out = _mm512_reduce_max_ps(best);
  const __m512 top = _mm512_set1_ps(*top_out);
  __m512 total = _mm512_setzero_ps();
  for (int64_t l = 0; l < n; l += 16) {
    const __mmask16 m = n - l >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - l)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(m, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + l), top)));
    _mm512_mask_storeu_ps(s + l, m, e);
    total = _mm512_add_ps(total, e);
  }
  return _mm512_reduce_add_ps(total);
}

// In place: s[0..n) -> softmax(s).
void softmax_inplace(float* s, int64_t n) {
  float top;
  const __m512 inv = _mm512_set1_ps(1.f / exp_inplace(s, n, &top));
  for (int64_t l = 0; l < n; l += 16) {
    const __mmask16 m = n - l >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - l)) - 1);
    _mm512_mask_storeu_ps(s + l, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, s + l), inv));
  }
}

// out[h][d] = sum_l p[h][l] v[l][d] for G heads sharing values v [n, dim] (bf16 rows): per
// block of 64 columns, each value row is loaded once for all G heads, with the G x 4
// accumulators in registers.
template <int G>
void weighted_values(const float* p, int64_t p_stride, const uint16_t* v, int64_t n, int64_t dim,
                     uint16_t* out, int64_t out_stride, float* out_f32) {
  for (int64_t d0 = 0; d0 < dim; d0 += 64) {
    const int chunks = static_cast<int>(std::min<int64_t>(4, (dim - d0) / 16));
    __m512 acc[G][4];
    for (int h = 0; h < G; ++h)
      for (int c = 0; c < 4; ++c) acc[h][c] = _mm512_setzero_ps();
    if (chunks == 4) {
      for (int64_t l = 0; l < n; ++l) {
        const uint16_t* row = v + l * dim + d0;
        const __m512 v0 = load_bf16x16(row), v1 = load_bf16x16(row + 16);
        const __m512 v2 = load_bf16x16(row + 32), v3 = load_bf16x16(row + 48);
        for (int h = 0; h < G; ++h) {
          const __m512 w = _mm512_set1_ps(p[h * p_stride + l]);
          acc[h][0] = _mm512_fmadd_ps(w, v0, acc[h][0]);
          acc[h][1] = _mm512_fmadd_ps(w, v1, acc[h][1]);
          acc[h][2] = _mm512_fmadd_ps(w, v2, acc[h][2]);
          acc[h][3] = _mm512_fmadd_ps(w, v3, acc[h][3]);
        }
      }
    } else {  // a 32-column tail (head_dim % 64 == 32)
      for (int64_t l = 0; l < n; ++l) {
        const uint16_t* row = v + l * dim + d0;
        const __m512 v0 = load_bf16x16(row), v1 = load_bf16x16(row + 16);
        for (int h = 0; h < G; ++h) {
          const __m512 w = _mm512_set1_ps(p[h * p_stride + l]);
          acc[h][0] = _mm512_fmadd_ps(w, v0, acc[h][0]);
          acc[h][1] = _mm512_fmadd_ps(w, v1, acc[h][1]);
        }
      }
    }
    for (int h = 0; h < G; ++h)
      for (int c = 0; c < chunks; ++c) {
        if (out_f32 != nullptr)
          _mm512_storeu_ps(out_f32 + h * out_stride + d0 + c * 16, acc[h][c]);
        else
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + h * out_stride + d0 + c * 16),
                              reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(acc[h][c])));
      }
  }
}

// For any group size; rows of `out` (bf16), or of `out_f32` (float32, unrounded) when given.
void weighted_values_any(int64_t group, const float* p, int64_t p_stride, const uint16_t* v,
                         int64_t n, int64_t dim, uint16_t* out, int64_t out_stride, float* out_f32 = nullptr) {
  for (int64_t h0 = 0; h0 < group; h0 += 4) {
    const float* ph = p + h0 * p_stride;
    uint16_t* oh = out == nullptr ? nullptr : out + h0 * out_stride;
    float* fh = out_f32 == nullptr ? nullptr : out_f32 + h0 * out_stride;
    switch (std::min<int64_t>(4, group - h0)) {
      case 1: weighted_values<1>(ph, p_stride, v, n, dim, oh, out_stride, fh); break;
      case 2: weighted_values<2>(ph, p_stride, v, n, dim, oh, out_stride, fh); break;
      case 3: weighted_values<3>(ph, p_stride, v, n, dim, oh, out_stride, fh); break;
      default: weighted_values<4>(ph, p_stride, v, n, dim, oh, out_stride, fh); break;
    }
  }
}

// Sums of 16 vectors, as one vector: lane i = sum of the 16 lanes of v[i]. A transpose-and-add
// tree (45 ops) instead of 16 horizontal reductions (~8 ops each).
inline __m512 sum16(const __m512* v) {
  __m512 t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i)
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 2; ++i)
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// s[l] = scale * q . k[l] for l in [0, n): q [dim] bf16, k [n, dim] bf16 rows, 16 keys at a time.
// When given, the rows of `ahead` [n, dim] (the values, read next) are prefetched alongside:
// a second memory stream in flight while the keys are scored.
void dot_scores(const uint16_t* q, const uint16_t* k, int64_t n, int64_t dim, float scale, float* s,
                const uint16_t* ahead) {
  const int64_t chunks = dim / 32;
  for (int64_t l0 = 0; l0 < n; l0 += 16) {
    const int64_t keys = std::min<int64_t>(16, n - l0);
    if (ahead != nullptr) {
      const char* first = reinterpret_cast<const char*>(ahead + l0 * dim);
      for (int64_t byte = 0; byte < keys * dim * 2; byte += 64) _mm_prefetch(first + byte, _MM_HINT_T0);
      // and the keys two blocks ahead
      const int64_t next = std::min<int64_t>(16, std::max<int64_t>(0, n - l0 - 32));
      const char* later = reinterpret_cast<const char*>(k + (l0 + 32) * dim);
      for (int64_t byte = 0; byte < next * dim * 2; byte += 64) _mm_prefetch(later + byte, _MM_HINT_T0);
    }
    __m512 acc[16];
    for (int64_t j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      const __m512bh qv = reinterpret_cast<__m512bh>(_mm512_loadu_si512(q + c * 32));
      for (int64_t j = 0; j < keys; ++j) {
        const __m512bh kv = reinterpret_cast<__m512bh>(_mm512_loadu_si512(k + (l0 + j) * dim + c * 32));
        acc[j] = _mm512_dpbf16_ps(acc[j], qv, kv);
      }
    }
    const __m512 sums = _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale));
    const __mmask16 m = keys == 16 ? 0xFFFF : static_cast<__mmask16>((1u << keys) - 1);
    _mm512_mask_storeu_ps(s + l0, m, sums);
  }
}

// Prompt chunks (T > 1) as flash attention does them, two passes per query over keys
// rearranged once per call (each key block serves every query of the chunk):
//  kt: per block of 16 keys, [dim / 2][16] words: word (d2, j) = key j's dims (2 d2, 2 d2 + 1),
//      so a query's 16 scores are dim / 2 vdpbf16ps with its dim pair broadcast (no reduction);
//  vp: per pair of keys, [dim / 16][16] words: word (c, i) = dim 16 c + i of both keys, so
//      P @ V takes one vdpbf16ps per 16 dims per two keys, P rounded to bf16 for it (as flash
//      attention feeds its P @ V matmul).
void rearrange_block(const uint16_t* k, const uint16_t* v, int64_t row, int64_t keys, int64_t dim,
                     uint32_t* kt, uint32_t* vp) {
  const int64_t pairs = dim / 2, chunks = dim / 16;
  for (int64_t j = 0; j < kKeyBlock; ++j) {
    const uint32_t* kr = reinterpret_cast<const uint32_t*>(k + j * row);
    for (int64_t d2 = 0; d2 < pairs; ++d2) kt[d2 * kKeyBlock + j] = j < keys ? kr[d2] : 0;
  }
  for (int64_t p = 0; p < kKeyBlock / 2; ++p) {
    const int64_t l0 = 2 * p, l1 = l0 + 1;
    for (int64_t c = 0; c < chunks; ++c) {
      const __m512i a = l0 < keys ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + l0 * row + c * 16)))
                                  : _mm512_setzero_si512();
      const __m512i b = l1 < keys ? _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + l1 * row + c * 16))), 16)
                                  : _mm512_setzero_si512();
      _mm512_storeu_si512(vp + (p * chunks + c) * 16, _mm512_or_si512(a, b));
    }
  }
}

// out[g] = p[g] @ V over `blocks` rearranged key blocks, for G rows of one KV group (p[g]: 16
// probabilities per block, zero outside the row's keys): each value word loaded once for all.
template <int G>
void pv_blocks(const float* const* p, const uint32_t* vp, int64_t blocks, int64_t dim, uint16_t* const* out) {
  const int64_t chunks = dim / 16;
  for (int64_t c0 = 0; c0 < chunks; c0 += 4) {
    const int64_t width = std::min<int64_t>(4, chunks - c0);  // 4, or 2 for a 32-column tail
    __m512 acc[G][4];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < 4; ++c) acc[g][c] = _mm512_setzero_ps();
    for (int64_t blk = 0; blk < blocks; ++blk) {
      alignas(32) uint32_t pp[G][8];
      for (int g = 0; g < G; ++g)
        _mm256_store_si256(reinterpret_cast<__m256i*>(pp[g]),
                           reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(p[g] + blk * kKeyBlock))));
      const uint32_t* vb = vp + blk * (kKeyBlock / 2) * chunks * 16;
      for (int64_t j = 0; j < kKeyBlock / 2; ++j) {
        const uint32_t* vr = vb + (j * chunks + c0) * 16;
        if (width == 4) {
          const __m512bh v0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(vr));
          const __m512bh v1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(vr + 16));
          const __m512bh v2 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(vr + 32));
          const __m512bh v3 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(vr + 48));
          for (int g = 0; g < G; ++g) {
            const __m512bh w = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pp[g][j]));
            acc[g][0] = _mm512_dpbf16_ps(acc[g][0], w, v0);
            acc[g][1] = _mm512_dpbf16_ps(acc[g][1], w, v1);
            acc[g][2] = _mm512_dpbf16_ps(acc[g][2], w, v2);
            acc[g][3] = _mm512_dpbf16_ps(acc[g][3], w, v3);
          }
        } else {
          const __m512bh v0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(vr));
          const __m512bh v1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(vr + 16));
          for (int g = 0; g < G; ++g) {
            const __m512bh w = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pp[g][j]));
            acc[g][0] = _mm512_dpbf16_ps(acc[g][0], w, v0);
            acc[g][1] = _mm512_dpbf16_ps(acc[g][1], w, v1);
          }
        }
      }
    }
    for (int g = 0; g < G; ++g)
      for (int64_t c = 0; c < width; ++c)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[g] + (c0 + c) * 16),
                            reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(acc[g][c])));
  }
}

// Scores of R query rows (q[r]: dim / 2 words; the rows may mix queries and heads of one KV
// group) against NB consecutive rearranged key blocks (keys `first` .. first + 16 NB): each
// block's words are loaded once for all R rows and every loaded q word feeds NB products, with
// the R x NB accumulators in registers (a broadcast per product made Q @ K load-bound). Row
// r's keys outside [start[r], end[r]) get -inf; s[r] + at receives its 16 NB scores.
template <int R, int NB>
inline void qk_tile(const uint32_t* const* q, const uint32_t* kt, int64_t pairs, float scale, int64_t first,
                    const int64_t* start, const int64_t* end, float* const* s, int64_t at) {
  __m512 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NB; ++n) acc[r][n] = _mm512_setzero_ps();
  const int64_t block_words = kKeyBlock * pairs;
  for (int64_t d2 = 0; d2 < pairs; ++d2) {
    __m512bh kv[NB];
    for (int n = 0; n < NB; ++n)
      kv[n] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(kt + n * block_words + d2 * kKeyBlock));
    for (int r = 0; r < R; ++r) {
      const __m512bh w = reinterpret_cast<__m512bh>(_mm512_set1_epi32(q[r][d2]));
      for (int n = 0; n < NB; ++n) acc[r][n] = _mm512_dpbf16_ps(acc[r][n], w, kv[n]);
    }
  }
  const __m512 minus_inf = _mm512_set1_ps(-INFINITY), sc = _mm512_set1_ps(scale);
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NB; ++n) {
      const int64_t f = first + n * kKeyBlock;
      const int64_t from = std::clamp<int64_t>(start[r] - f, 0, kKeyBlock);
      const int64_t to = std::clamp<int64_t>(end[r] - f, 0, kKeyBlock);
      const __mmask16 valid = from >= to ? 0 : static_cast<__mmask16>(((1u << to) - 1) & ~((1u << from) - 1));
      _mm512_storeu_ps(s[r] + at + n * kKeyBlock, _mm512_mask_mul_ps(minus_inf, valid, acc[r][n], sc));
    }
}

// R query rows of one KV group (any mix of queries and heads; row r attends keys [start[r],
// end[r])): scores over the union of their key blocks (block 0 of the rearranged keys at
// position `base`) four blocks at a time, a softmax per row, then P @ V for all R rows at once.
template <int R>
void prompt_rows(const uint32_t* const* q, const uint32_t* kt, const uint32_t* vp, int64_t base,
                 const int64_t* start, const int64_t* end, int64_t dim, float scale, float* scores,
                 int64_t s_stride, uint16_t* const* out) {
  int64_t first_key = start[0], last_end = end[0];
  for (int r = 1; r < R; ++r) {
    first_key = std::min(first_key, start[r]);
    last_end = std::max(last_end, end[r]);
  }
  const int64_t lo = (first_key - base) / kKeyBlock, hi = (last_end - base + kKeyBlock - 1) / kKeyBlock;
  const int64_t pairs = dim / 2, block_words = kKeyBlock * pairs;
  float* s[R];
  const float* p[R];
  for (int r = 0; r < R; ++r) s[r] = scores + r * s_stride;
  int64_t blk = lo;
  for (; blk + 4 <= hi; blk += 4)
    qk_tile<R, 4>(q, kt + blk * block_words, pairs, scale, base + blk * kKeyBlock, start, end, s, blk * kKeyBlock);
  for (; blk < hi; ++blk)
    qk_tile<R, 1>(q, kt + blk * block_words, pairs, scale, base + blk * kKeyBlock, start, end, s, blk * kKeyBlock);
  for (int r = 0; r < R; ++r) {
    softmax_inplace(s[r] + lo * kKeyBlock, (hi - lo) * kKeyBlock);
    p[r] = s[r] + lo * kKeyBlock;
  }
  pv_blocks<R>(p, vp + lo * block_words, hi - lo, dim, out);
}

// Causal attention over a bf16 cache, heads grouped per KV head (GQA), for decode (T = 1) and
// prefill (T > 1) alike: q [B, H, T, D] bf16; k, v [B, Hkv, L, D] bf16 with contiguous rows
// (views of the cache). Query t of row b sits at position len_b - T + t, where len_b =
// lengths[b] (lengths holds B values, or one for every row; L when empty), and attends keys
// [start, position] with start = max(0, position - window + 1) for a sliding window
// (window > 0), else 0. Returns [B, H, T, D] bf16, a transposed view of a contiguous
// [B, T, H, D] (what the output projection reads); scores and softmax in float32. Prompt
// chunks rearrange their keys and values once and take P @ V with P in bf16 (rearrange_block);
// decode rows (each row's cache read once, no rearranging to amortize) score 16 keys at a
// time with a transpose-and-add reduction and take P @ V in float32.
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const torch::Tensor& lengths, int64_t window, double scale) {
  check_bf16_rows(q, "q");
  check_bf16_rows(k, "k");
  check_bf16_rows(v, "v");
  const int64_t batch = q.size(0), heads = q.size(1), queries = q.size(2), dim = q.size(3);
  const int64_t kv_heads = k.size(1), max_len = k.size(2);
  TORCH_CHECK(k.size(0) == batch && v.sizes() == k.sizes() && k.size(3) == dim &&
                  heads % kv_heads == 0 && dim % 32 == 0,
              "attention: q [B, H, T, D], k/v [B, Hkv, L, D], D % 32 == 0");
  TORCH_CHECK(k.stride(2) == dim && v.stride(2) == dim, "attention: k/v rows must be contiguous");
  const int64_t given = lengths.numel();
  TORCH_CHECK(given == 0 || ((given == batch || given == 1) && lengths.scalar_type() == at::kLong &&
                             lengths.is_contiguous()),
              "attention: lengths must be int64 [B] or [1]");
  const int64_t* lens = given ? lengths.data_ptr<int64_t>() : nullptr;
  auto out = torch::empty({batch, queries, heads, dim}, q.options());
  const uint16_t* Q = bits(q);
  const uint16_t* K = bits(k);
  const uint16_t* V = bits(v);
  uint16_t* O = bits_mut(out);
  const int64_t group = heads / kv_heads;
  const int64_t s_stride = (max_len + 15) / 16 * 16;
  const float fscale = static_cast<float>(scale);
  if (queries > 1) {
    // Row b's keys from `base` (the first query's first key, block-aligned) rearranged once.
    const int64_t block_words = kKeyBlock * dim / 2;  // a rearranged block, in kt or vp
    std::vector<int64_t> len(batch), base(batch), blocks(batch), offset(batch + 1, 0);
    for (int64_t b = 0; b < batch; ++b) {
      len[b] = lens ? std::min(lens[given == 1 ? 0 : b], max_len) : max_len;
      const int64_t first_end = len[b] - queries + 1;
      base[b] = (window > 0 ? std::max<int64_t>(0, first_end - window) : 0) / kKeyBlock * kKeyBlock;
      blocks[b] = std::max<int64_t>(0, (len[b] - base[b] + kKeyBlock - 1) / kKeyBlock);
      offset[b + 1] = offset[b] + kv_heads * blocks[b] * block_words;  // of kt (and of vp)
    }
    // every word is written by rearrange_block before it is read
    std::unique_ptr<uint32_t[]> kt(new uint32_t[offset[batch]]), vp(new uint32_t[offset[batch]]);
#pragma omp parallel
    {
      for (int64_t b = 0; b < batch; ++b) {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < kv_heads * blocks[b]; ++i) {
          const int64_t g = i / blocks[b], blk = i % blocks[b], first = base[b] + blk * kKeyBlock;
          const int64_t at = offset[b] + i * block_words;
          rearrange_block(K + b * k.stride(0) + g * k.stride(1) + first * dim,
                          V + b * v.stride(0) + g * v.stride(1) + first * dim, dim,
                          std::min<int64_t>(kKeyBlock, len[b] - first), dim, kt.get() + at, vp.get() + at);
        }
      }
      // Tiles of consecutive queries whose (query, head) rows of one KV group, at most
      // kMaxRows, share each key block load (a group of more heads than that: one query per
      // tile, its heads in several calls).
      constexpr int64_t kMaxRows = 6;
      const int64_t per_tile = group >= kMaxRows ? 1 : kMaxRows / group;
      const int64_t tiles = (queries + per_tile - 1) / per_tile;
      std::vector<float> scores(kMaxRows * s_stride);
#pragma omp for schedule(dynamic) collapse(3)
      for (int64_t b = 0; b < batch; ++b) {
        for (int64_t g = 0; g < kv_heads; ++g) {
          for (int64_t tile = 0; tile < tiles; ++tile) {
            const uint32_t* qs[kMaxRows];
            uint16_t* os[kMaxRows];
            int64_t starts[kMaxRows], ends[kMaxRows];
            int64_t count = 0;
            const uint32_t* ktb = kt.get() + offset[b] + g * blocks[b] * block_words;
            const uint32_t* vpb = vp.get() + offset[b] + g * blocks[b] * block_words;
            auto flush = [&]() {
              switch (count) {
                case 1: prompt_rows<1>(qs, ktb, vpb, base[b], starts, ends, dim, fscale, scores.data(), s_stride, os); break;
                case 2: prompt_rows<2>(qs, ktb, vpb, base[b], starts, ends, dim, fscale, scores.data(), s_stride, os); break;
                case 3: prompt_rows<3>(qs, ktb, vpb, base[b], starts, ends, dim, fscale, scores.data(), s_stride, os); break;
                case 4: prompt_rows<4>(qs, ktb, vpb, base[b], starts, ends, dim, fscale, scores.data(), s_stride, os); break;
                case 5: prompt_rows<5>(qs, ktb, vpb, base[b], starts, ends, dim, fscale, scores.data(), s_stride, os); break;
                case 6: prompt_rows<6>(qs, ktb, vpb, base[b], starts, ends, dim, fscale, scores.data(), s_stride, os); break;
                default: break;
              }
              count = 0;
            };
            for (int64_t t = tile * per_tile; t < std::min(queries, (tile + 1) * per_tile); ++t) {
              const int64_t end = len[b] - queries + t + 1;
              const int64_t start = window > 0 ? std::max<int64_t>(0, end - window) : 0;
              uint16_t* o = O + ((b * queries + t) * heads + g * group) * dim;
              if (end <= start) {
                std::fill(o, o + group * dim, 0);
                continue;
              }
              for (int64_t h = 0; h < group; ++h) {
                qs[count] = reinterpret_cast<const uint32_t*>(Q + b * q.stride(0) + (g * group + h) * q.stride(1) + t * q.stride(2));
                os[count] = o + h * dim;
                starts[count] = start;
                ends[count] = end;
                if (++count == kMaxRows) flush();
              }
            }
            flush();
          }
        }
      }
    }
    return out.transpose(1, 2);
  }
  // Decode: one query per row.
  const int64_t pairs = batch * kv_heads, threads = omp_get_max_threads();
  int64_t longest = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t end = lens ? std::min(lens[given == 1 ? 0 : b], max_len) : max_len;
    longest = std::max(longest, window > 0 ? std::min(end, window) : end);
  }
  const int64_t splits = pairs >= 2 * threads ? 1 : std::min((2 * threads + pairs - 1) / pairs, longest / kMinSplitKeys);
  if (splits > 1) {
    // Fewer (row, KV head) pairs than twice the threads (one long conversation; Gemma's
    // single KV head): each pair's keys in `splits` pieces, merged as flash decoding does.
    // Per piece and head: [max score, sum of exp(score - max), unnormalized P @ V (float32)].
    const int64_t record = dim + 2;
    std::vector<float> part(pairs * splits * group * record);
#pragma omp parallel
    {
      std::vector<float> scores(group * s_stride);
#pragma omp for schedule(static) collapse(3)
      for (int64_t b = 0; b < batch; ++b) {
        for (int64_t g = 0; g < kv_heads; ++g) {
          for (int64_t c = 0; c < splits; ++c) {
            const int64_t end = lens ? std::min(lens[given == 1 ? 0 : b], max_len) : max_len;
            const int64_t start = window > 0 ? std::max<int64_t>(0, end - window) : 0;
            const int64_t n = std::max<int64_t>(0, end - start);
            const int64_t from = start + n * c / splits, count = start + n * (c + 1) / splits - from;
            float* rec = part.data() + ((b * kv_heads + g) * splits + c) * group * record;
            if (count == 0) {
              for (int64_t h = 0; h < group; ++h) {
                rec[h * record] = -INFINITY;
                rec[h * record + 1] = 0.f;
              }
              continue;
            }
            const uint16_t* kh = K + b * k.stride(0) + g * k.stride(1) + from * dim;
            const uint16_t* vh = V + b * v.stride(0) + g * v.stride(1) + from * dim;
            for (int64_t h = 0; h < group; ++h) {
              float* sh = scores.data() + h * s_stride;
              dot_scores(Q + b * q.stride(0) + (g * group + h) * q.stride(1), kh, count, dim, fscale, sh,
                         h == 0 ? vh : nullptr);
              rec[h * record + 1] = exp_inplace(sh, count, &rec[h * record]);
            }
            weighted_values_any(group, scores.data(), s_stride, vh, count, dim, nullptr, record, rec + 2);
          }
        }
      }
#pragma omp for schedule(static) collapse(2)
      for (int64_t b = 0; b < batch; ++b) {
        for (int64_t g = 0; g < kv_heads; ++g) {
          const float* recs = part.data() + (b * kv_heads + g) * splits * group * record;
          for (int64_t h = 0; h < group; ++h) {
            uint16_t* o = O + (b * heads + g * group + h) * dim;
            float top = -INFINITY;
            for (int64_t c = 0; c < splits; ++c) top = std::max(top, recs[(c * group + h) * record]);
            if (top == -INFINITY) {  // no keys at all
              std::fill(o, o + dim, 0);
              continue;
            }
            float total = 0.f;
            for (int64_t c = 0; c < splits; ++c) {
              const float* r = recs + (c * group + h) * record;
              total += r[1] * std::exp(r[0] - top);
            }
            for (int64_t d = 0; d < dim; d += 16) {
              __m512 acc = _mm512_setzero_ps();
              for (int64_t c = 0; c < splits; ++c) {
                const float* r = recs + (c * group + h) * record;
                if (r[1] == 0.f) continue;
                acc = _mm512_fmadd_ps(_mm512_set1_ps(std::exp(r[0] - top) / total), _mm512_loadu_ps(r + 2 + d), acc);
              }
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + d), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(acc)));
            }
          }
        }
      }
    }
    return out.transpose(1, 2);
  }
  // Rows cost about the same: contiguous static shares (each thread prefetches its next row).
#pragma omp parallel
  {
    std::vector<float> scores(group * s_stride);
#pragma omp for schedule(static) collapse(2)
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t g = 0; g < kv_heads; ++g) {
        const int64_t end = lens ? std::min(lens[given == 1 ? 0 : b], max_len) : max_len;  // keys [start, end)
        const int64_t start = window > 0 ? std::max<int64_t>(0, end - window) : 0;
        const int64_t n = std::max<int64_t>(0, end - start);
        const uint16_t* kh = K + b * k.stride(0) + g * k.stride(1) + start * dim;
        // the next row's keys start streaming now
        const int64_t nb = g + 1 < kv_heads ? b : b + 1, ng = g + 1 < kv_heads ? g + 1 : 0;
        if (nb < batch) {
          const char* next = reinterpret_cast<const char*>(K + nb * k.stride(0) + ng * k.stride(1));
          for (int64_t byte = 0; byte < 32 * dim * 2; byte += 64) _mm_prefetch(next + byte, _MM_HINT_T1);
        }
        const uint16_t* vh = V + b * v.stride(0) + g * v.stride(1) + start * dim;
        uint16_t* o = O + (b * heads + g * group) * dim;
        if (n == 0) {
          std::fill(o, o + group * dim, 0);
          continue;
        }
        for (int64_t h = 0; h < group; ++h) {
          const uint16_t* qh = Q + b * q.stride(0) + (g * group + h) * q.stride(1);
          float* s = scores.data() + h * s_stride;
          dot_scores(qh, kh, n, dim, fscale, s, h == 0 ? vh : nullptr);
          softmax_inplace(s, n);
        }
        weighted_values_any(group, scores.data(), s_stride, vh, n, dim, o, dim);
      }
    }
  }
  return out.transpose(1, 2);
}

// Weights for gemm_packed: w [N, K] -> [ceil(N / 64) panels, K / 2, 64, 2]: a panel holds 64
// output columns, each k-pair of a column adjacent (the operand layout of vdpbf16ps), zero
// columns past N. A panel is one contiguous stream.
torch::Tensor pack_panels(const torch::Tensor& w) {
  check_bf16(w, "w");
  const int64_t n_out = w.size(0), k_in = w.size(1);
  TORCH_CHECK(w.dim() == 2 && k_in % 2 == 0, "pack_panels: w [N, K] with an even K");
  const int64_t panels = (n_out + kPanel - 1) / kPanel;
  auto out = torch::zeros({panels, k_in / 2, kPanel, 2}, w.options());
  const uint32_t* W = reinterpret_cast<const uint32_t*>(bits(w));  // k-pairs
  uint32_t* O = reinterpret_cast<uint32_t*>(bits_mut(out));
  for (int64_t n = 0; n < n_out; ++n)
    for (int64_t k2 = 0; k2 < k_in / 2; ++k2)
      O[((n / kPanel) * (k_in / 2) + k2) * kPanel + n % kPanel] = W[n * (k_in / 2) + k2];
  return out;
}

// R input rows x one 64-column panel, over k-pairs [k_from, k_to): 4R accumulators stay in
// registers; per k-pair, 4 weight vectors are loaded once and each row's pair is broadcast.
// Over part of K, the float32 sums carry over in `partial` (R x 64) and y is written after
// the last part. `ahead_lines` cache lines from `ahead` are prefetched meanwhile.
template <int R>
inline void panel_tile(const uint16_t* x, int64_t k_in, const uint16_t* panel, uint16_t* y,
                       int64_t n_out, int64_t valid, const char* ahead, int64_t ahead_lines,
                       int64_t k_from, int64_t k_to, float* partial) {
  const int64_t pairs = k_in / 2;
  __m512 acc[R][4];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) acc[r][j] = k_from == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(partial + r * 64 + j * 16);
  const int32_t* xp = reinterpret_cast<const int32_t*>(x);
  const int64_t per = (ahead_lines + (k_to - k_from) - 1) / (k_to - k_from);
  for (int64_t k2 = k_from; k2 < k_to; ++k2) {
    const uint16_t* b = panel + k2 * 2 * kPanel;
    for (int64_t j = (k2 - k_from) * per, e = std::min(ahead_lines, j + per); j < e; ++j)
      _mm_prefetch(ahead + j * 64, _MM_HINT_T0);
    const __m512bh b0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b));
    const __m512bh b1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + 32));
    const __m512bh b2 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + 64));
    const __m512bh b3 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + 96));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(xp[r * pairs + k2]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], a, b2);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], a, b3);
    }
  }
  if (k_to < pairs) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) _mm512_storeu_ps(partial + r * 64 + j * 16, acc[r][j]);
    return;
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m256i rounded = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(acc[r][j]));
      if (valid >= (j + 1) * 16) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * n_out + j * 16), rounded);
      } else if (valid > j * 16) {  // the last panel of an N that is not a multiple of 64
        alignas(32) uint16_t tmp[16];
        _mm256_store_si256(reinterpret_cast<__m256i*>(tmp), rounded);
        std::memcpy(y + r * n_out + j * 16, tmp, (valid - j * 16) * sizeof(uint16_t));
      }
    }
}

// y = x @ w.T with w packed by pack_panels: x [..., K] (M rows, contiguous), K even. Each
// thread streams its share of the panels from memory once; a panel (64 columns x K) stays in
// the core's L2 while every group of 6 input rows runs over it. Every linear of a CPU bf16
// model runs here: for one row it streams the weights faster than a GEMV over [N, K] rows
// (one contiguous stream per thread), for the 16-64 rows of batched decoding it beats
// oneDNN by 1.2-1.6x on SmolLM2's shapes (on par on 1B models'), and for long prompts it is
// on par (~950 GFLOP/s here).
torch::Tensor gemm_packed(const torch::Tensor& x, const torch::Tensor& panels, int64_t n_out) {
  check_bf16(x, "x");
  check_bf16(panels, "panels");
  const int64_t k_in = panels.size(1) * 2, m_rows = x.numel() / k_in;
  TORCH_CHECK(panels.dim() == 4 && panels.size(2) == kPanel && x.size(-1) == k_in &&
                  n_out <= panels.size(0) * kPanel && n_out > (panels.size(0) - 1) * kPanel,
              "gemm_packed: x [..., K], panels from pack_panels(w [N, K]), n_out = N");
  auto y = linear_output(x, n_out);
  const uint16_t* P = bits(panels);
  const uint16_t* X = bits(x);
  uint16_t* Y = bits_mut(y);
  const int64_t count = panels.size(0), panel_size = k_in * kPanel;
  // Row blocks whose inputs fit in L2 beside a panel (one block for decode-sized inputs;
  // each further block streams the weights again, which a long prompt's arithmetic hides).
  const int64_t blocks = std::max<int64_t>(1, (m_rows * k_in * 2 + kRowBlockBytes - 1) / kRowBlockBytes);
  const int64_t block_rows = ((m_rows + blocks - 1) / blocks + 5) / 6 * 6;
#pragma omp parallel
  {
  std::vector<float> partial(k_in / 2 > 2 * kPartPairs ? block_rows * 64 : 0);  // parts only
  for (int64_t b0 = 0; b0 < m_rows; b0 += block_rows) {
    const int64_t b1 = std::min(m_rows, b0 + block_rows);
#pragma omp for schedule(static)
    for (int64_t p = 0; p < count; ++p) {
      const int64_t valid = std::min<int64_t>(kPanel, n_out - p * kPanel);
      const uint16_t* panel = P + p * panel_size;
      uint16_t* yp = Y + p * kPanel;
      // The first row group waits on this panel's stream from memory; the later ones run from
      // L2, so they prefetch the next panel meanwhile, a share each (memory and arithmetic
      // overlap: 64 rows 17.6 -> 15.6 ms for all of SmolLM2's linears). Only from two full
      // helper groups on: one group prefetching a whole panel stalls on it (12-16 rows: 7% slower).
      // A panel past L2's share (long K: an MLP's down projection) is taken in parts, every
      // row group over one part before the next, the sums carried in `partial`; the next
      // part (or panel) is what the later row groups prefetch.
      const int64_t helpers = (b1 - b0) / 6 - 1, pairs = k_in / 2;
      const int64_t part = b1 - b0 > 6 && pairs > 2 * kPartPairs ? kPartPairs : pairs;
      for (int64_t k_from = 0; k_from < pairs; k_from += part) {
        const int64_t k_to = std::min(pairs, k_from + part);
        const bool last = k_to == pairs;
        const int64_t lines = (last ? panel_size : std::min(part, pairs - k_to) * 2 * kPanel) * 2 / 64;
        const int64_t share = helpers >= 2 && (!last || p + 1 < count) ? (lines + helpers - 1) / helpers : 0;
        const char* next = reinterpret_cast<const char*>(last ? panel + panel_size : panel + k_to * 2 * kPanel);
        int64_t m0 = b0;
        for (int64_t i = 0; m0 < b1; m0 += 6, ++i) {
          const char* ahead = next + (i - 1) * share * 64;
          const int64_t count_lines =
              i == 0 || i > helpers ? 0 : std::clamp<int64_t>(lines - (i - 1) * share, 0, share);
          uint16_t* yr = yp + m0 * n_out;
          const uint16_t* xr = X + m0 * k_in;
          float* pr = partial.empty() ? nullptr : partial.data() + (m0 - b0) * 64;
          switch (std::min<int64_t>(6, b1 - m0)) {
            case 6: panel_tile<6>(xr, k_in, panel, yr, n_out, valid, ahead, count_lines, k_from, k_to, pr); break;
            case 5: panel_tile<5>(xr, k_in, panel, yr, n_out, valid, ahead, count_lines, k_from, k_to, pr); break;
            case 4: panel_tile<4>(xr, k_in, panel, yr, n_out, valid, ahead, count_lines, k_from, k_to, pr); break;
            case 3: panel_tile<3>(xr, k_in, panel, yr, n_out, valid, ahead, count_lines, k_from, k_to, pr); break;
            case 2: panel_tile<2>(xr, k_in, panel, yr, n_out, valid, ahead, count_lines, k_from, k_to, pr); break;
            default: panel_tile<1>(xr, k_in, panel, yr, n_out, valid, ahead, count_lines, k_from, k_to, pr); break;
          }
        }
      }
    }
  }
  }
  return y;
}

// Per-row argmax of bf16 logits x [B, V] (contiguous rows): the first index of the maximum,
// as torch.argmax. PyTorch's bf16 argmax is scalar; this compares 16 lanes at a time.
torch::Tensor argmax_rows(const torch::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 &&
                  x.stride(1) == 1,
              "argmax_rows: x must be a 2-d bf16 CPU tensor with contiguous rows");
  const int64_t rows = x.size(0), vocab = x.size(1), stride = x.stride(0);
  auto out = torch::empty({rows}, x.options().dtype(at::kLong));
  const uint16_t* X = bits(x);
  int64_t* O = out.data_ptr<int64_t>();
  const int64_t vec_end = vocab / 16 * 16;
#pragma omp parallel for schedule(static) if (rows > 1)
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* row = X + r * stride;
    __m512 best = _mm512_set1_ps(-INFINITY);
    __m512i best_at = _mm512_setzero_si512();
    __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i step = _mm512_set1_epi32(16);
    for (int64_t i = 0; i < vec_end; i += 16) {
      const __m512 v = load_bf16x16(row + i);
      const __mmask16 better = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);  // strictly: first wins
      best = _mm512_mask_mov_ps(best, better, v);
      best_at = _mm512_mask_mov_epi32(best_at, better, at);
      at = _mm512_add_epi32(at, step);
    }
    alignas(64) float values[16];
    alignas(64) int32_t indices[16];
    _mm512_store_ps(values, best);
    _mm512_store_si512(indices, best_at);
    float top = -INFINITY;
    int64_t top_at = 0;
    for (int lane = 0; lane < 16; ++lane) {
      if (values[lane] > top || (values[lane] == top && indices[lane] < top_at)) {
        top = values[lane];
        top_at = indices[lane];
      }
    }
    for (int64_t i = vec_end; i < vocab; ++i) {
      const float v = bf16_to_float(row[i]);
      if (v > top) {
        top = v;
        top_at = i;
      }
    }
    O[r] = top_at;
  }
  return out;
}

// w[j] = probability p[j] in units of 2^-40 (p * 2^40 is exact in float32, then truncated, as
// the tensor pipeline's (probs * 2**40).long()), 0 where p[j] < keep_from; returns the sum.
int64_t fixed_point_weights(const float* p, int64_t n, float keep_from, int64_t* w) {
  const __m512 scale = _mm512_set1_ps(1099511627776.0f);  // 2^40
  const __m256 from = _mm256_set1_ps(keep_from);
  __m512i sum = _mm512_setzero_si512();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 v = _mm256_loadu_ps(p + j);
    const __mmask8 keep = _mm256_cmp_ps_mask(v, from, _CMP_GE_OQ);
    const __m512i wj = _mm512_maskz_cvttps_epi64(keep, _mm256_mul_ps(v, _mm512_castps512_ps256(scale)));
    _mm512_storeu_si512(w + j, wj);
    sum = _mm512_add_epi64(sum, wj);
  }
  int64_t total = _mm512_reduce_add_epi64(sum);
  for (; j < n; ++j) total += (w[j] = p[j] >= keep_from ? static_cast<int64_t>(p[j] * 1099511627776.0f) : 0);
  return total;
}

// Samples one token per row from logits [B, V] (float32 or bf16, contiguous rows) with the
// Sampler's pipeline and arithmetic (adapters/torch/sampler.py), one row per thread at a time
// instead of ~20 whole-batch tensor passes: temperature 0 -> the first maximal id; else
// top-k (values below the k-th largest dropped, ties kept; k <= 0 or >= V: off) ->
// softmax(logits / temperature) in float32 -> top-p (the most probable tokens whose mass
// first reaches top_p of the total, ties at the boundary kept; 1: off) -> min-p (below
// min_p x the top probability dropped) -> inverse-CDF draw with uniforms[b] in [0, 1) over
// the kept probabilities as integers in units of 2^-40 (exact, order-free sums), in id order.
torch::Tensor sample_rows(const torch::Tensor& logits, const torch::Tensor& temperature, const torch::Tensor& top_k,
                          const torch::Tensor& top_p, const torch::Tensor& min_p, const torch::Tensor& uniforms) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.stride(1) == 1 &&
                  (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16),
              "sample_rows: logits must be a 2-d float32 or bf16 CPU tensor with contiguous rows");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  for (const auto* t : {&temperature, &top_p, &min_p})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == rows, "sample_rows: float32 [B] parameters");
  TORCH_CHECK(top_k.scalar_type() == at::kLong && top_k.is_contiguous() && top_k.numel() == rows &&
                  uniforms.scalar_type() == at::kDouble && uniforms.is_contiguous() && uniforms.numel() == rows,
              "sample_rows: top_k int64 [B], uniforms float64 [B]");
  auto out = torch::empty({rows}, logits.options().dtype(at::kLong));
  const bool bf16 = logits.scalar_type() == at::kBFloat16;
  const float* T = temperature.data_ptr<float>();
  const int64_t* TK = top_k.data_ptr<int64_t>();
  const float* TP = top_p.data_ptr<float>();
  const float* MP = min_p.data_ptr<float>();
  const double* U = uniforms.data_ptr<double>();
  int64_t* O = out.data_ptr<int64_t>();
#pragma omp parallel
  {
    std::vector<float> x(vocab), tmp;
    std::vector<int64_t> w(vocab);
    std::vector<std::pair<float, int64_t>> nucleus;
#pragma omp for schedule(dynamic)
    for (int64_t r = 0; r < rows; ++r) {
      if (bf16) {
        const uint16_t* row = reinterpret_cast<const uint16_t*>(logits.data_ptr<at::BFloat16>()) + r * logits.stride(0);
        for (int64_t i = 0; i < vocab; ++i) x[i] = bf16_to_float(row[i]);
      } else {
        std::memcpy(x.data(), logits.data_ptr<float>() + r * logits.stride(0), vocab * sizeof(float));
      }
      float top = -INFINITY;
      int64_t top_at = 0;
      for (int64_t i = 0; i < vocab; ++i)
        if (x[i] > top) top = x[i], top_at = i;
      if (T[r] == 0.f || top == -INFINITY) {  // greedy (or nothing finite to sample from)
        O[r] = top_at;
        continue;
      }
      if (TK[r] > 0 && TK[r] < vocab) {
        // the k-th largest value: a 256-bin histogram of the values' top 8 bits (as ordered
        // integers) finds its bin; a selection among that bin's values finds it
        auto ordered = [](float f) {
          const uint32_t b = float_bits(f);
          return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
        };
        int64_t count[256] = {0};
        for (int64_t j = 0; j < vocab; ++j) ++count[ordered(x[j]) >> 24];
        int64_t bin = 255, above = 0;
        while (above + count[bin] < TK[r]) above += count[bin--];
        tmp.clear();
        for (int64_t j = 0; j < vocab; ++j)
          if (static_cast<int64_t>(ordered(x[j]) >> 24) == bin) tmp.push_back(x[j]);
        std::nth_element(tmp.begin(), tmp.begin() + (TK[r] - above - 1), tmp.end(), std::greater<float>());
        const float kth = tmp[TK[r] - above - 1];
        for (int64_t i = 0; i < vocab; ++i)
          if (x[i] < kth) x[i] = -INFINITY;
      }
      // softmax(x / T): exp((x - top) / T) / sum, in float32
      const __m512 mx = _mm512_set1_ps(top), inv_t = _mm512_set1_ps(1.f / T[r]);
      __m512 acc = _mm512_setzero_ps();
      int64_t i = 0;
      for (; i + 16 <= vocab; i += 16) {
        const __m512 e = exp512(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(&x[i]), mx), inv_t));
        _mm512_storeu_ps(&x[i], e);
        acc = _mm512_add_ps(acc, e);
      }
      float sum = _mm512_reduce_add_ps(acc);
      for (; i < vocab; ++i) sum += (x[i] = std::exp((x[i] - top) / T[r]));
      const float inv_sum = 1.f / sum;
      float best = 0.f;
      {
        const __m512 inv = _mm512_set1_ps(inv_sum);
        __m512 most = _mm512_setzero_ps();
        int64_t j = 0;
        for (; j + 16 <= vocab; j += 16) {
          const __m512 pj = _mm512_mul_ps(_mm512_loadu_ps(&x[j]), inv);
          _mm512_storeu_ps(&x[j], pj);
          most = _mm512_max_ps(most, pj);
        }
        best = _mm512_reduce_max_ps(most);
        for (; j < vocab; ++j) best = std::max(best, x[j] *= inv_sum);
      }
      float keep_from = MP[r] * best;  // min-p's floor (0 when off); top-p may raise it
      if (TP[r] < 1.f) {
        // The nucleus threshold: mass histograms over the probabilities' bit patterns (which
        // order like the values) find the bin where top_p of the mass is first reached —
        // exponent first, then the next 8 bits inside that binade — and only that bin's
        // values are sorted.
        int64_t hist[256] = {0};
        const int64_t total = fixed_point_weights(x.data(), vocab, 0.f, w.data());
        for (int64_t j = 0; j < vocab; ++j) hist[float_bits(x[j]) >> 23] += w[j];
        const double target = static_cast<double>(TP[r]) * static_cast<double>(total);
        int64_t mass = 0, exponent = 255;  // mass: kept above the current bin
        while (exponent > 0 && static_cast<double>(mass + hist[exponent]) < target) mass += hist[exponent--];
        std::fill(std::begin(hist), std::end(hist), 0);
        for (int64_t j = 0; j < vocab; ++j)
          if ((float_bits(x[j]) >> 23) == static_cast<uint32_t>(exponent)) hist[(float_bits(x[j]) >> 15) & 0xFF] += w[j];
        int64_t fine = 255;
        while (fine > 0 && static_cast<double>(mass + hist[fine]) < target) mass += hist[fine--];
        const uint32_t bin = (static_cast<uint32_t>(exponent) << 8) | static_cast<uint32_t>(fine);
        nucleus.clear();
        for (int64_t j = 0; j < vocab; ++j)
          if ((float_bits(x[j]) >> 15) == bin) nucleus.emplace_back(x[j], w[j]);
        std::sort(nucleus.begin(), nucleus.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
        float threshold = nucleus.empty() ? 0.f : nucleus.back().first;
        for (const auto& [prob, weight] : nucleus) {
          mass += weight;
          threshold = prob;
          if (static_cast<double>(mass) >= target) break;
        }
        keep_from = std::max(keep_from, threshold);
      }
      const int64_t total = fixed_point_weights(x.data(), vocab, keep_from, w.data());
      const int64_t target = std::min(static_cast<int64_t>(U[r] * static_cast<double>(total)), total - 1);
      int64_t cdf = 0, pick = vocab - 1;
      for (int64_t j = 0; j < vocab; ++j) {
        cdf += w[j];
        if (cdf > target) {
          pick = j;
          break;
        }
      }
      O[r] = pick;
    }
  }
  return out;
}

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

// A decode step's cache write: dst [S, Hkv, L, D] (one layer of a slot cache, contiguous),
// src [B, Hkv, 1, D] (any strides, contiguous D): row b's keys go to slot b at positions[b].
void write_rows(torch::Tensor& dst, const torch::Tensor& src, const torch::Tensor& positions) {
  TORCH_CHECK(dst.scalar_type() == src.scalar_type() && dst.is_contiguous() && src.stride(3) == 1 &&
                  dst.element_size() == 2 && positions.scalar_type() == at::kLong &&
                  positions.is_contiguous() && positions.numel() == src.size(0) &&
                  src.size(0) <= dst.size(0) && src.size(1) == dst.size(1) && src.size(3) == dst.size(3),
              "write_rows: 2-byte dst [S, Hkv, L, D] contiguous, src [B, Hkv, 1, D], positions [B]");
  const int64_t batch = src.size(0), heads = src.size(1), len = dst.size(2), dim = dst.size(3);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) TORCH_CHECK(pos[b] >= 0 && pos[b] < len, "write_rows: position out of range");
  auto* D = reinterpret_cast<uint16_t*>(dst.data_ptr());
  const auto* S = reinterpret_cast<const uint16_t*>(src.data_ptr());
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < heads; ++h)
      std::memcpy(D + ((b * heads + h) * len + pos[b]) * dim, S + b * src.stride(0) + h * src.stride(1),
                  dim * sizeof(uint16_t));
}

// One decoder layer for R decode rows, each one new token: x [R, hidden]. Llama / Qwen3:
// h = x + attn(norm_in(x)), out = h + mlp(norm_mlp(h)); Gemma 3 also normalizes the attention
// and MLP outputs (post_attn, post_mlp) and uses (1 + w) norms (unit_offset) and tanh-GELU.
// Optional per-head QK-norm (q_norm, k_norm) before RoPE. No biases. Row r writes its key and
// value at positions[r] of cache row r (k_cache, v_cache [S, Hkv, M, D], one layer) and attends
// to keys < lengths[r] (within `window`, 0 = all) of the first kv_len positions; cos, sin
// [R, 1, 1, D] at the rows' positions. The modules' kernels in their order, so the result is
// identical: one call instead of ~40-50 Python-level ops (~1.5 ms of a ~8 ms single-row step).
torch::Tensor decode_layer(const torch::Tensor& x, const torch::Tensor& w_in, const torch::Tensor& wqkv,
                           const torch::Tensor& wo, const c10::optional<torch::Tensor>& w_post_attn,
                           const torch::Tensor& w_mlp, const torch::Tensor& w13, const torch::Tensor& w2,
                           const c10::optional<torch::Tensor>& w_post_mlp,
                           const c10::optional<torch::Tensor>& q_norm, const c10::optional<torch::Tensor>& k_norm,
                           bool unit_offset, bool gelu, int64_t intermediate, torch::Tensor& k_cache,
                           torch::Tensor& v_cache, const torch::Tensor& positions, const torch::Tensor& lengths,
                           int64_t kv_len, int64_t window, const torch::Tensor& cos, const torch::Tensor& sin,
                           int64_t n_heads, int64_t n_kv, double scale, double eps) {
  const int64_t rows = x.size(0), hidden = x.size(1), head_dim = k_cache.size(3);
  TORCH_CHECK(x.dim() == 2 && k_cache.dim() == 4 && rows <= k_cache.size(0) && kv_len <= k_cache.size(2) &&
                  q_norm.has_value() == k_norm.has_value(),
              "decode_layer: x [R, hidden], caches [S >= R, Hkv, M >= kv_len, D], both QK norms or none");
  const auto qkv = gemm_packed(rms_norm(x, w_in, eps, unit_offset), wqkv, (n_heads + 2 * n_kv) * head_dim)
                       .view({rows, 1, n_heads + 2 * n_kv, head_dim});
  auto qk = qkv.narrow(2, 0, n_heads + n_kv);
  if (q_norm.has_value()) {
    qk = torch::cat({rms_norm(qk.narrow(2, 0, n_heads).contiguous(), *q_norm, eps, unit_offset),
                     rms_norm(qk.narrow(2, n_heads, n_kv).contiguous(), *k_norm, eps, unit_offset)},
                    2);
  }
  const auto rotated =
      rope(qk, cos.reshape({rows, 1, 1, head_dim}), sin.reshape({rows, 1, 1, head_dim})).transpose(1, 2);
  write_rows(k_cache, rotated.narrow(1, n_heads, n_kv), positions);
  write_rows(v_cache, qkv.narrow(2, n_heads + n_kv, n_kv).transpose(1, 2), positions);
  const auto y = attention(rotated.narrow(1, 0, n_heads), k_cache.narrow(0, 0, rows).narrow(2, 0, kv_len),
                           v_cache.narrow(0, 0, rows).narrow(2, 0, kv_len), lengths, window, scale);
  auto attn = gemm_packed(y.transpose(1, 2).reshape({rows, n_heads * head_dim}), wo, hidden);
  if (w_post_attn.has_value()) attn = rms_norm(attn, *w_post_attn, eps, unit_offset);
  const auto h = x + attn;
  const auto gate_up = gemm_packed(rms_norm(h, w_mlp, eps, unit_offset), w13, 2 * intermediate);
  auto mlp = gemm_packed(gelu ? gelu_tanh_mul(gate_up) : silu_mul(gate_up), w2, hidden);
  if (w_post_mlp.has_value()) mlp = rms_norm(mlp, *w_post_mlp, eps, unit_offset);
  return h + mlp;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attention", &attention, "causal GQA attention over a bf16 cache (decode rows, prompt chunks)");
  m.def("pack_panels", &pack_panels, "weights [N, K] in gemm_packed's panel layout");
  m.def("gemm_packed", &gemm_packed, "bf16 matrix product on panel-packed weights (AVX512-BF16)");
  m.def("rms_norm", &rms_norm, "bf16 RMSNorm computed in float32");
  m.def("silu_mul", &silu_mul, "bf16 silu(gate) * up");
  m.def("gelu_tanh_mul", &gelu_tanh_mul, "bf16 gelu_tanh(gate) * up");
  m.def("sample_rows", &sample_rows, "sample one token per row: top-k, temperature, top-p, min-p, inverse CDF");
  m.def("rope", &rope, "rotate-half RoPE in one pass (bf16)");
  m.def("argmax_rows", &argmax_rows, "per-row argmax of bf16 logits");
  m.def("write_rows", &write_rows, "one decode step's writes into a slot KV cache layer");
  m.def("decode_layer", &decode_layer, "one decoder layer for decode rows (the module path's kernels)");
}
