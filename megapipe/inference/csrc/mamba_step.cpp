// One decode token of a Mamba-2 layer for every sequence of a batch, in one pass over its state (megapipe.models.
// mamba's conv step, SiLU, dt, state update, read-out and D skip): the engine's state cache calls it for a decode
// run, each row's state read and written where it lies in the pool (its slot), whatever order the slots are in
// (megapipe/inference/kv_cache.py). Torch's ops take four passes over the
// fp32 SSM state ([B, heads, head_dim, state], megabytes per layer) and a temporary as large; here each state row is
// read and written once while it is in registers.
//
// The conv output and everything after it are computed in fp32 (the torch path rounds the conv output and its SiLU
// to the model's dtype first: the same in fp32, an ulp of bf16 apart otherwise).

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

inline float silu(float v) { return v / (1.f + std::exp(-v)); }

inline float softplus(float v) { return v > 20.f ? v : std::log1p(std::exp(v)); }  // F.softplus's threshold

// xbc [B, C] (rows may be strided), raw dt [B, H] (likewise), the pools conv_state [S, C, K-1] and ssm_state
// [S, H, P, N] (fp32) contiguous, row r's at slots[r], updated in place; conv_weight [C, K], conv_bias [C] or
// empty, dt_bias / A / D [H] fp32; out [B, H * P] in xbc's dtype. C = H * P + 2 * G * N.
template <typename T>
void step(const at::Tensor& xbc, const at::Tensor& dt, at::Tensor& conv_state, at::Tensor& ssm_state,
          const int64_t* slots, const at::Tensor& weight, const at::Tensor& bias, const at::Tensor& dt_bias,
          const at::Tensor& A, const at::Tensor& D, double dt_min, double dt_max, int64_t groups, at::Tensor& out) {
  const int64_t batch = xbc.size(0), heads = ssm_state.size(1), P = ssm_state.size(2), N = ssm_state.size(3);
  const int64_t channels = xbc.size(1), K = weight.size(1), inner = heads * P, per_group = heads / groups;
  std::vector<float> act(batch * channels);  // SiLU(conv) of each row: x | B | C
  const T* xp = xbc.const_data_ptr<T>();
  T* cs = conv_state.mutable_data_ptr<T>();
  const T* w = weight.const_data_ptr<T>();
  const T* b = bias.defined() ? bias.const_data_ptr<T>() : nullptr;
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* x = xp + r * xbc.stride(0);
      for (int64_t c = 0; c < channels; ++c) {
        T* window = cs + (slots[r] * channels + c) * (K - 1);
        const T* wc = w + c * K;
        float v = b ? float(b[c]) : 0.f;
        for (int64_t j = 0; j < K - 1; ++j) v += float(window[j]) * float(wc[j]);
        v += float(x[c]) * float(wc[K - 1]);
        for (int64_t j = 0; j + 1 < K - 1; ++j) window[j] = window[j + 1];
        if (K > 1) window[K - 2] = x[c];
        act[r * channels + c] = silu(v);
      }
    }
  });
  const T* dtp = dt.const_data_ptr<T>();
  const float* bias_dt = dt_bias.const_data_ptr<float>();
  const float* Ap = A.const_data_ptr<float>();
  const float* Dp = D.const_data_ptr<float>();
  float* state = ssm_state.mutable_data_ptr<float>();
  T* y = out.mutable_data_ptr<T>();
  at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t r = bh / heads, h = bh % heads, g = h / per_group;
      const float step_dt =
          std::min(std::max(softplus(float(dtp[r * dt.stride(0) + h]) + bias_dt[h]), float(dt_min)), float(dt_max));
      const float decay = std::exp(step_dt * Ap[h]);
      const float* a = act.data() + r * channels;
      const float* Bg = a + inner + g * N;
      const float* Cg = a + inner + groups * N + g * N;
      for (int64_t p = 0; p < P; ++p) {
        const float xv = a[h * P + p], xdt = xv * step_dt;
        float* s = state + ((slots[r] * heads + h) * P + p) * N;
        float lanes[16] = {0.f};
        int64_t n = 0;
        for (; n + 16 <= N; n += 16)
          for (int l = 0; l < 16; ++l) {
            const float v = s[n + l] * decay + xdt * Bg[n + l];
            s[n + l] = v;
            lanes[l] += v * Cg[n + l];
          }
        float acc = 0.f;
        for (; n < N; ++n) {
          const float v = s[n] * decay + xdt * Bg[n];
          s[n] = v;
          acc += v * Cg[n];
        }
        for (int l = 0; l < 16; ++l) acc += lanes[l];
        y[r * inner + h * P + p] = static_cast<T>(acc + Dp[h] * xv);
      }
    }
  });
}

