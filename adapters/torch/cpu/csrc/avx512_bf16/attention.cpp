// Causal GQA attention in bf16: prompt chunks over their keys (prompt_attention), decode rows
// over a paged pool through block tables (paged_attention), and a decode step's pool writes.
#include "common.h"
#include "kernels.h"

constexpr int64_t kMinSplitKeys = 128;  // keys per piece, at least, when decode splits a row's keys
// Whether decode may split a row's keys into pieces (flash decoding) when there are fewer
// (row, KV head) pairs than twice the threads. The split depends on how many rows share the
// call, so a row's rounding would too: batch-invariant serving turns it off (set_split_keys).
static bool g_split_keys = true;
constexpr int64_t kKeyBlock = 16;  // keys per rearranged block of the prompt path

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

// A run of consecutive keys and their values (bf16 rows of dim): a decode row's keys are
// one span per block of a paged pool.
struct KeySpan {
  const uint16_t* k;
  const uint16_t* v;
  int64_t n;
};

// out[h][d] = sum_l p[h][l] v[l][d] for G heads sharing the values of `spans` (p's columns
// follow the spans in order): per block of 64 columns, each value row is loaded once for all
// G heads, with the G x 4 accumulators in registers.
template <int G>
void weighted_values(const float* p, int64_t p_stride, const KeySpan* spans, int64_t n_spans, int64_t dim,
                     uint16_t* out, int64_t out_stride, float* out_f32) {
  for (int64_t d0 = 0; d0 < dim; d0 += 64) {
    const int chunks = static_cast<int>(std::min<int64_t>(4, (dim - d0) / 16));
    __m512 acc[G][4];
    for (int h = 0; h < G; ++h)
      for (int c = 0; c < 4; ++c) acc[h][c] = _mm512_setzero_ps();
    int64_t at = 0;  // p's column of the span's first key
    for (int64_t sp = 0; sp < n_spans; at += spans[sp].n, ++sp) {
      const uint16_t* v = spans[sp].v;
      const int64_t n = spans[sp].n;
      const float* ps = p + at;
      if (chunks == 4) {
        for (int64_t l = 0; l < n; ++l) {
          const uint16_t* row = v + l * dim + d0;
          const __m512 v0 = load_bf16x16(row), v1 = load_bf16x16(row + 16);
          const __m512 v2 = load_bf16x16(row + 32), v3 = load_bf16x16(row + 48);
          for (int h = 0; h < G; ++h) {
            const __m512 w = _mm512_set1_ps(ps[h * p_stride + l]);
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
            const __m512 w = _mm512_set1_ps(ps[h * p_stride + l]);
            acc[h][0] = _mm512_fmadd_ps(w, v0, acc[h][0]);
            acc[h][1] = _mm512_fmadd_ps(w, v1, acc[h][1]);
          }
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
void weighted_values_any(int64_t group, const float* p, int64_t p_stride, const KeySpan* spans,
                         int64_t n_spans, int64_t dim, uint16_t* out, int64_t out_stride, float* out_f32 = nullptr) {
  for (int64_t h0 = 0; h0 < group; h0 += 4) {
    const float* ph = p + h0 * p_stride;
    uint16_t* oh = out == nullptr ? nullptr : out + h0 * out_stride;
    float* fh = out_f32 == nullptr ? nullptr : out_f32 + h0 * out_stride;
    switch (std::min<int64_t>(4, group - h0)) {
      case 1: weighted_values<1>(ph, p_stride, spans, n_spans, dim, oh, out_stride, fh); break;
      case 2: weighted_values<2>(ph, p_stride, spans, n_spans, dim, oh, out_stride, fh); break;
      case 3: weighted_values<3>(ph, p_stride, spans, n_spans, dim, oh, out_stride, fh); break;
      default: weighted_values<4>(ph, p_stride, spans, n_spans, dim, oh, out_stride, fh); break;
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

// Where decode rows' keys live. `spans(b, g, from, count, out)` fills the spans of row b's
// keys [from, from + count) of KV head g; `first(b, g, from)` is the address of key `from`.
// A paged pool [blocks, Hkv, block_size, D] read through block tables [R, max_blocks]: one
// span per block.
struct PoolKeys {
  const uint16_t *K, *V;
  const int32_t* tables;
  int64_t max_blocks, kv_heads, block_size, dim;
  int64_t at(int64_t b, int64_t g, int64_t pos) const {
    const int64_t block = tables[b * max_blocks + pos / block_size];
    return ((block * kv_heads + g) * block_size + pos % block_size) * dim;
  }
  const uint16_t* first(int64_t b, int64_t g, int64_t from) const { return K + at(b, g, from); }
  void spans(int64_t b, int64_t g, int64_t from, int64_t count, std::vector<KeySpan>& out) const {
    out.clear();
    for (int64_t pos = from, end = from + count; pos < end;) {
      const int64_t n = std::min(end, (pos / block_size + 1) * block_size) - pos, off = at(b, g, pos);
      out.push_back({K + off, V + off, n});
      pos += n;
    }
  }
};

// s[0..) = scale * q . k over the spans' keys in order; `ahead` prefetches the values too.
inline void span_scores(const uint16_t* q, const std::vector<KeySpan>& spans, int64_t dim, float scale,
                        float* s, bool ahead) {
  const size_t count = spans.size();
  for (size_t i = 0; i < count; ++i) {
    const KeySpan& span = spans[i];
    if (ahead && i + 2 < count) {  // within a span dot_scores runs ahead; across spans, here
      const char* later = reinterpret_cast<const char*>(spans[i + 2].k);
      for (int64_t byte = 0; byte < spans[i + 2].n * dim * 2; byte += 64) _mm_prefetch(later + byte, _MM_HINT_T0);
    }
    dot_scores(q, span.k, span.n, dim, scale, s, ahead ? span.v : nullptr);
    s += span.n;
  }
}

// Decode attention, one query per row: Q's row b, head h at Q + b * q_row + h * q_head; row b
// attends keys [max(0, ends[b] - window), ends[b]) (window 0 = all); O [B, H, D] bf16.
// Scores, softmax and P @ V in float32, the output rounded once.
template <class Keys>
void decode_attention(const uint16_t* Q, int64_t q_row, int64_t q_head, const std::vector<int64_t>& ends,
                      int64_t window, int64_t kv_heads, int64_t group, int64_t dim, float fscale,
                      const Keys& keys, uint16_t* O) {
  const int64_t batch = static_cast<int64_t>(ends.size()), heads = kv_heads * group;
  const int64_t pairs = batch * kv_heads, threads = omp_get_max_threads();
  int64_t longest = 0;
  for (int64_t b = 0; b < batch; ++b) longest = std::max(longest, window > 0 ? std::min(ends[b], window) : ends[b]);
  const int64_t s_stride = (longest + 15) / 16 * 16;
  const int64_t splits = !g_split_keys || pairs >= 2 * threads
                             ? 1
                             : std::min((2 * threads + pairs - 1) / pairs, longest / kMinSplitKeys);
  if (splits > 1) {
    // Fewer (row, KV head) pairs than twice the threads (one long conversation; Gemma's
    // single KV head): each pair's keys in `splits` pieces, merged as flash decoding does.
    // Per piece and head: [max score, sum of exp(score - max), unnormalized P @ V (float32)].
    const int64_t record = dim + 2;
    std::vector<float> part(pairs * splits * group * record);
#pragma omp parallel
    {
      std::vector<float> scores(group * s_stride);
      std::vector<KeySpan> spans;
#pragma omp for schedule(static) collapse(3)
      for (int64_t b = 0; b < batch; ++b) {
        for (int64_t g = 0; g < kv_heads; ++g) {
          for (int64_t c = 0; c < splits; ++c) {
            const int64_t end = ends[b];
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
            keys.spans(b, g, from, count, spans);
            for (int64_t h = 0; h < group; ++h) {
              float* sh = scores.data() + h * s_stride;
              span_scores(Q + b * q_row + (g * group + h) * q_head, spans, dim, fscale, sh, h == 0);
              rec[h * record + 1] = exp_inplace(sh, count, &rec[h * record]);
            }
            weighted_values_any(group, scores.data(), s_stride, spans.data(), static_cast<int64_t>(spans.size()),
                                dim, nullptr, record, rec + 2);
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
    return;
  }
  // Rows cost about the same: contiguous static shares (each thread prefetches its next row).
#pragma omp parallel
  {
    std::vector<float> scores(group * s_stride);
    std::vector<KeySpan> spans;
#pragma omp for schedule(static) collapse(2)
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t g = 0; g < kv_heads; ++g) {
        const int64_t end = ends[b];  // keys [start, end)
        const int64_t start = window > 0 ? std::max<int64_t>(0, end - window) : 0;
        const int64_t n = std::max<int64_t>(0, end - start);
        // the next row's keys start streaming now
        const int64_t nb = g + 1 < kv_heads ? b : b + 1, ng = g + 1 < kv_heads ? g + 1 : 0;
        if (nb < batch && ends[nb] > 0) {
          const int64_t next_start = window > 0 ? std::max<int64_t>(0, ends[nb] - window) : 0;
          const char* next = reinterpret_cast<const char*>(keys.first(nb, ng, next_start));
          const int64_t ahead = std::min<int64_t>(ends[nb] - next_start, 32);
          for (int64_t byte = 0; byte < ahead * dim * 2; byte += 64) _mm_prefetch(next + byte, _MM_HINT_T1);
        }
        uint16_t* o = O + (b * heads + g * group) * dim;
        if (n == 0) {
          std::fill(o, o + group * dim, 0);
          continue;
        }
        keys.spans(b, g, start, n, spans);
        for (int64_t h = 0; h < group; ++h) {
          float* s = scores.data() + h * s_stride;
          span_scores(Q + b * q_row + (g * group + h) * q_head, spans, dim, fscale, s, h == 0);
          softmax_inplace(s, n);
        }
        weighted_values_any(group, scores.data(), s_stride, spans.data(), static_cast<int64_t>(spans.size()), dim,
                            o, dim);
      }
    }
  }
}

// Causal attention of prompt chunks (any T >= 1, one query too), heads grouped per KV head
// (GQA): q [B, H, T, D] bf16; k, v [B, Hkv, L, D] bf16 with contiguous rows (a chunk's keys,
// or a prefix gathered from the pool, and its own). Query t of row b sits at position
// len_b - T + t, where len_b = lengths[b] (lengths holds B values, or one for every row; L
// when empty), and attends keys [start, position] with start = max(0, position - window + 1)
// for a sliding window (window > 0), else 0. Returns [B, H, T, D] bf16, a transposed view of a
// contiguous [B, T, H, D] (what the output projection reads); scores and softmax in float32.
// The keys and values are rearranged once and P @ V taken with P in bf16 (rearrange_block),
// so a prompt's logits do not depend on how it was split into chunks. (Decode rows read the
// pool in paged_attention: each row's keys read once, no rearranging to amortize, 16 keys
// scored at a time with a transpose-and-add reduction, P @ V in float32.)
namespace {

torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
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

}  // namespace

torch::Tensor prompt_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const torch::Tensor& lengths, int64_t window, double scale) {
  return attend(q, k, v, lengths, window, scale);
}

// Decode attention read through block tables: q [R, H, 1, D] bf16 (contiguous D); k_pool,
// v_pool [blocks, Hkv, block_size, D] bf16 contiguous; tables [R, max_blocks] int32; lengths
// [R] int64 (row r reads keys [max(0, lengths[r] - window), lengths[r]); window 0 = all).
// Returns [R, H, 1, D] bf16, a transposed view of a contiguous [R, 1, H, D], scores, softmax
// and P @ V in float32, block by block.
bool set_split_keys(bool on) {
  const bool was = g_split_keys;
  g_split_keys = on;
  return was;
}

torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                              const torch::Tensor& tables, const torch::Tensor& lengths, int64_t window,
                              double scale) {
  check_bf16_rows(q, "q");
  check_bf16(k_pool, "k_pool");
  check_bf16(v_pool, "v_pool");
  TORCH_CHECK(q.size(2) == 1 && k_pool.dim() == 4 && v_pool.sizes() == k_pool.sizes() &&
                  k_pool.size(3) == q.size(3) && q.size(3) % 32 == 0 && q.size(1) % k_pool.size(1) == 0,
              "paged_attention: q [R, H, 1, D], pools [blocks, Hkv, block_size, D], D % 32 == 0");
  TORCH_CHECK(tables.scalar_type() == at::kInt && tables.dim() == 2 && tables.is_contiguous() &&
                  lengths.scalar_type() == at::kLong && lengths.is_contiguous() &&
                  tables.size(0) == q.size(0) && lengths.numel() == q.size(0),
              "paged_attention: tables [R, max_blocks] int32, lengths [R] int64");
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(3);
  const int64_t blocks = k_pool.size(0), kv_heads = k_pool.size(1), block_size = k_pool.size(2);
  const int64_t max_blocks = tables.size(1);
  const int64_t* len = lengths.data_ptr<int64_t>();
  const int32_t* table = tables.data_ptr<int32_t>();
  std::vector<int64_t> ends(rows);
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(len[r] >= 0 && len[r] <= max_blocks * block_size, "paged_attention: a row's length is past its table");
    const int64_t low = window > 0 ? std::max<int64_t>(0, len[r] - window) : 0;
    for (int64_t b = low / block_size; b * block_size < len[r]; ++b)
      TORCH_CHECK(table[r * max_blocks + b] >= 0 && table[r * max_blocks + b] < blocks,
                  "paged_attention: a block table entry is outside the pool");
    ends[r] = len[r];
  }
  auto out = torch::empty({rows, 1, heads, dim}, q.options());
  const PoolKeys keys{bits(k_pool), bits(v_pool), table, max_blocks, kv_heads, block_size, dim};
  decode_attention(bits(q), q.stride(0), q.stride(1), ends, window, kv_heads, heads / kv_heads, dim,
                   static_cast<float>(scale), keys, bits_mut(out));
  return out.transpose(1, 2);
}

// A decode step's writes into one layer of a paged pool: src [R, Hkv, 1, D] (any strides,
// contiguous D) -> rows index[r * Hkv + h] of the pool seen as [-1, D].
void write_pool(torch::Tensor& pool, const torch::Tensor& src, const torch::Tensor& index) {
  TORCH_CHECK(pool.scalar_type() == src.scalar_type() && pool.is_contiguous() && src.dim() == 4 &&
                  src.stride(3) == 1 && pool.element_size() == 2 && pool.dim() == 4 &&
                  src.size(3) == pool.size(3) && index.scalar_type() == at::kLong && index.is_contiguous() &&
                  index.numel() == src.size(0) * src.size(1),
              "write_pool: 2-byte pool [blocks, Hkv, block_size, D], src [R, Hkv, 1, D], index [R * Hkv] int64");
  const int64_t rows = src.size(0), heads = src.size(1), dim = pool.size(3);
  const int64_t capacity = pool.numel() / dim;
  const int64_t* at = index.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows * heads; ++i)
    TORCH_CHECK(at[i] >= 0 && at[i] < capacity, "write_pool: a write index is outside the pool");
  auto* D = reinterpret_cast<uint16_t*>(pool.data_ptr());
  const auto* S = reinterpret_cast<const uint16_t*>(src.data_ptr());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < heads; ++h)
      std::memcpy(D + at[r * heads + h] * dim, S + r * src.stride(0) + h * src.stride(1), dim * sizeof(uint16_t));
}
