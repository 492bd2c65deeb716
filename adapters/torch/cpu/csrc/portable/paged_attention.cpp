// Decode attention read straight through block tables, for any CPU: plain C++ loops the
// compiler vectorizes (built with the ISA flags this CPU has), float32 accumulation, one
// work item per (row, KV head) so the G query heads sharing a KV head read each key and
// value once. Replaces "gather the blocks into a contiguous copy, then SDPA", which copies
// every row's whole context twice per layer and step.
// ATen and the op registry only (not torch/extension.h, the whole C++ API and pybind11): the
// build takes half the time. The op is torch.ops.infer.paged_attention.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// n values of T as float32: bfloat16 by its bits (a shift the compiler vectorizes).
template <typename T>
inline void to_floats(const T* src, float* dst, int64_t n) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const auto* raw = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t bits = static_cast<uint32_t>(raw[i]) << 16;
      float f;
      std::memcpy(&f, &bits, sizeof(f));
      dst[i] = f;
    }
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
  }
}

// e^x for the softmax's x <= 0 in plain operations the compiler vectorizes (std::exp is a
// libm call per value): x = n ln 2 + r with |r| <= ln 2 / 2 (ln 2 split in two so n ln 2 is
// exact), e^r by its Taylor polynomial to r^7 / 7! (truncation < 3e-8 relative), times 2^n
// built in the exponent bits. Below -87 the result is flushed to e^-87 ~ 1.6e-38, which
// vanishes next to the maximum's e^0 = 1.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// Per (row, KV head) work item, in two passes over the row's blocks: the G query heads'
// scores against every key (each key block converted to float32 once), an exact softmax
// per head (its max first, then the exponentials vectorized), then the probabilities times
// each value block. D: the head dim where it is a common one (the loops over it unroll and
// the accumulators stay in registers), 0 for any other.
template <typename T, int D>
void paged_decode(const T* q, const T* k_pool, const T* v_pool, const int32_t* tables,
                  const int64_t* lengths, T* out, int64_t rows, int64_t heads, int64_t kv_heads,
                  int64_t dim_any, int64_t block_size, int64_t max_blocks, int64_t window,
                  float scale) {
  const int64_t dim = D > 0 ? D : dim_any;
  const int64_t group = heads / kv_heads;
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * dim), acc(group * dim), scores, kv(block_size * dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / kv_heads, h = item % kv_heads;
      const int64_t length = lengths[r];
      const int64_t low = window > 0 ? std::max<int64_t>(0, length - window) : 0;
      const int64_t span = length - low;
      if (static_cast<int64_t>(scores.size()) < group * span) scores.resize(group * span);
      for (int64_t j = 0; j < group; ++j) {
        float* qd = qf.data() + j * dim;
        to_floats(q + ((r * heads) + h * group + j) * dim, qd, dim);
        for (int64_t d = 0; d < dim; ++d) qd[d] *= scale;
      }
      auto block_start = [&](const T* pool, int64_t b) {
        return pool + (tables[r * max_blocks + b] * kv_heads + h) * block_size * dim;
      };
      // the keys [first, last) of block b of this row's table, as float32 rows of dim; the
      // next block's asked for meanwhile (blocks lie anywhere in the pool: the hardware
      // prefetcher does not follow a table)
      auto block_rows = [&](const T* pool, int64_t b, int64_t first, int64_t last) {
        if ((b + 1) * block_size < length) {
          const char* next = reinterpret_cast<const char*>(block_start(pool, b + 1));
          for (int64_t i = 0; i < block_size * dim * static_cast<int64_t>(sizeof(T)); i += 64)
            __builtin_prefetch(next + i);
        }
        const T* src = block_start(pool, b);
        if constexpr (std::is_same_v<T, float>) {
          return src;
        } else {
          to_floats(src + first * dim, kv.data() + first * dim, (last - first) * dim);
          return static_cast<const float*>(kv.data());
        }
      };
      for (int64_t b = low / block_size; b * block_size < length; ++b) {
        const int64_t first = std::max(low, b * block_size) - b * block_size;
        const int64_t last = std::min(length, (b + 1) * block_size) - b * block_size;
        const float* keys = block_rows(k_pool, b, first, last);
        for (int64_t j = 0; j < group; ++j) {
          const float* qd = qf.data() + j * dim;
          float* s = scores.data() + j * span + b * block_size - low;
          for (int64_t p = first; p < last; ++p) {
            const float* kp = keys + p * dim;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < dim; ++d) dot += qd[d] * kp[d];
            s[p] = dot;
          }
        }
      }
      std::vector<float> inv(group);
      for (int64_t j = 0; j < group; ++j) {
        float* s = scores.data() + j * span;
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t p = 0; p < span; ++p) top = std::max(top, s[p]);
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t p = 0; p < span; ++p) {
          s[p] = exp_nonpositive(s[p] - top);
          sum += s[p];
        }
        inv[j] = 1.0f / sum;  // >= 1: the maximum's term is 1
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t b = low / block_size; b * block_size < length; ++b) {
        const int64_t first = std::max(low, b * block_size) - b * block_size;
        const int64_t last = std::min(length, (b + 1) * block_size) - b * block_size;
        const float* values = block_rows(v_pool, b, first, last);
        for (int64_t j = 0; j < group; ++j) {
          const float* e = scores.data() + j * span + b * block_size - low;
          float* a = acc.data() + j * dim;
          for (int64_t p = first; p < last; ++p) {
            const float* vp = values + p * dim;
            const float w = e[p];
#pragma omp simd
            for (int64_t d = 0; d < dim; ++d) a[d] += w * vp[d];
          }
        }
      }
      for (int64_t j = 0; j < group; ++j) {
        T* o = out + ((r * heads) + h * group + j) * dim;
        const float* a = acc.data() + j * dim;
        for (int64_t d = 0; d < dim; ++d) o[d] = static_cast<T>(a[d] * inv[j]);
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
    auto run = [&](auto kernel) {
      kernel(qc.data_ptr<scalar_t>(), k_pool.data_ptr<scalar_t>(), v_pool.data_ptr<scalar_t>(),
             tc.data_ptr<int32_t>(), len, out.data_ptr<scalar_t>(), rows, heads, kv_heads, dim,
             block_size, max_blocks, window, static_cast<float>(scale));
    };
    if (dim == 64)
      run(paged_decode<scalar_t, 64>);
    else if (dim == 128)
      run(paged_decode<scalar_t, 128>);
    else
      run(paged_decode<scalar_t, 0>);
  });
  return out;
}

// The infer op namespace's one TORCH_LIBRARY: every other file of this library and of the
// AVX512-BF16 one (csrc/avx512_bf16/bindings.cpp) adds its ops with TORCH_LIBRARY_FRAGMENT.
TORCH_LIBRARY(infer, m) {
  m.def(
      "paged_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor tables, Tensor lengths, "
      "int window, float scale) -> Tensor",
      &paged_attention);
}