void mamba_step(const at::Tensor& xbc, const at::Tensor& dt, at::Tensor conv_state, at::Tensor ssm_state,
                const at::Tensor& slots, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                const at::Tensor& dt_bias, const at::Tensor& A, const at::Tensor& D, double dt_min, double dt_max,
                int64_t groups, at::Tensor out) {
  TORCH_CHECK(ssm_state.dim() == 4 && ssm_state.is_contiguous() && ssm_state.scalar_type() == at::kFloat,
              "mamba_step: ssm_state must be contiguous fp32 [S, H, P, N]");
  const int64_t batch = xbc.size(0), heads = ssm_state.size(1), P = ssm_state.size(2), N = ssm_state.size(3);
  const auto dtype = xbc.scalar_type();
  TORCH_CHECK(slots.dim() == 1 && slots.numel() == batch && slots.scalar_type() == at::kLong && slots.is_contiguous(),
              "mamba_step: slots must be int64 [B], one per row of xbc");
  const int64_t* slot = slots.const_data_ptr<int64_t>();
  for (int64_t r = 0; r < batch; ++r)
    TORCH_CHECK(slot[r] >= 0 && slot[r] < ssm_state.size(0), "mamba_step: slot ", slot[r], " is outside the pool of ",
                ssm_state.size(0));
  TORCH_CHECK(xbc.dim() == 2 && xbc.size(0) == batch && xbc.stride(1) == 1 && dt.dim() == 2 && dt.size(0) == batch &&
                  dt.size(1) == heads && dt.stride(1) == 1 && dt.scalar_type() == dtype,
              "mamba_step: xbc [B, C] and dt [B, H] need contiguous rows of one dtype");
  TORCH_CHECK(groups > 0 && heads % groups == 0 && xbc.size(1) == heads * P + 2 * groups * N,
              "mamba_step: xbc's width is not heads * head_dim + 2 * groups * state");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.size(0) == xbc.size(1) &&
                  weight.scalar_type() == dtype && conv_state.is_contiguous() && conv_state.scalar_type() == dtype &&
                  conv_state.dim() == 3 && conv_state.size(0) == ssm_state.size(0) &&
                  conv_state.size(1) == xbc.size(1) && conv_state.size(2) == weight.size(1) - 1,
              "mamba_step: conv weight [C, K] and conv_state [S, C, K-1] must be contiguous in xbc's dtype");
  for (const at::Tensor* t : {&dt_bias, &A, &D})
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == at::kFloat && t->numel() == heads,
                "mamba_step: dt_bias, A and D must be fp32 [H]");
  const at::Tensor b = bias.has_value() ? *bias : at::Tensor();
  TORCH_CHECK(!b.defined() || (b.is_contiguous() && b.scalar_type() == dtype && b.numel() == xbc.size(1)),
              "mamba_step: conv bias must be [C] in xbc's dtype");
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == dtype && out.numel() == batch * heads * P,
              "mamba_step: out must be contiguous [B, H * P] in xbc's dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "mamba_step", [&] {
    step<scalar_t>(xbc, dt, conv_state, ssm_state, slot, weight, b, dt_bias, A, D, dt_min, dt_max, groups, out);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(megapipe, m) {
  m.def(
      "mamba_step(Tensor xbc, Tensor dt, Tensor(a!) conv_state, Tensor(b!) ssm_state, Tensor slots, Tensor weight, "
      "Tensor? bias, Tensor dt_bias, Tensor A, Tensor D, float dt_min, float dt_max, int groups, Tensor(c!) out) -> ()");
}

TORCH_LIBRARY_IMPL(megapipe, CPU, m) { m.impl("mamba_step", &mamba_step); }
