// The bf16 linear kernels' last step (linear_bf16.cpp: vdpbf16ps and AMX tiles): 16 outputs of one row from their
// fp32 sums, + bias, SiLU, * other, rounded once to bf16. Needs AVX512-BF16.
#pragma once

#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "bf16_widen.h"
#include "linear_tiles.h"

namespace megapipe_linear {

using megapipe_bf16::widen;

// x * sigmoid(x), the reciprocal of 1 + exp(-x) from vrcp14ps and one Newton step (relative error ~2^-27, far
// under the bf16 rounding that follows; a division costs several times as much and showed in a long prefill's
// gated MLP). exp's argument stops at 80, so 1 + exp(-x) stays finite and the Newton step never sees inf * 0.
inline __m512 silu(__m512 x) {
  using Vec = at::vec::Vectorized<float>;
  const __m512 e = Vec(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), x), _mm512_set1_ps(80.f))).exp_u20();
  const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.f), e);
  const __m512 r = _mm512_rcp14_ps(d);
  return _mm512_mul_ps(x, _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.f))));
}

inline void store_row(__m512 v, __mmask16 mask, c10::BFloat16* dst) {
  _mm256_mask_storeu_epi16(dst, mask, (__m256i)_mm512_cvtneps_pbh(v));
}

// The same bf16 values widened to fp32 (a head's logits: the sampler's fp32 input without a widening pass of its own)
inline void store_row(__m512 v, __mmask16 mask, float* dst) {
  _mm512_mask_storeu_ps(dst, mask, widen((__m256i)_mm512_cvtneps_pbh(v)));
}

// The outputs col .. col + 15 (those under n) of the tile that starts at col: their lane mask and bias
struct TileColumns {
  int64_t col;
  __mmask16 mask;
  __m512 bias;
  TileColumns(int64_t col_, int64_t n, const Epilogue<c10::BFloat16>& ep) : col(col_), mask(column_mask(col_, n)) {
    bias = ep.bias ? widen(_mm256_maskz_loadu_epi16(mask, ep.bias + col)) : _mm512_setzero_ps();
  }
};

// Row `row`'s outputs of tile `c` from their fp32 sums `v` (Out: bf16, or fp32 holding the bf16-rounded values)
template <typename Out>
inline void finish_row(__m512 v, const TileColumns& c, int64_t row, const Epilogue<c10::BFloat16>& ep, Out* out,
                       int64_t out_row) {
  v = _mm512_add_ps(v, c.bias);
  if (ep.swish) v = silu(v);
  if (ep.other) {
    const __m256i other = _mm256_maskz_loadu_epi16(c.mask, ep.other + row * ep.other_row + c.col);
    v = _mm512_mul_ps(v, widen(other));
  }
  store_row(v, c.mask, out + row * out_row + c.col);
}

}  // namespace megapipe_linear
