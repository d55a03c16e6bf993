// Attention read in place from the paged KV pool (megapipe/inference/kv_cache.py): every query row (a decode, or
// one token of a prefill chunk) attends to the first `context_lens[row]` positions of its sequence (the last
// `window` of them with a sliding window), whose keys and values are found through the sequence's block table,
// never gathered into a copy. Causal masking is that length: a chunk's row at position p has length p + 1.
//
// A decode row is one work item per kv head, covering the `group` query heads that share it, so each key and value
// row is loaded and widened to fp32 once for all of them. A prefill chunk's consecutive rows go in runs of as many
// as fill a vector's lanes with (row, query head) pairs (5 rows of 3 heads with AVX512): one key row then scores
// all of them at once, one vector of scores per key, and the softmax runs down the keys with no sums across lanes.
// Items are taken in a zig-zag order (first, last, second, ...) so the threads' contiguous shares mix a chunk's
// short and long rows. Scores, softmax and the weighted sum of values are all in fp32 (ATen's vectorized types and
// Sleef's exp, as torch's own softmax); only the output is rounded to the model's dtype. With `sinks` (fp32, one
// logit per query head: GPT-OSS's attention sinks) each row's softmax has one more term in its denominator, taken
// into its running max as well. A decode row prefetches its key and value rows about 4 KB ahead of use (a
// sequence's blocks lie anywhere in the pool, where the hardware's stream prefetcher stops): 1.5x at 32 decodes of
// 164 positions whose keys are not in cache; a prefill chunk's runs reread their keys from cache, and prefetching
// there cost 20% (both measured on this kernel alone). Built at first use by
// megapipe/inference/kernels.py for the CPU it runs on.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "parallel_tasks.h"

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

// One row's result for its `group` heads, from fp32 accumulators, rounded once to the model's dtype
template <typename T>
inline void store_row(T* dst, const Vec& v) {
  if constexpr (std::is_same_v<T, float>) {
    v.store(dst);
  } else {
    at::vec::convert_from_float<T>(v, v).store(dst, Vec::size());
  }
}

// Everything one call shares: the pools, the tables and the output
template <typename T>
struct Step {
  const T *q, *k, *v;
  const int32_t *table, *lens, *seq;
  T* out;
  const float* sinks;  // [heads] or nullptr
  int64_t q_row, q_head, out_row, table_row, slots, block_size, window, group;
  float scale;
  // where the keys first .. first + n - 1 of sequence `b` and kv head g lie in either pool (element offsets),
  // found through its block table once per work item rather than once per key and pass
  void key_offsets(int64_t b, int64_t g, int64_t first, int64_t n, int64_t dim, std::vector<int64_t>& at) const {
    const int32_t* blocks = table + int64_t(seq[b]) * table_row;
    at.resize(n);
    int64_t block = first / block_size, in_block = first % block_size;  // one division, not two per key
    for (int64_t t = 0; t < n; ++t) {
      at[t] = (g * slots + int64_t(blocks[block]) * block_size + in_block) * dim;
      if (++in_block == block_size) in_block = 0, ++block;
    }
  }
  int64_t first_key(int64_t b) const {
    return window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0;
  }
};

// Asks for the cache lines of the `bytes` bytes at p: a sequence's blocks lie anywhere in the pool, so the
// hardware's stream prefetcher stops at each block's end. Into L2 (low temporal locality: prefetcht2), whose queue
// of misses is deeper than L1's: asked into L1, a core's requests in flight bounded the stream (Zen 4, 64 decodes
// of 128 / 192 positions from memory: 352 -> 305 / 550 -> 447 us a layer).
inline void prefetch_row(const void* p, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(static_cast<const char*>(p) + line, 0, 1);
}

// how many keys ahead of the one in use are asked for: about 4 KB of the pool ahead
template <typename T>
constexpr int64_t keys_ahead(int64_t dim) {
  return std::max<int64_t>(2, 4096 / (dim * int64_t(sizeof(T))));
}

// f(std::integral_constant<int, G>) with G = the group of query heads per kv head where it is 1-4, so a decode
// row's queries and sums live in registers (kept in a std::vector, the compiler stored and reloaded the sums at
// every value: 64 decodes of 96 keys 209 -> 185 us), else G = 0: any group, in memory
template <typename F>
inline void with_group(int64_t group, const F& f) {
  switch (group) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    default: return f(std::integral_constant<int, 0>{});
  }
}

