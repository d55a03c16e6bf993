// A bf16 linear layer, out = act(x W^T + b) [* other], for CPUs with AVX512-BF16 (vdpbf16ps), the weight packed
// once by pack_bf16_weight into 64-byte lines of 16 outputs x 2 consecutive inputs ([N/16, K/2, 16, 2]), so each
// line feeds 16 output columns at once and no horizontal sums are needed. A decode step's few rows stream every
// weight from DRAM once; this loop keeps that stream at the memory's speed where oneDNN's packed matmul reaches
// about two thirds of it (tools/bench_generate.py). Products and sums in fp32 (vdpbf16ps), the epilogue (bias,
// SiLU, the product with `other`) in fp32 before one rounding to bf16.
//
// Built only where the CPU has AVX512-BF16 (megapipe/inference/kernels.py).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>
#include <immintrin.h>

#include "linear_tiles.h"

#include <algorithm>
#include <optional>

namespace {

using namespace megapipe_linear;

using Epilogue = megapipe_linear::Epilogue<c10::BFloat16>;

inline __m512 bf16_to_fp32(__m256i v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

template <int MB, int NT>
inline void block(const uint16_t* x, int64_t x_row, const uint16_t* w, int64_t pairs, int64_t tile_stride,
                  int64_t n0, int64_t n, int64_t m0, const Epilogue& ep, c10::BFloat16* out, int64_t out_row) {
  __m512 acc[MB][NT];
  for (int m = 0; m < MB; ++m)
    for (int t = 0; t < NT; ++t) acc[m][t] = _mm512_setzero_ps();
  for (int64_t k = 0; k < pairs; ++k) {
    __m512i wv[NT];
    for (int t = 0; t < NT; ++t) wv[t] = _mm512_loadu_si512(w + t * tile_stride + k * 2 * kTile);
    for (int m = 0; m < MB; ++m) {
      const __m512i xv = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x + m * x_row + 2 * k));
      for (int t = 0; t < NT; ++t) acc[m][t] = _mm512_dpbf16_ps(acc[m][t], (__m512bh)xv, (__m512bh)wv[t]);
    }
  }
  using Vec = at::vec::Vectorized<float>;
  for (int t = 0; t < NT; ++t) {
    const int64_t col = n0 + t * kTile;
    const int64_t valid = std::min<int64_t>(kTile, n - col);
    const __mmask16 mask = valid >= kTile ? __mmask16(0xffff) : __mmask16((1u << valid) - 1);
    const __m512 bias = ep.bias ? bf16_to_fp32(_mm256_maskz_loadu_epi16(mask, ep.bias + col)) : _mm512_setzero_ps();
    for (int m = 0; m < MB; ++m) {
      __m512 v = _mm512_add_ps(acc[m][t], bias);
      if (ep.swish) {
        const Vec x(v);
        v = x / (Vec(1.f) + x.neg().exp());
      }
      if (ep.other) v = _mm512_mul_ps(v, bf16_to_fp32(_mm256_maskz_loadu_epi16(mask, ep.other + (m0 + m) * ep.other_row + col)));
      _mm256_mask_storeu_epi16(out + (m0 + m) * out_row + col, mask, (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

template <int NT, int R = kRows>
inline void rows_block(int mb, const uint16_t* x, int64_t x_row, const uint16_t* w, int64_t pairs,
                       int64_t tile_stride, int64_t n0, int64_t n, int64_t m0, const Epilogue& ep,
                       c10::BFloat16* out, int64_t out_row) {
  if (mb == R) return block<R, NT>(x, x_row, w, pairs, tile_stride, n0, n, m0, ep, out, out_row);
  if constexpr (R > 1) rows_block<NT, R - 1>(mb, x, x_row, w, pairs, tile_stride, n0, n, m0, ep, out, out_row);
}

// x [M, K] bf16 (rows contiguous), weight from pack_bf16_weight for N outputs, bias [N] or none, other [M, N] or
// none; out [M, N]
void linear_bf16(const at::Tensor& x, const at::Tensor& weight, int64_t n, const std::optional<at::Tensor>& bias,
                 bool swish, const std::optional<at::Tensor>& other, at::Tensor out) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 &&
                  out.scalar_type() == at::kBFloat16, "linear_bf16 takes bf16 tensors");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && weight.dim() == 4 && weight.is_contiguous() &&
                  weight.size(2) == kTile && weight.size(3) == 2, "linear_bf16: x [M, K], weight [N/16, K/2, 16, 2]");
  const int64_t m = x.size(0), k = x.size(1), pairs = weight.size(1), tiles = weight.size(0);
  TORCH_CHECK(k == 2 * pairs && (n + kTile - 1) / kTile == tiles,
              "linear_bf16: x has ", k, " features and the weight ", 2 * pairs, " for ", n, " outputs");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == m && out.size(1) == n && out.stride(1) == 1,
              "linear_bf16: out must be [M, N]");
  const Epilogue ep = checked_epilogue<c10::BFloat16>("linear_bf16", at::kBFloat16, "bf16", m, n, swish, bias, other);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.const_data_ptr<c10::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(weight.const_data_ptr<c10::BFloat16>());
  c10::BFloat16* op = out.mutable_data_ptr<c10::BFloat16>();
  const int64_t x_row = x.stride(0), out_row = out.stride(0), tile_stride = pairs * 2 * kTile;
  for_each_block(m, tiles, [&](auto nt, int64_t t0, int64_t m0, int mb) {
    const int64_t n0 = t0 * kTile;
    rows_block<decltype(nt)::value>(mb, xp + m0 * x_row, x_row, wp + t0 * tile_stride, pairs, tile_stride, n0, n,
                                    m0, ep, op, out_row);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(megapipe, m) {
  m.def("linear_bf16(Tensor x, Tensor weight, int n, Tensor? bias, bool swish, Tensor? other, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(megapipe, CPU, m) {
  m.impl("linear_bf16", &linear_bf16);
}
