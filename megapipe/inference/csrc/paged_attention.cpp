// Attention read in place from the paged KV pool (megapipe/inference/kv_cache.py): every query row (a decode, or
// one token of a prefill chunk) attends to the first `context_lens[row]` positions of its sequence (the last
// `window` of them with a sliding window), whose keys and values are found through the sequence's block table,
// never gathered into a copy. Causal masking is that length: a chunk's row at position p has length p + 1.
//
// One work item per (query row, kv head) covers the `group` query heads that share that kv head, so each key and
// value row is loaded and widened to fp32 once for all of them. Items are taken in a zig-zag order (first, last,
// second, ...) so the threads' contiguous shares mix a chunk's short and long rows. Scores, softmax and the weighted sum of values are
// all in fp32 (ATen's vectorized types and Sleef's exp, as torch's own softmax); only the output is rounded to the
// model's dtype. Built at first use by megapipe/inference/kernels.py for the CPU it runs on.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;

template <typename T>
inline Vec load_float(const T* p) {
  Vec out;
  at::vec::load_to_float<T>(p, out);
  return out;
}

template <>
inline Vec load_float<float>(const float* p) {
  return Vec::loadu(p);
}

// C = head_dim / Vec::size(), known at compile time so a key or value row lives in registers
template <typename T, int C>
void attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
               const at::Tensor& block_table, const at::Tensor& seq_of_row, const at::Tensor& context_lens,
               int64_t block_size, int64_t window, double scale, at::Tensor& out) {
  constexpr int64_t W = Vec::size(), dim = C * W;
  const int64_t batch = q.size(0), heads = q.size(1);
  const int64_t kv_heads = k_pool.size(0), slots = k_pool.size(1), group = heads / kv_heads;
  const int64_t q_row = q.stride(0), q_head = q.stride(1), out_row = out.stride(0);
  const int64_t table_row = block_table.stride(0);
  const T* qp = q.const_data_ptr<T>();
  const T* kp = k_pool.const_data_ptr<T>();
  const T* vp = v_pool.const_data_ptr<T>();
  const int32_t* table = block_table.const_data_ptr<int32_t>();
  const int32_t* lens = context_lens.const_data_ptr<int32_t>();
  const int32_t* seq = seq_of_row.const_data_ptr<int32_t>();
  T* op = out.mutable_data_ptr<T>();
  const Vec vscale(static_cast<float>(scale));

  const int64_t items = batch * kv_heads;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<Vec> qv(group * C), acc(group * C);
    std::vector<float> scores, total(group);
    alignas(64) float row[dim];
    for (int64_t zig = begin; zig < end; ++zig) {
      const int64_t item = zig % 2 == 0 ? zig / 2 : items - 1 - zig / 2;
      const int64_t b = item / kv_heads, g = item % kv_heads;
      const int64_t len = lens[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - first;
      const int32_t* blocks = table + int64_t(seq[b]) * table_row;
      // row `pos` of this sequence and kv head in one of the pools, widened to fp32
      auto load_row = [&](const T* pool, int64_t pos, Vec* into) {
        const T* row = pool + (g * slots + int64_t(blocks[pos / block_size]) * block_size + pos % block_size) * dim;
        for (int c = 0; c < C; ++c) into[c] = load_float(row + c * W);
      };
      for (int64_t j = 0; j < group; ++j) {
        const T* src = qp + b * q_row + (g * group + j) * q_head;
        for (int c = 0; c < C; ++c) qv[j * C + c] = load_float(src + c * W) * vscale;
      }
      scores.resize(group * n);
      for (int64_t t = 0; t < n; ++t) {
        Vec kc[C];
        load_row(kp, first + t, kc);
        for (int64_t j = 0; j < group; ++j) {
          Vec s = qv[j * C] * kc[0];
          for (int c = 1; c < C; ++c) s = at::vec::fmadd(qv[j * C + c], kc[c], s);
          scores[j * n + t] = s.reduce_add();
        }
      }
      for (int64_t j = 0; j < group; ++j) {
        float* s = scores.data() + j * n;
        const float top = at::vec::reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, s, n);
        at::vec::map([top](Vec x) { return (x - Vec(top)).exp(); }, s, s, n);
        total[j] = at::vec::reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, s, n);
      }
      std::fill(acc.begin(), acc.end(), Vec(0.f));
      for (int64_t t = 0; t < n; ++t) {
        Vec vc[C];
        load_row(vp, first + t, vc);
        for (int64_t j = 0; j < group; ++j) {
          const Vec p(scores[j * n + t]);
          for (int c = 0; c < C; ++c) acc[j * C + c] = at::vec::fmadd(p, vc[c], acc[j * C + c]);
        }
      }
      for (int64_t j = 0; j < group; ++j) {
        const Vec inv(1.f / total[j]);
        for (int c = 0; c < C; ++c) (acc[j * C + c] * inv).store(row + c * W);
        T* dst = op + b * out_row + (g * group + j) * dim;
        for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<T>(row[d]);
      }
    }
  });
}

