// Token selection on logits rows: argmax, and the Sampler's pipeline in one pass per row.
#include "common.h"
#include "kernels.h"

// The first index of the maximum of `row`'s n bf16 values (row null: of x's floats; NaN
// never one; all -inf or NaN: 0), the maximum in *top, 16 lanes at a time, as the scalar
// scan `if (x[i] > top)` picks; with both row and x, x[0..n) also gets the values widened
// to float32.
static int64_t widen_argmax(const uint16_t* row, int64_t n, float* x, float* top_out) {
  __m512 best = _mm512_set1_ps(-INFINITY);
  __m512i best_at = _mm512_setzero_si512();
  __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  const int64_t vec_end = n / 16 * 16;
  for (int64_t i = 0; i < vec_end; i += 16) {
    __m512 v;
    if (row != nullptr) {
      v = load_bf16x16(row + i);
      if (x != nullptr) _mm512_storeu_ps(x + i, v);
    } else {
      v = _mm512_loadu_ps(x + i);
    }
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
    if (values[lane] > top || (values[lane] == top && top != -INFINITY && indices[lane] < top_at)) {
      top = values[lane];
      top_at = indices[lane];
    }
  }
  for (int64_t i = vec_end; i < n; ++i) {
    const float v = row != nullptr ? bf16_to_float(row[i]) : x[i];
    if (x != nullptr) x[i] = v;
    if (v > top) {
      top = v;
      top_at = i;
    }
  }
  *top_out = top;
  return top_at;
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
#pragma omp parallel for schedule(static) if (rows > 1)
  for (int64_t r = 0; r < rows; ++r) {
    float top;
    O[r] = widen_argmax(X + r * stride, vocab, nullptr, &top);
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
// Sampler's pipeline and arithmetic (adapters/torch/runtime/sampler.py), one row per thread at a time
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
  // One row (a single stream's step) runs on the calling thread: waking the others cost more
  // than the row. Each thread's buffers are kept between calls (a row's ~600 KB for a 49k
  // vocabulary were allocated, zeroed and page-faulted on every call).
#pragma omp parallel if (rows > 1)
  {
    thread_local std::vector<float> x, tmp;
    thread_local std::vector<int64_t> w;
    thread_local std::vector<std::pair<float, int64_t>> nucleus;
    if (static_cast<int64_t>(x.size()) < vocab) x.resize(vocab);
    if (static_cast<int64_t>(w.size()) < vocab) w.resize(vocab);
#pragma omp for schedule(dynamic)
    for (int64_t r = 0; r < rows; ++r) {
      float top;
      int64_t top_at;
      if (bf16) {
        const uint16_t* row = reinterpret_cast<const uint16_t*>(logits.data_ptr<at::BFloat16>()) + r * logits.stride(0);
        top_at = widen_argmax(row, vocab, x.data(), &top);
      } else {
        std::memcpy(x.data(), logits.data_ptr<float>() + r * logits.stride(0), vocab * sizeof(float));
        top_at = widen_argmax(nullptr, vocab, x.data(), &top);
      }
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