// row = the pool's row at[t] (of rows 0 .. n - 1) widened to fp32 (C vectors); the row ~4 KB ahead asked for.
// Inlined always, as `products`: left to the compiler, the four-key scores came out ~25% slower.
template <typename T, int C>
__attribute__((always_inline)) inline void load_row(const T* pool, const int64_t* at, int64_t t, int64_t n,
                                                    Vec* row) {
  constexpr int64_t W = Vec::size(), dim = C * W;
  constexpr int64_t kAhead = keys_ahead<T>(dim);
  if (t + kAhead < n) prefetch_row(pool + at[t + kAhead], dim * sizeof(T));
  for (int c = 0; c < C; ++c) row[c] = load_float(pool + at[t] + c * W);
}

// f(t, row) for t = 0 .. n - 1, `row` the pool's row at[t] (load_row)
template <typename T, int C, typename F>
inline void for_each_row(const T* pool, const int64_t* at, int64_t n, const F& f) {
  for (int64_t t = 0; t < n; ++t) {
    Vec row[C];
    load_row<T, C>(pool, at, t, n, row);
    f(t, row);
  }
}

// The lanes of q . key's products, summed over the C vectors of a head (not yet across lanes)
template <int C>
__attribute__((always_inline)) inline Vec products(const Vec* q, const Vec* key) {
  Vec d = q[0] * key[0];
  for (int c = 1; c < C; ++c) d = at::vec::fmadd(q[c], key[c], d);
  return d;
}

#if defined(CPU_CAPABILITY_AVX512)
// The sums of the 16 lanes of each of a, b, c, d, in that order: two rounds of interleaving pairs and adding them
// leave each 128-bit lane holding partial sums of all four, then two folds of the 128-bit lanes (13 instructions
// for four sums, where a horizontal sum each takes 8)
inline __m128 sums_of_four(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512 abcd = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))),
                                    _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))));
  const __m512 halves = _mm512_add_ps(abcd, _mm512_shuffle_f32x4(abcd, abcd, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm512_castps512_ps128(_mm512_add_ps(halves, _mm512_shuffle_f32x4(halves, halves, _MM_SHUFFLE(2, 3, 0, 1))));
}
#endif

// A decode row's scores for its `group` heads (G as in with_group):
// scores[j * n + t] = q_j . k_t, each key row loaded and widened once for all heads. With AVX-512 and a group in
// registers, four keys at a time, their products summed across lanes together (sums_of_four) instead of a
// horizontal sum per key and head: 64 decodes of 128 positions (9 heads on 3 kv heads of 64) 300 -> 223 us a
// layer with the pool in cache, 420 -> 357 us from memory.
template <typename T, int C, int G>
inline void score_keys(const Step<T>& s, int64_t n, const Vec* qv, const int64_t* at, float* scores) {
  const int64_t group = G > 0 ? G : s.group;
  Vec local[G > 0 ? G * C : 1];
  if (G > 0)
    for (int64_t i = 0; i < group * C; ++i) local[i] = qv[i];
  const Vec* q = G > 0 ? local : qv;
  int64_t first = 0;
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (G > 0) {
    for (; first + 4 <= n; first += 4) {
      __m512 part[G][4];
      for (int u = 0; u < 4; ++u) {
        Vec key[C];
        load_row<T, C>(s.k, at, first + u, n, key);
        for (int j = 0; j < G; ++j) part[j][u] = products<C>(q + j * C, key);
      }
      for (int j = 0; j < G; ++j)
        _mm_storeu_ps(scores + j * n + first, sums_of_four(part[j][0], part[j][1], part[j][2], part[j][3]));
    }
  }
#endif
  for_each_row<T, C>(s.k, at + first, n - first, [&](int64_t i, const Vec* key) {
    for (int64_t j = 0; j < group; ++j) scores[j * n + first + i] = products<C>(q + j * C, key).reduce_add();
  });
}

// The weighted sum of a decode row's values for its `group` heads (G as in with_group; 0: the sums in `acc`):
// acc[j * C + c] = sum_t p[j][t] v[t]
template <typename T, int C, int G>
inline void weigh_values(const Step<T>& s, int64_t n, const float* p, const int64_t* at, Vec* acc) {
  const int64_t group = G > 0 ? G : s.group;
  Vec local[G > 0 ? G * C : 1];
  Vec* sums = G > 0 ? local : acc;
  for (int64_t i = 0; i < group * C; ++i) sums[i] = Vec(0.f);
  for_each_row<T, C>(s.v, at, n, [&](int64_t t, const Vec* value) {
    for (int64_t j = 0; j < group; ++j) {
      const Vec pj(p[j * n + t]);
      for (int c = 0; c < C; ++c) sums[j * C + c] = at::vec::fmadd(pj, value[c], sums[j * C + c]);
    }
  });
  if (G > 0)
    for (int64_t i = 0; i < group * C; ++i) acc[i] = sums[i];
}

// C = head_dim / Vec::size(), known at compile time so a key or value row lives in registers.
// One row (a decode) and kv head: its `group` query heads share each key and value row, loaded and widened once.
template <typename T, int C>
void attend_row(const Step<T>& s, int64_t b, int64_t g, std::vector<Vec>& qv, std::vector<Vec>& acc,
                std::vector<float>& scores, std::vector<float>& total, std::vector<int64_t>& at) {
  constexpr int64_t W = Vec::size(), dim = C * W;
  const int64_t group = s.group, first = s.first_key(b), n = s.lens[b] - first;
  constexpr int64_t kAhead = keys_ahead<T>(dim);
  const Vec vscale(s.scale);
  for (int64_t j = 0; j < group; ++j) {
    const T* src = s.q + b * s.q_row + (g * group + j) * s.q_head;
    for (int c = 0; c < C; ++c) qv[j * C + c] = load_float(src + c * W) * vscale;
  }
  s.key_offsets(b, g, first, n, dim, at);
  scores.resize(group * n);
  for (int64_t t = 0; t < std::min(n, kAhead); ++t) prefetch_row(s.k + at[t], dim * sizeof(T));
  with_group(group, [&](auto G) { score_keys<T, C, G.value>(s, n, qv.data(), at.data(), scores.data()); });
  for (int64_t j = 0; j < group; ++j) {
    float* p = scores.data() + j * n;
    float top = at::vec::reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, p, n);
    const float sink = s.sinks ? s.sinks[g * group + j] : 0.f;
    if (s.sinks) top = std::max(top, sink);
    at::vec::map([top](Vec x) { return (x - Vec(top)).exp(); }, p, p, n);
    total[j] = at::vec::reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, p, n);
    if (s.sinks) total[j] += std::exp(sink - top);
  }
  for (int64_t t = 0; t < std::min(n, kAhead); ++t) prefetch_row(s.v + at[t], dim * sizeof(T));
  with_group(group, [&](auto G) { weigh_values<T, C, G.value>(s, n, scores.data(), at.data(), acc.data()); });
  for (int64_t j = 0; j < group; ++j) {
    const Vec inv(1.f / total[j]);
    T* dst = s.out + b * s.out_row + (g * group + j) * dim;
    for (int c = 0; c < C; ++c) store_row(dst + c * W, acc[j * C + c] * inv);
  }
}

