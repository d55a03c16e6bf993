// An fp32 linear layer, out = act(x W^T + b) [* other], for AVX-512 CPUs, the weight packed once by
// pack_f32_weight into 64-byte lines of 16 outputs ([N/16, K, 16]): linear_bf16.cpp's loop on fp32 values. A decode
// step's few rows stream every weight from DRAM once; oneDNN's and MKL's fp32 matmuls reach about two thirds of this
// loop's speed at 1-32 rows (tools/bench_generate.py on a hybrid Nemotron-H), and are ~10% faster at hundreds of
// rows (prefill). Each output is one fp32 sum over k in order (the fused multiply-add rounds once per product).

#include <ATen/cpu/vec/vec.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>
#include <immintrin.h>

#include "linear_tiles.h"

#include <algorithm>
#include <optional>
#include <string>

namespace {

using namespace megapipe_linear;

using Epilogue = megapipe_linear::Epilogue<float>;

// A matmul's inputs from some row on: x [M, k], and optionally x2 [M, k2], whose values meet the weight's inputs
// after x's (a weight extended by more input columns: LoRA's low-rank sums, megapipe.inference.lora)
struct Inputs {
  const float* x;
  int64_t x_row, k;
  const float* x2;
  int64_t x2_row, k2;
  Bands bands;
};

// acc[m][t] += the products of `k_len` inputs of rows x (x_row apart) with the weight lines at w (tile t's
// tile_stride further on)
template <int MB, int NT>
inline void accumulate(__m512 (&acc)[MB][NT], const float* x, int64_t x_row, const float* w, int64_t k_len,
                       int64_t tile_stride) {
  for (int64_t k = 0; k < k_len; ++k) {
    __m512 wv[NT];
    for (int t = 0; t < NT; ++t) wv[t] = _mm512_loadu_ps(w + t * tile_stride + k * kTile);
    for (int m = 0; m < MB; ++m) {
      const __m512 xv = _mm512_set1_ps(x[m * x_row + k]);
      for (int t = 0; t < NT; ++t) acc[m][t] = _mm512_fmadd_ps(xv, wv[t], acc[m][t]);
    }
  }
}

template <int MB, int NT>
inline void block(const Inputs& in, const float* w, int64_t tile_stride, int64_t n0, int64_t n, int64_t m0,
                  const Epilogue& ep, float* out, int64_t out_row) {
  __m512 acc[MB][NT];
  for (int m = 0; m < MB; ++m)
    for (int t = 0; t < NT; ++t) acc[m][t] = _mm512_setzero_ps();
  accumulate<MB, NT>(acc, in.x + m0 * in.x_row, in.x_row, w, in.k, tile_stride);
  const float* x2 = in.x2 + m0 * in.x2_row;
  const float* w2 = w + in.k * kTile;
  if (in.k2 && !in.bands.start) {
    accumulate<MB, NT>(acc, x2, in.x2_row, w2, in.k2, tile_stride);
  } else if (in.k2) {  // each row's band alone (Bands)
    in.bands.each(
        m0, MB,
        [&](int64_t start) {
          accumulate<MB, NT>(acc, x2 + start, in.x2_row, w2 + start * kTile, in.bands.len, tile_stride);
        },
        [&](int m, int64_t start) {
          __m512 row[1][NT];
          for (int t = 0; t < NT; ++t) row[0][t] = acc[m][t];
          accumulate<1, NT>(row, x2 + m * in.x2_row + start, in.x2_row, w2 + start * kTile, in.bands.len,
                            tile_stride);
          for (int t = 0; t < NT; ++t) acc[m][t] = row[0][t];
        });
  }
  using Vec = at::vec::Vectorized<float>;
  for (int t = 0; t < NT; ++t) {
    const int64_t col = n0 + t * kTile;
    const __mmask16 mask = column_mask(col, n);
    const __m512 bias = ep.bias ? _mm512_maskz_loadu_ps(mask, ep.bias + col) : _mm512_setzero_ps();
    for (int m = 0; m < MB; ++m) {
      __m512 v = _mm512_add_ps(acc[m][t], bias);
      if (ep.swish) {
        const Vec x(v);
        v = x / (Vec(1.f) + x.neg().exp());
      }
      if (ep.other) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(mask, ep.other + (m0 + m) * ep.other_row + col));
      _mm512_mask_storeu_ps(out + (m0 + m) * out_row + col, mask, v);
    }
  }
}