template <typename T>
void dispatch_dim(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                  const at::Tensor& block_table, const at::Tensor& seq_of_row, const at::Tensor& context_lens,
                  int64_t block_size, int64_t window, double scale, at::Tensor& out) {
#define MEGAPIPE_DIM_CASE(c)                                                                                   \
  case c:                                                                                                      \
    return attention<T, c>(q, k_pool, v_pool, block_table, seq_of_row, context_lens, block_size, window, scale, \
                           out);
  switch (q.size(2) / Vec::size()) {
    MEGAPIPE_DIM_CASE(1) MEGAPIPE_DIM_CASE(2) MEGAPIPE_DIM_CASE(3) MEGAPIPE_DIM_CASE(4) MEGAPIPE_DIM_CASE(5)
    MEGAPIPE_DIM_CASE(6) MEGAPIPE_DIM_CASE(8) MEGAPIPE_DIM_CASE(10) MEGAPIPE_DIM_CASE(12)
    MEGAPIPE_DIM_CASE(16)
    default:
      TORCH_CHECK(false, "paged_attention: head dim ", q.size(2), " is not supported");
  }
#undef MEGAPIPE_DIM_CASE
}

void paged_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                     const at::Tensor& block_table, const at::Tensor& seq_of_row, const at::Tensor& context_lens,
                     int64_t block_size, int64_t window, double scale, at::Tensor out) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [rows, heads, dim] with contiguous rows");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.sizes() == v_pool.sizes(),
              "k_pool and v_pool must be contiguous [kv_heads, slots, dim]");
  TORCH_CHECK(k_pool.size(2) == q.size(2) && q.size(2) % Vec::size() == 0, "head dim must be a multiple of ",
              Vec::size());
  TORCH_CHECK(q.size(1) % k_pool.size(0) == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 2 && block_table.stride(1) == 1,
              "block_table must be int32 [sequences, blocks]");
  const int64_t rows = q.size(0), sequences = block_table.size(0), width = block_table.size(1);
  TORCH_CHECK(seq_of_row.scalar_type() == at::kInt && seq_of_row.is_contiguous() && seq_of_row.numel() == rows &&
                  context_lens.scalar_type() == at::kInt && context_lens.is_contiguous() &&
                  context_lens.numel() == rows, "seq_of_row and context_lens must be int32 [rows]");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == rows && out.size(1) == q.size(1) * q.size(2) &&
                  out.stride(1) == 1 && out.scalar_type() == q.scalar_type(), "out must be [rows, heads * dim]");
  TORCH_CHECK(k_pool.scalar_type() == q.scalar_type(), "q and the pool must have one dtype");
  // every block a row reads must be in the pool: a bad table would read outside it
  const int32_t* seq = seq_of_row.const_data_ptr<int32_t>();
  const int32_t* lens = context_lens.const_data_ptr<int32_t>();
  const int32_t* table = block_table.const_data_ptr<int32_t>();
  const int64_t pool_blocks = k_pool.size(1) / block_size;
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(seq[r] >= 0 && seq[r] < sequences, "row ", r, " names sequence ", seq[r], " of ", sequences);
    TORCH_CHECK(lens[r] >= 1 && (lens[r] + block_size - 1) / block_size <= width, "row ", r, " attends to ",
                lens[r], " positions, more than its block table holds");
    for (int64_t i = 0; i < (lens[r] + block_size - 1) / block_size; ++i) {
      const int32_t block = table[seq[r] * block_table.stride(0) + i];
      TORCH_CHECK(block >= 0 && block < pool_blocks, "row ", r, " reads block ", block, " outside the pool");
    }
  }
  switch (q.scalar_type()) {
    case at::kFloat:
      return dispatch_dim<float>(q, k_pool, v_pool, block_table, seq_of_row, context_lens, block_size, window,
                                 scale, out);
    case at::kBFloat16:
      return dispatch_dim<c10::BFloat16>(q, k_pool, v_pool, block_table, seq_of_row, context_lens, block_size,
                                         window, scale, out);
    case at::kHalf:
      return dispatch_dim<c10::Half>(q, k_pool, v_pool, block_table, seq_of_row, context_lens, block_size, window,
                                     scale, out);
    default:
      TORCH_CHECK(false, "paged_attention: unsupported dtype ", q.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY(megapipe, m) {
  m.def(
      "paged_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_table, Tensor seq_of_row, "
      "Tensor context_lens, int block_size, int window, float scale, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(megapipe, CPU, m) {
  m.impl("paged_attention", &paged_attention);
}