// Scores of keys t0 .. t0 + kb - 1 (kb <= KB) for a run's lanes, from q^T [dim][lanes] (scaled, fp32): the keys
// widened into `keys` once, then KB sums in flight, each query vector loaded once per KB keys and each key element
// broadcast from memory into its multiply-add (one key at a time, each query vector and key element loaded per
// product, the loads bound it: 16 x 64-token prompts' attention 0.8 -> 0.6 ms). A last block of fewer keys
// scores its last key again in the spare sums.
template <typename T, int C, int KB, typename Store>
inline void score_block(const float* q, const T* k, const int64_t* at, int64_t t0, int64_t kb, float* keys,
                        const Store& store) {
  constexpr int64_t W = Vec::size(), dim = C * W;
  for (int j = 0; j < KB; ++j) {
    const T* row = k + at[t0 + std::min<int64_t>(j, kb - 1)];
    for (int c = 0; c < C; ++c) load_float(row + c * W).store(keys + j * dim + c * W);
  }
  Vec acc[KB];
  for (int j = 0; j < KB; ++j) acc[j] = Vec(0.f);
  for (int64_t d0 = 0; d0 < dim; d0 += 8) {
    Vec qv[8];
    for (int i = 0; i < 8; ++i) qv[i] = Vec::loadu(q + (d0 + i) * W);
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i)
#pragma GCC unroll 16
      for (int j = 0; j < KB; ++j) acc[j] = at::vec::fmadd(qv[i], Vec(keys[j * dim + d0 + i]), acc[j]);
  }
  for (int j = 0; j < kb; ++j) store(t0 + j, acc[j]);
}