template <int NT, int R = kRows>
inline void rows_block(int mb, const Inputs& in, const float* w, int64_t tile_stride, int64_t n0, int64_t n,
                       int64_t m0, const Epilogue& ep, float* out, int64_t out_row) {
  if (mb == R) return block<R, NT>(in, w, tile_stride, n0, n, m0, ep, out, out_row);
  if constexpr (R > 1) rows_block<NT, R - 1>(mb, in, w, tile_stride, n0, n, m0, ep, out, out_row);
}

// x [M, K] fp32 (rows contiguous), weight from pack_f32_weight for N outputs, bias [N] or none, other [M, N] or
// none; out [M, N]. With x2 [M, K2], the weight's last K2 inputs take x2's values; with x2_start [M] too, row m's
// x2 is zero but for x2_band columns from x2_start[m] on (Bands); out_start / out_band as linear_bf16's. The weight
// may be a view of the first inputs of a wider packed weight.
void linear_f32(const at::Tensor& x, const at::Tensor& weight, int64_t n, const std::optional<at::Tensor>& bias,
                bool swish, const std::optional<at::Tensor>& other, at::Tensor out,
                const std::optional<at::Tensor>& x2, const std::optional<at::Tensor>& x2_start, int64_t x2_band,
                const std::optional<at::Tensor>& out_start, int64_t out_band) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat &&
                  (!x2 || x2->scalar_type() == at::kFloat), "linear_f32 takes fp32 tensors");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && weight.dim() == 3 && weight.size(2) == kTile &&
                  weight.stride(2) == 1 && weight.stride(1) == kTile, "linear_f32: x [M, K], weight [N/16, K, 16]");
  const int64_t m = x.size(0), k = x.size(1), k2 = x2 ? x2->size(1) : 0, tiles = weight.size(0);
  TORCH_CHECK(!x2 || (x2->dim() == 2 && x2->size(0) == m && x2->stride(1) == 1), "linear_f32: x2 must be [M, K2]");
  TORCH_CHECK(k + k2 == weight.size(1) && (n + kTile - 1) / kTile == tiles, "linear_f32: x has ", k,
              x2 ? " (+ x2's " + std::to_string(k2) + ")" : std::string(), " features and the weight ",
              weight.size(1), " for ", n, " outputs");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == m && out.size(1) == n && out.stride(1) == 1,
              "linear_f32: out must be [M, N]");
  const Epilogue ep = checked_epilogue<float>("linear_f32", at::kFloat, "fp32", m, n, swish, bias, other);
  const Inputs in{x.const_data_ptr<float>(), x.stride(0), k, x2 ? x2->const_data_ptr<float>() : nullptr,
                  x2 ? x2->stride(0) : 0, k2, checked_bands("linear_f32", "x2", x2_start, x2_band, m, k2, 1)};
  const Bands out_bands = checked_bands("linear_f32", "out", out_start, out_band, m, n, 1);
  const float* wp = weight.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  const int64_t out_row = out.stride(0), tile_stride = weight.stride(0);
  for_each_block(m, tiles, [&](auto nt, int64_t t0, int64_t m0, int mb, const Ahead&) {
    constexpr int NT = decltype(nt)::value;
    if (out_bands.skips(t0 * kTile, (t0 + NT) * kTile, m0, mb)) {
      rows_block<NT>(mb, Inputs{in.x, in.x_row, 0, nullptr, 0, 0, {}}, wp, tile_stride, t0 * kTile, n, m0, ep, op,
                     out_row);  // no inputs: zero sums through the epilogue
      return;
    }
    rows_block<NT>(mb, in, wp + t0 * tile_stride, tile_stride, t0 * kTile, n, m0, ep, op, out_row);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(megapipe, m) {
  m.def("linear_f32(Tensor x, Tensor weight, int n, Tensor? bias, bool swish, Tensor? other, Tensor(a!) out, "
        "Tensor? x2=None, Tensor? x2_start=None, int x2_band=0, Tensor? out_start=None, int out_band=0) -> ()");
}

TORCH_LIBRARY_IMPL(megapipe, CPU, m) { m.impl("linear_f32", &linear_f32); }
