// 16 bf16 values widened to fp32, exactly: each one's 16 bits become the high half of an fp32. AVX-512F only, so
// the kernels built without AVX512-BF16 (layer_ops) share it with those built with it.
#pragma once

#include <immintrin.h>

#if defined(__AVX512F__)
namespace megapipe_bf16 {

inline __m512 widen(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

}  // namespace megapipe_bf16
#endif
