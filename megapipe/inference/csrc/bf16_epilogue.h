// The bf16 linear kernels' last step (linear_bf16.cpp: vdpbf16ps and AMX tiles): 16 outputs of one row from their
// fp32 sums, + bias, SiLU, * other, rounded once to bf16. Needs AVX512-BF16.
#pragma once

#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "linear_tiles.h"

namespace megapipe_linear {

inline __m512 bf16_to_fp32(__m256i v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// The outputs col .. col + 15 (those under n) of the tile that starts at col: their lane mask and bias
struct TileColumns {
  int64_t col;
  __mmask16 mask;
  __m512 bias;
  TileColumns(int64_t col_, int64_t n, const Epilogue<c10::BFloat16>& ep) : col(col_) {
    const int64_t valid = std::min<int64_t>(kTile, n - col);
    mask = valid >= kTile ? __mmask16(0xffff) : __mmask16((1u << valid) - 1);
    bias = ep.bias ? bf16_to_fp32(_mm256_maskz_loadu_epi16(mask, ep.bias + col)) : _mm512_setzero_ps();
  }
};

// Row `row`'s outputs of tile `c` from their fp32 sums `v`
inline void finish_row(__m512 v, const TileColumns& c, int64_t row, const Epilogue<c10::BFloat16>& ep,
                       c10::BFloat16* out, int64_t out_row) {
  using Vec = at::vec::Vectorized<float>;
  v = _mm512_add_ps(v, c.bias);
  if (ep.swish) {
    const Vec x(v);
    v = x / (Vec(1.f) + x.neg().exp_u20());  // exp to ~2 ulp: far under the bf16 rounding that follows
  }
  if (ep.other) v = _mm512_mul_ps(v, bf16_to_fp32(_mm256_maskz_loadu_epi16(c.mask, ep.other + row * ep.other_row + c.col)));
  _mm256_mask_storeu_epi16(out + row * out_row + c.col, c.mask, (__m256i)_mm512_cvtneps_pbh(v));
}

}  // namespace megapipe_linear