// Rows b0 .. b0 + rows - 1 of one sequence at consecutive positions (part of a prefill chunk) and kv head g, with
// a (row, query head) pair in each vector lane: every key and value row is loaded once for all of them, and the
// scores come out one vector per key, so the softmax runs down the keys with no sums across lanes. Lanes past
// rows x group repeat the first row's and are dropped.
template <typename T, int C>
void attend_rows(const Step<T>& s, int64_t b0, int64_t rows, int64_t g, std::vector<float>& qt,
                 std::vector<float>& scores, std::vector<int64_t>& at) {
  constexpr int64_t W = Vec::size(), dim = C * W;
  const int64_t group = s.group, lanes = rows * group;
  const Vec vscale(s.scale);
  alignas(64) float len_lane[W], first_lane[W], sink_lane[W];
  for (int64_t l = 0; l < W; ++l) {
    const int64_t b = b0 + (l < lanes ? l / group : 0), j = l < lanes ? l % group : 0;
    len_lane[l] = float(s.lens[b]);
    first_lane[l] = float(s.first_key(b));
    sink_lane[l] = s.sinks ? s.sinks[g * group + j] : -std::numeric_limits<float>::infinity();
    const T* src = s.q + b * s.q_row + (g * group + j) * s.q_head;
    for (int c = 0; c < C; ++c) (load_float(src + c * W) * vscale).store(qt.data() + l * dim + c * W);
  }
  at::vec::transpose_mxn<float>(qt.data(), dim, qt.data() + W * dim, W, W, dim);  // q^T: [dim][lanes]
  const Vec lens_v = Vec::loadu(len_lane), firsts_v = Vec::loadu(first_lane);
  const Vec minus_inf(-std::numeric_limits<float>::infinity());
  const int64_t first = s.first_key(b0), n = s.lens[b0 + rows - 1] - first;
  s.key_offsets(b0, g, first, n, dim, at);
  scores.resize(n * W);
  // key t's scores, masked per lane: causal and sliding window
  auto store_scores = [&](int64_t t, Vec sum) {
    const Vec pos(float(first + t));
    Vec::blendv(minus_inf, sum, (pos < lens_v) & (pos >= firsts_v)).store(scores.data() + t * W);
  };
  constexpr int KB = 8;
  alignas(64) float keys[KB * dim];
  for (int64_t t = 0; t < n; t += KB)
    score_block<T, C, KB>(qt.data() + W * dim, s.k, at.data(), t, std::min<int64_t>(KB, n - t), keys, store_scores);
  const Vec sink_v = Vec::loadu(sink_lane);
  Vec top = sink_v, total(0.f);  // no sinks: -inf lanes, exp(-inf) = 0 below
  for (int64_t t = 0; t < n; ++t) top = at::vec::maximum(top, Vec::loadu(scores.data() + t * W));
  for (int64_t t = 0; t < n; ++t) {
    const Vec p = (Vec::loadu(scores.data() + t * W) - top).exp();
    p.store(scores.data() + t * W);
    total = total + p;
  }
  if (s.sinks) total = total + (sink_v - top).exp();
  alignas(64) float inv[W];
  (Vec(1.f) / total).store(inv);
  for (int c = 0; c < C; ++c) {
    Vec acc[W];
    for (int64_t l = 0; l < W; ++l) acc[l] = Vec(0.f);
    for (int64_t t = 0; t < n; ++t) {
      const Vec v = load_float(s.v + at[t] + c * W);
      const float* p = scores.data() + t * W;
      for (int64_t l = 0; l < W; ++l) acc[l] = at::vec::fmadd(Vec(p[l]), v, acc[l]);
    }
    for (int64_t l = 0; l < lanes; ++l)
      store_row(s.out + (b0 + l / group) * s.out_row + (g * group + l % group) * dim + c * W, acc[l] * Vec(inv[l]));
  }
}

