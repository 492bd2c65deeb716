// The matrix product of every linear: bf16 inputs times panel-packed weights.
#include "common.h"
#include "kernels.h"

constexpr int64_t kPartPairs = 1024;  // gemm_packed: k-pairs per part of a long panel (256 KiB)
constexpr int64_t kPanel = 64;  // output columns per gemm_packed panel: 4 vectors of 16
constexpr int64_t kRowBlockBytes = 256 * 1024;  // gemm_packed's inputs per row block

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
