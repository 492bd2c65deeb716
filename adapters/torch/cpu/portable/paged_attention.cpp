// Decode attention read straight through block tables, for any CPU: plain C++ loops the
// compiler vectorizes (built with the ISA flags this CPU has), float32 accumulation, one
// work item per (row, KV head) so the G query heads sharing a KV head read each key and
// value once. Replaces "gather the blocks into a contiguous copy, then SDPA", which copies
// every row's whole context twice per layer and step.
// ATen and the op registry only (not torch/extension.h, the whole C++ API and pybind11): the
// build takes half the time. The op is torch.ops.infer_portable.paged_attention.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename T>
inline float to_float(T x) {
  return static_cast<float>(x);
}

template <typename T>
void paged_decode(const T* q, const T* k_pool, const T* v_pool, const int32_t* tables,
                  const int64_t* lengths, T* out, int64_t rows, int64_t heads, int64_t kv_heads,
                  int64_t dim, int64_t block_size, int64_t max_blocks, int64_t window,
                  float scale) {
  const int64_t group = heads / kv_heads;
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * dim), acc(group * dim), scores(group * block_size);
    std::vector<float> kf(block_size * dim), vf(block_size * dim);
    std::vector<float> run_max(group), run_sum(group);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / kv_heads, h = item % kv_heads;
      const int64_t length = lengths[r];
      const int64_t low = window > 0 ? std::max<int64_t>(0, length - window) : 0;
      for (int64_t j = 0; j < group; ++j) {
        const T* qj = q + ((r * heads) + h * group + j) * dim;
        float* qd = qf.data() + j * dim;
        for (int64_t d = 0; d < dim; ++d) qd[d] = to_float(qj[d]) * scale;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(run_max.begin(), run_max.end(), -std::numeric_limits<float>::infinity());
      std::fill(run_sum.begin(), run_sum.end(), 0.0f);
      for (int64_t b = low / block_size; b * block_size < length; ++b) {
        const int64_t block = tables[r * max_blocks + b];
        const int64_t first = std::max(low, b * block_size) - b * block_size;
        const int64_t last = std::min(length, (b + 1) * block_size) - b * block_size;
        const T* kb = k_pool + (block * kv_heads + h) * block_size * dim;
        const T* vb = v_pool + (block * kv_heads + h) * block_size * dim;
        const float* kr;
        const float* vr;
        if constexpr (std::is_same_v<T, float>) {
          kr = kb;
          vr = vb;
        } else {
          for (int64_t i = first * dim; i < last * dim; ++i) {
            kf[i] = to_float(kb[i]);
            vf[i] = to_float(vb[i]);
          }
          kr = kf.data();
          vr = vf.data();
        }
        for (int64_t j = 0; j < group; ++j) {
          const float* qd = qf.data() + j * dim;
          float* s = scores.data() + j * block_size;
          float block_max = -std::numeric_limits<float>::infinity();
          for (int64_t p = first; p < last; ++p) {
            const float* kp = kr + p * dim;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < dim; ++d) dot += qd[d] * kp[d];
            s[p] = dot;
            block_max = std::max(block_max, dot);
          }
          const float new_max = std::max(run_max[j], block_max);
          const float correction = std::exp(run_max[j] - new_max);  // 0 when run_max is -inf
          float* a = acc.data() + j * dim;
          float sum = run_sum[j] * correction;
          for (int64_t d = 0; d < dim; ++d) a[d] *= correction;
          for (int64_t p = first; p < last; ++p) {
            const float e = std::exp(s[p] - new_max);
            sum += e;
            const float* vp = vr + p * dim;
#pragma omp simd
            for (int64_t d = 0; d < dim; ++d) a[d] += e * vp[d];
          }
          run_sum[j] = sum;
          run_max[j] = new_max;
        }
      }
      for (int64_t j = 0; j < group; ++j) {
        T* o = out + ((r * heads) + h * group + j) * dim;
        const float* a = acc.data() + j * dim;
        const float inv = run_sum[j] > 0.0f ? 1.0f / run_sum[j] : 0.0f;
        for (int64_t d = 0; d < dim; ++d) o[d] = static_cast<T>(a[d] * inv);
      }
    }
  });
}

}  // namespace

// q [R, H, 1, D]; k_pool, v_pool [blocks, Hkv, block_size, D]; tables [R, max_blocks] int32;
// lengths [R] int64 (row r reads keys [max(0, lengths[r] - window), lengths[r]); window 0 =
// all) -> [R, H, 1, D] in q's dtype.
at::Tensor paged_attention(at::Tensor q, at::Tensor k_pool, at::Tensor v_pool,
                              at::Tensor tables, at::Tensor lengths, int64_t window,
                              double scale) {
  TORCH_CHECK(q.dim() == 4 && q.size(2) == 1, "q must be [rows, heads, 1, dim]");
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.sizes() == v_pool.sizes(), "pools must match");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous(), "pools must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_pool.scalar_type(), "q and the pools differ in dtype");
  TORCH_CHECK(tables.scalar_type() == at::kInt && lengths.scalar_type() == at::kLong,
              "tables int32, lengths int64");
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(3);
  const int64_t kv_heads = k_pool.size(1), block_size = k_pool.size(2);
  TORCH_CHECK(k_pool.size(3) == dim && heads % kv_heads == 0, "head shapes do not match");
  TORCH_CHECK(tables.size(0) == rows && lengths.size(0) == rows, "one table and length per row");
  auto qc = q.contiguous();
  auto tc = tables.contiguous();
  auto lc = lengths.contiguous();
  const int64_t max_blocks = tc.size(1);
  const auto* len = lc.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(len[r] >= 1 && len[r] <= max_blocks * block_size, "row length out of its table");
  auto out = at::empty_like(qc);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    paged_decode<scalar_t>(qc.data_ptr<scalar_t>(), k_pool.data_ptr<scalar_t>(),
                           v_pool.data_ptr<scalar_t>(), tc.data_ptr<int32_t>(), len,
                           out.data_ptr<scalar_t>(), rows, heads, kv_heads, dim, block_size,
                           max_blocks, window, static_cast<float>(scale));
  });
  return out;
}

TORCH_LIBRARY(infer_portable, m) {
  m.def(
      "paged_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor tables, Tensor lengths, "
      "int window, float scale) -> Tensor",
      &paged_attention);
}
