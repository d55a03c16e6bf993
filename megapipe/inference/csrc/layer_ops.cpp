// The elementwise work of a dense decoder layer in one pass each, for the engine's DecoderLayer
// (megapipe/inference/runner.py): torch spends more time dispatching its ~10 small operations per layer than
// computing them when a step holds a few tokens.
//
// Every rounding is the one the torch operations make, in the same order (each product or sum taken in fp32 and
// rounded to the tensor's dtype), so rope_and_cache is bit-exact with them; the RMSNorm sums its squares in its
// own order, which can move the fp32 variance by an ulp. bf16 on AVX-512 goes 16 elements at a time (rms_norm at
// 1024 x 576 on the AMX Xeon, 2 threads: 101 -> 69 us), rounded by vcvtneps2bf16 where the CPU has AVX512-BF16:
// the same bits but for results under bf16's normal range (flushed to zero) and a NaN's payload.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "bf16_widen.h"

namespace {

template <typename T>
inline T round_to(float x) {
  return static_cast<T>(x);
}

// rows of `width` elements per parallel task: at least ~16k elements, so a decode step's few rows stay on one thread
inline int64_t grain(int64_t width) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, width));
}

#if defined(CPU_CAPABILITY_AVX512)
// 16 bf16 values widened to fp32, and fp32 rounded to bf16 as c10::BFloat16 rounds (to nearest even, a NaN to
// 0x7fc0): GCC leaves c10's per-element conversions scalar. With AVX512-BF16, vcvtneps2bf16 rounds in one
// instruction, the same bits but for denormals (flushed to zero) and a NaN's payload (kept).
inline __m512 bf16_load(const c10::BFloat16* p) {
  return megapipe_bf16::widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m256i bf16_round(__m512 v) {
#if defined(__AVX512BF16__)
  return (__m256i)_mm512_cvtneps_pbh(v);
#else
  const __m512i u = _mm512_castps_si512(v);
  const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(_mm512_srli_epi32(u, 16),
                                                                                    _mm512_set1_epi32(1)));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc0)));
#endif
}
inline void bf16_store(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_round(v));
}
// bf16 to bf16 as the scalar code rounds: x rounded once more after each fp32 operation
inline __m512 bf16_again(__m512 v) {
  return megapipe_bf16::widen(bf16_round(v));
}

// rope_and_cache's rotation of one bf16 head (half a multiple of 16), 16 elements of each half at a time with the
// same roundings
inline void rope_head_bf16(c10::BFloat16* head, const c10::BFloat16* c, const c10::BFloat16* s, int64_t half) {
  for (int64_t i = 0; i < half; i += 16) {
    const __m512 a = bf16_load(head + i), b = bf16_load(head + half + i);
    const __m512 first = _mm512_add_ps(bf16_again(_mm512_mul_ps(a, bf16_load(c + i))),
                                       bf16_again(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), b),
                                                                bf16_load(s + i))));
    const __m512 second = _mm512_add_ps(bf16_again(_mm512_mul_ps(b, bf16_load(c + half + i))),
                                        bf16_again(_mm512_mul_ps(a, bf16_load(s + half + i))));
    bf16_store(head + i, first);
    bf16_store(head + half + i, second);
  }
}
#endif

// The leading elements of each of rms_norm_rows's passes over a row that a bf16 row on AVX-512 takes 16 at a time,
// with the same roundings and the same lanes of the squares' sums; each returns where the row's scalar loop goes on
// (0: it does them all)
template <typename T>
int64_t add_leading(T* h, const T* d, int64_t n) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) bf16_store(h + i, _mm512_add_ps(bf16_load(h + i), bf16_load(d + i)));
    return i;
  }
#endif
  return 0;
}
template <typename T>
int64_t square_leading(const T* src, int64_t n, float (&lanes)[16]) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    __m512 sums = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) sums = _mm512_add_ps(sums, _mm512_mul_ps(bf16_load(src + i), bf16_load(src + i)));
    _mm512_storeu_ps(lanes, sums);
    return i;
  }
#endif
  return 0;
}
template <typename T>
int64_t scale_leading(const T* src, const T* w, T* dst, int64_t n, float inv) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
      bf16_store(dst + i, _mm512_mul_ps(bf16_load(w + i), bf16_again(_mm512_mul_ps(bf16_load(src + i),
                                                                                    _mm512_set1_ps(inv)))));
    return i;
  }
#endif
  return 0;
}

