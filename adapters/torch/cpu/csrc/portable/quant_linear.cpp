// Linear layers over infer's quantized weights ("infer-quantized-v1": int8 [N, K] or 4-bit
// packed [N, K/2] in GGUF Q4_0's nibble order, float16 scales and optional mins per group
// of g consecutive k's; W[n, k] = q * scale + min; 6-bit [N, 3K/4], quant_six.h; GGUF
// Q4_K / Q6_K as their super-blocks, quant_weight.h). Two paths, by the caller's row
// threshold:
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
// By concern: quant_weight.h (the weight, float conversions), quant_acts.h (activation
// quantization and layouts), quant_int.h (the integer dot products), quant_dense.h (the
// dequantized tiles); this file checks the arguments and registers the ops. ATen and the op
// registry only, like paged_attention.cpp. Ops: torch.ops.infer.quant_linear and
// quant_dequantize.
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

#include "quant_acts.h"
#include "quant_dense.h"
#include "quant_int.h"
#include "quant_six.h"
#include "quant_weight.h"

namespace {

Weight check_weight(const at::Tensor& qweight, const at::Tensor& scales,
                    const std::optional<at::Tensor>& mins, int64_t bits, int64_t group,
                    std::optional<int64_t> k_from_x) {
  TORCH_CHECK(bits == 4 || bits == 6 || bits == 8,
              "quantized weights: bits must be 4, 6 or 8, got ", bits);
  TORCH_CHECK(qweight.device().is_cpu() && scales.device().is_cpu(),
              "quantized weights: tensors must be on the CPU");
  TORCH_CHECK(qweight.dim() == 2,
              "qweight must be 2-D [N, K] (bits 8), [N, K/2] (bits 4) or [N, 3K/4] (bits 6)");
  const auto want = bits == 8 ? at::kChar : at::kByte;
  TORCH_CHECK(qweight.scalar_type() == want, "bits ", bits, ": qweight must be ",
              bits == 8 ? "int8" : "uint8", ", got ", qweight.scalar_type());
  const int64_t cols = qweight.size(1);
  // super-blocks (quant_weight.h): group 256, each row 144 (4-bit) / 208 (6-bit) bytes per
  // float16 scale
  const int64_t super_bytes = bits == 4 ? kSuper4Bytes : bits == 6 ? kSuper6Bytes : 0;
  const bool super = group == kSuper && super_bytes > 0 && scales.dim() == 2 &&
                     cols == scales.size(1) * super_bytes;
  if (super && bits == 4)
    TORCH_CHECK(mins.has_value(), "4-bit super-blocks need mins (Q4_K's -dmin)");
  if (super && bits == 6)
    TORCH_CHECK(!mins.has_value(), "6-bit super-blocks take no mins");
  if (bits == 6 && !super) {  // 96 bytes a quad of 128 k's, one scale per 16 (quant_six.h)
    TORCH_CHECK(cols % kQuad6Bytes == 0, "bits 6: qweight rows must be whole 96-byte quads, got ",
                cols, " bytes");
    TORCH_CHECK(group == kGroup6, "bits 6: group_size must be 16, got ", group);
  }
  const int64_t n = qweight.size(0);
  const int64_t k = super     ? scales.size(1) * kSuper
                    : bits == 8 ? cols
                    : bits == 6 ? cols / kQuad6Bytes * kQuad6
                                : 2 * cols;
  if (k_from_x)
    TORCH_CHECK(*k_from_x == k, "x has ", *k_from_x, " features but the ", bits,
                "-bit qweight ", qweight.sizes(), " holds K = ", k);
  TORCH_CHECK(k % kBlock == 0, "K must be a multiple of 32, got ", k);
  TORCH_CHECK(group > 0 && k % group == 0, "group_size ", group, " must divide K = ", k);
  const int64_t unit = bits == 4 ? 32 : 16;
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
                n, k, bits, group, groups, qweight.size(1), super};
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
  if (w.bits == 6 && xc.scalar_type() == at::kFloat)
    int_linear_6bit<float>(xc, w, y);
  else if (w.bits == 6)
    int_linear_6bit<at::BFloat16>(xc, w, y);
  else if (xc.scalar_type() == at::kFloat)
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

// The weight widths whose integer path runs vector code on this build: 6 needs AVX-512BW
// (elsewhere the loader widens Q6_K's values to int8, whose path has AVX2 code).
std::vector<int64_t> quant_fast_bits() {
#if defined(INFER_FAST_6BIT)
  return {4, 6, 8};
#else
  return {4, 8};
#endif
}

TORCH_LIBRARY_FRAGMENT(infer, m) {
  m.def("quant_fast_bits() -> int[]", &quant_fast_bits);
  m.def(
      "quant_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, int bits, "
      "int group_size, int dense_from_rows) -> Tensor",
      &quant_linear);
  m.def(
      "quant_dequantize(Tensor qweight, Tensor scales, Tensor? mins, int bits, int group_size, "
      "ScalarType dtype) -> Tensor",
      &quant_dequantize);
}
