// The elementwise work of a dense decoder layer in one pass each, for the engine's DecoderLayer
// (megapipe/inference/runner.py): torch spends more time dispatching its ~10 small operations per layer than
// computing them when a step holds a few tokens.
//
// Every rounding is the one the torch operations make, in the same order (each product or sum taken in fp32 and
// rounded to the tensor's dtype), so rope_and_cache is bit-exact with them; the RMSNorm sums its squares in its
// own order, which can move the fp32 variance by an ulp.

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

namespace {

template <typename T>
inline T round_to(float x) {
  return static_cast<T>(x);
}

// rows of `width` elements per parallel task: at least ~16k elements, so a decode step's few rows stay on one thread
inline int64_t grain(int64_t width) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, width));
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
        for (int64_t i = 0; i < n; ++i) h[i] = round_to<T>(float(h[i]) + float(d[i]));
      }
      float lanes[16] = {0.f};
      int64_t i = 0;
      for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; ++l) lanes[l] += float(src[i + l]) * float(src[i + l]);
      float ss = 0.f;
      for (; i < n; ++i) ss += float(src[i]) * float(src[i]);
      for (int l = 0; l < 16; ++l) ss += lanes[l];
      const float inv = 1.f / std::sqrt(ss / float(n) + eps);
      T* dst = out + r * out_row;
      for (int64_t j = 0; j < n; ++j) dst[j] = round_to<T>(float(w[j]) * float(round_to<T>(float(src[j]) * inv)));
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