// out = rms_norm(x) row by row; with `delta`, x += delta first (x is then the writable `add_into`)
template <typename T>
void rms_norm_rows(const T* x, const T* w, T* out, int64_t rows, int64_t n, int64_t x_row, int64_t out_row,
                   float eps, T* add_into, const T* delta, int64_t d_row) {
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* src = x + r * x_row;
      if (delta) {  // h += delta, rounded as add_ rounds, then normalise the new h
        T* h = add_into + r * x_row;
        const T* d = delta + r * d_row;
        for (int64_t i = add_leading(h, d, n); i < n; ++i) h[i] = round_to<T>(float(h[i]) + float(d[i]));
      }
      float lanes[16] = {0.f};
      int64_t i = square_leading(src, n, lanes);
      for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; ++l) lanes[l] += float(src[i + l]) * float(src[i + l]);
      float ss = 0.f;
      for (; i < n; ++i) ss += float(src[i]) * float(src[i]);
      for (int l = 0; l < 16; ++l) ss += lanes[l];
      const float inv = 1.f / std::sqrt(ss / float(n) + eps);
      T* dst = out + r * out_row;
      for (int64_t j = scale_leading(src, w, dst, n, inv); j < n; ++j)
        dst[j] = round_to<T>(float(w[j]) * float(round_to<T>(float(src[j]) * inv)));
    }
  });
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [rows, features] with contiguous rows");
}

// out = weight * (x * rsqrt(mean(x^2) + eps)), the normalisation in fp32 rounded to x's dtype first (RMSNorm)
void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor out) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type() &&
                  out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type(),
              "rms_norm: x, weight and out must agree in shape and dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.const_data_ptr<scalar_t>(), weight.const_data_ptr<scalar_t>(),
                            out.mutable_data_ptr<scalar_t>(), x.size(0), x.size(1), x.stride(0), out.stride(0),
                            float(eps), nullptr, nullptr, 0);
  });
}

// h += delta (in place, as h.add_(delta)), then out = rms_norm(h): the residual add and the next norm in one pass
void add_rms_norm(at::Tensor h, const at::Tensor& delta, const at::Tensor& weight, double eps, at::Tensor out) {
  check_rows(h, "h");
  check_rows(delta, "delta");
  check_rows(out, "out");
  TORCH_CHECK(delta.sizes() == h.sizes() && delta.scalar_type() == h.scalar_type() && weight.is_contiguous() &&
                  weight.numel() == h.size(1) && weight.scalar_type() == h.scalar_type() &&
                  out.sizes() == h.sizes() && out.scalar_type() == h.scalar_type(),
              "add_rms_norm: h, delta, weight and out must agree in shape and dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, h.scalar_type(), "add_rms_norm", [&] {
    scalar_t* hp = h.mutable_data_ptr<scalar_t>();
    rms_norm_rows<scalar_t>(hp, weight.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(), h.size(0),
                            h.size(1), h.stride(0), out.stride(0), float(eps), hp, delta.const_data_ptr<scalar_t>(),
                            delta.stride(0));
  });
}