template <typename T, int C>
void attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
               const at::Tensor& block_table, const at::Tensor& seq_of_row, const at::Tensor& context_lens,
               int64_t block_size, int64_t window, double scale, at::Tensor& out, const float* sinks) {
  constexpr int64_t W = Vec::size(), dim = C * W;
  const int64_t batch = q.size(0), heads = q.size(1), kv_heads = k_pool.size(0), group = heads / kv_heads;
  const Step<T> s{q.const_data_ptr<T>(), k_pool.const_data_ptr<T>(), v_pool.const_data_ptr<T>(),
                  block_table.const_data_ptr<int32_t>(), context_lens.const_data_ptr<int32_t>(),
                  seq_of_row.const_data_ptr<int32_t>(), out.mutable_data_ptr<T>(), sinks, q.stride(0), q.stride(1),
                  out.stride(0), block_table.stride(0), k_pool.size(1), block_size, window, group,
                  static_cast<float>(scale)};
  // runs of a prefill chunk's consecutive rows, as many as fill the lanes with their query heads; decodes alone
  const int64_t per_run = std::max<int64_t>(1, W / group);
  std::vector<std::pair<int64_t, int64_t>> runs;
  for (int64_t b = 0; b < batch;) {
    int64_t n = 1;
    while (n < per_run && b + n < batch && s.seq[b + n] == s.seq[b] && s.lens[b + n] == s.lens[b + n - 1] + 1) ++n;
    runs.emplace_back(b, n);
    b += n;
  }
  // taken last to first: a prefill chunk's rows in falling length, so the region ends on its shortest tasks
  const int64_t items = int64_t(runs.size()) * kv_heads;
  megapipe_parallel::parallel_tasks(items, [&](megapipe_parallel::TaskQueue& queue) {
    std::vector<Vec> qv(group * C), acc(group * C);
    std::vector<float> scores, total(group), qt(2 * dim * W);
    std::vector<int64_t> at;
    for (int64_t task; (task = queue.take()) >= 0;) {
      const int64_t item = items - 1 - task;
      const auto [b, rows] = runs[item / kv_heads];
      // a chunk's last row left alone in its run sums as its run-mates do, so a prompt row's output is the same
      // however its chunk splits into runs (which depends on where the chunk starts: a prefix-cache hit, a step's
      // token budget); alone takes a decode's order, which differs from it in the last bit
      const bool chunk_row = per_run > 1 && b > 0 && s.seq[b - 1] == s.seq[b] && s.lens[b] == s.lens[b - 1] + 1;
      if (rows == 1 && !chunk_row) {
        attend_row<T, C>(s, b, item % kv_heads, qv, acc, scores, total, at);
      } else {
        attend_rows<T, C>(s, b, rows, item % kv_heads, qt, scores, at);
      }
    }
  });
}

template <typename T>
void dispatch_dim(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                  const at::Tensor& block_table, const at::Tensor& seq_of_row, const at::Tensor& context_lens,
                  int64_t block_size, int64_t window, double scale, at::Tensor& out, const float* sinks) {
#define MEGAPIPE_DIM_CASE(c)                                                                                   \
  case c:                                                                                                      \
    return attention<T, c>(q, k_pool, v_pool, block_table, seq_of_row, context_lens, block_size, window, scale, \
                           out, sinks);
  switch (q.size(2) / Vec::size()) {
    MEGAPIPE_DIM_CASE(1) MEGAPIPE_DIM_CASE(2) MEGAPIPE_DIM_CASE(3) MEGAPIPE_DIM_CASE(4) MEGAPIPE_DIM_CASE(5)
    MEGAPIPE_DIM_CASE(6) MEGAPIPE_DIM_CASE(8) MEGAPIPE_DIM_CASE(10) MEGAPIPE_DIM_CASE(12)
    MEGAPIPE_DIM_CASE(16) MEGAPIPE_DIM_CASE(36) MEGAPIPE_DIM_CASE(72)  // 36 / 72: MLA's latent row, 512 + 64
    default:
      TORCH_CHECK(false, "paged_attention: head dim ", q.size(2), " is not supported");
  }
#undef MEGAPIPE_DIM_CASE
}

void paged_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                     const at::Tensor& block_table, const at::Tensor& seq_of_row, const at::Tensor& context_lens,
                     int64_t block_size, int64_t window, double scale, at::Tensor out,
                     const std::optional<at::Tensor>& sinks) {
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
  TORCH_CHECK(!sinks || (sinks->dim() == 1 && sinks->size(0) == q.size(1)), "sinks must be [heads]");
  const at::Tensor sink_f32 = sinks ? sinks->to(at::kFloat).contiguous() : at::Tensor();
  const float* sink_ptr = sinks ? sink_f32.const_data_ptr<float>() : nullptr;
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
                                 scale, out, sink_ptr);
    case at::kBFloat16:
      return dispatch_dim<c10::BFloat16>(q, k_pool, v_pool, block_table, seq_of_row, context_lens, block_size,
                                         window, scale, out, sink_ptr);
    case at::kHalf:
      return dispatch_dim<c10::Half>(q, k_pool, v_pool, block_table, seq_of_row, context_lens, block_size, window,
                                     scale, out, sink_ptr);
    default:
      TORCH_CHECK(false, "paged_attention: unsupported dtype ", q.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY(megapipe, m) {
  m.def(
      "paged_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_table, Tensor seq_of_row, "
      "Tensor context_lens, int block_size, int window, float scale, Tensor(a!) out, Tensor? sinks=None) -> ()");
}

TORCH_LIBRARY_IMPL(megapipe, CPU, m) {
  m.impl("paged_attention", &paged_attention);
}