// qkv [T, (q_heads + 2 kv_heads) * D], the fused projection: rotary embedding in place on its q and k heads
// (x * cos + rotate_half(x) * sin, each product and the sum rounded as torch's mul_ / add_ round them), then its k
// and v heads stored in the pool at their slots (k_pool / v_pool [kv_heads, slots, D]).
void rope_and_cache(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_pool,
                    at::Tensor v_pool, const at::Tensor& slots, int64_t q_heads, int64_t kv_heads) {
  check_rows(qkv, "qkv");
  const int64_t tokens = qkv.size(0), dim = k_pool.size(2), half = dim / 2, pool_slots = k_pool.size(1);
  TORCH_CHECK(qkv.size(1) == (q_heads + 2 * kv_heads) * dim && dim % 2 == 0 && dim <= 1024, "rope_and_cache: qkv is not ",
              q_heads, " + 2 x ", kv_heads, " heads of ", dim);
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == tokens * dim && sin.numel() == tokens * dim &&
                  cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(),
              "rope_and_cache: cos and sin must be contiguous [T, D] in qkv's dtype");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.sizes() == v_pool.sizes() &&
                  k_pool.size(0) == kv_heads && k_pool.scalar_type() == qkv.scalar_type(),
              "rope_and_cache: the pool must be contiguous [kv_heads, slots, D] in qkv's dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == tokens,
              "rope_and_cache: slots must be int64 [T]");
  const int64_t* sp = slots.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < pool_slots, "rope_and_cache: slot ", sp[t], " is outside the pool");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_and_cache", [&] {
    using T = scalar_t;
    T* base = qkv.mutable_data_ptr<T>();
    const T* cp = cos.const_data_ptr<T>();
    const T* snp = sin.const_data_ptr<T>();
    T* kp = k_pool.mutable_data_ptr<T>();
    T* vp = v_pool.mutable_data_ptr<T>();
    const int64_t row = qkv.stride(0), rotated = q_heads + kv_heads;
    at::parallel_for(0, tokens, grain(qkv.size(1)), [&](int64_t begin, int64_t end) {
      float x[1024];
      for (int64_t t = begin; t < end; ++t) {
        const T* c = cp + t * dim;
        const T* s = snp + t * dim;
        for (int64_t h = 0; h < rotated; ++h) {
          T* head = base + t * row + h * dim;
#if defined(CPU_CAPABILITY_AVX512)
          if constexpr (std::is_same_v<T, c10::BFloat16>) {
            if (half % 16 == 0) {
              rope_head_bf16(reinterpret_cast<c10::BFloat16*>(head), reinterpret_cast<const c10::BFloat16*>(c),
                             reinterpret_cast<const c10::BFloat16*>(s), half);
              continue;
            }
          }
#endif
          for (int64_t i = 0; i < dim; ++i) x[i] = float(head[i]);
          for (int64_t i = 0; i < dim; ++i) {
            const float turned = i < half ? -x[i + half] : x[i - half];
            head[i] = round_to<T>(float(round_to<T>(x[i] * float(c[i]))) + float(round_to<T>(turned * float(s[i]))));
          }
        }
        for (int64_t g = 0; g < kv_heads; ++g) {
          const T* k = base + t * row + (q_heads + g) * dim;
          const T* v = k + kv_heads * dim;
          T* kd = kp + (g * pool_slots + sp[t]) * dim;
          T* vd = vp + (g * pool_slots + sp[t]) * dim;
          std::memcpy(kd, k, dim * sizeof(T));  // an element loop over c10's BFloat16 is not vectorized
          std::memcpy(vd, v, dim * sizeof(T));
        }
      }
    });
  });
}

// out[r] = the index of row r's largest value, the first of equal ones, or of its first NaN if it has one (what
// torch.max(x, -1).indices gives): one vectorised pass for the maximum and one that stops at its first occurrence.
// torch's max with indices tracks an index per element and took 4x amax's time on a decode step's logits.
void argmax_rows(const at::Tensor& x, at::Tensor out) {
  using Vec = at::vec::Vectorized<float>;
  constexpr int64_t W = Vec::size();
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1 && x.size(1) > 0,
              "argmax_rows: x must be fp32 [rows, n > 0] with contiguous rows");
  TORCH_CHECK(out.scalar_type() == at::kLong && out.dim() == 1 && out.size(0) == x.size(0) && out.stride(0) == 1,
              "argmax_rows: out must be int64 [rows]");
  const int64_t n = x.size(1), x_row = x.stride(0);
  const float* base = x.const_data_ptr<float>();
  int64_t* dst = out.mutable_data_ptr<int64_t>();
  at::parallel_for(0, x.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* p = base + r * x_row;
      Vec top(-std::numeric_limits<float>::infinity());
      int64_t i = 0;
      for (; i + W <= n; i += W) top = at::vec::maximum(top, Vec::loadu(p + i));  // NaN propagates
      float lanes[W];
      top.store(lanes);
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t l = 0; l < W; ++l) m = (std::isnan(lanes[l]) || lanes[l] > m) ? lanes[l] : m;
      for (int64_t j = i; j < n && !std::isnan(m); ++j) m = (std::isnan(p[j]) || p[j] > m) ? p[j] : m;
      int64_t at = 0;
      if (std::isnan(m)) {
        while (!std::isnan(p[at])) ++at;
      } else {
        const Vec want(m);
        int64_t j = 0;
        for (; j + W <= n; j += W) {
          const int hits = ~Vec::loadu(p + j).eq(want).zero_mask() & ((1 << W) - 1);
          if (hits) break;
        }
        while (p[j] != m) ++j;
        at = j;
      }
      dst[r] = at;
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(megapipe, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor(a!) out) -> ()");
  m.def("add_rms_norm(Tensor(a!) h, Tensor delta, Tensor weight, float eps, Tensor(b!) out) -> ()");
  m.def(
      "rope_and_cache(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor(b!) k_pool, Tensor(c!) v_pool, Tensor slots, "
      "int q_heads, int kv_heads) -> ()");
  m.def("argmax_rows(Tensor x, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(megapipe, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope_and_cache", &rope_and_cache);
  m.impl("argmax_rows", &argmax_rows);
}
