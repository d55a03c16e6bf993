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
// there cost 20% (both measured on this kernel alone). Where the CPU has AMX, a bf16 prefill chunk's rows take
// attend_rows_amx instead (amx=false: the loop). Built at first use by megapipe/inference/kernels.py for the CPU
// it runs on.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "amx_tiles.h"
#include "bf16_widen.h"
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

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// A bf16 prefill on AMX tiles. Runs of up to kAmxRows consecutive rows of one sequence share one contiguous copy of
// their keys and one of their values paired by key ([key pairs][head_dim][2]: tdpbf16ps's second operand). Per query
// head and 16 rows, the scores come out transposed, keys x rows (the keys' tiles times the 16 queries' pairs as the
// second operand; bf16 x bf16 is exact in fp32, summed in fp32), so the softmax runs down the keys with a row in each
// lane, as attend_rows's does, with no sums across lanes; its exp is ATen's inline exp_u20, within a few units of
// fp32's last place (the loop's call into Sleef cost ~20% of this kernel). The weighted sum of the values is two
// tile products per 32 keys: of the probabilities rounded to bf16 and of what that rounding lost, also in bf16, so
// the weights carry ~16 bits (outputs within a few units of fp32's last place of the fp32 loop's, under the bf16
// rounding of the output).
// A row's keys start at a multiple of kAmxKeyAlign positions whatever run it falls in, and keys past its own length
// weigh exact zeros, so its sums do not depend on how its chunk splits into runs.
// A 2048-row prefill (32 x 64-token prompts, 9 heads on 3 kv heads of 64) on the AMX Xeon, 2 threads: the loop's
// 1.10-1.15 ms a layer -> 0.57-0.61 ms.
constexpr int64_t kAmxRows = 64, kAmxKeyAlign = 64, kAmxMaxDim = 256;

// 64-byte aligned room for n values in v
template <typename U>
U* aligned_room(std::vector<U>& v, int64_t n) {
  v.resize(n + 64 / sizeof(U));
  return reinterpret_cast<U*>((reinterpret_cast<uintptr_t>(v.data()) + 63) & ~uintptr_t(63));
}

// Makes the compiler finish the stores before a tile load and read the memory after a tile store: GCC's tile
// intrinsics name only their pointers, not the memory behind them
inline void memory_barrier() {
  asm volatile("" ::: "memory");
}

// A thread's scratch over the items it takes and its tiles, configured once (every tile 16 rows of 64 bytes) and
// released at its end
struct AmxScratch {
  std::vector<uint16_t> keys;
  std::vector<uint32_t> values, queries, high, low;
  std::vector<float> scores, sums;
  bool configured = false;
  ~AmxScratch() {
    if (configured) _tile_release();
  }
  void configure() {
    if (configured) return;
    megapipe_amx::TileConfig cfg;
    for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    cfg.load();
    configured = true;
  }
};

// The scores of NT tiles of 16 keys (`tile` apart, rows `key_row` bytes apart; tiles 4, 5) against 16 queries
// (their pairs: [dim / 2][16], 32 dims a step in tile 6), keys x queries in tiles 0 .. NT - 1, stored to out
template <int NT>
inline void score_tiles(const uint16_t* keys, int64_t tile, int64_t key_row, const uint32_t* queries, int64_t steps,
                        float* out) {
  _tile_zero(0);
  if constexpr (NT > 1) _tile_zero(1);
  if constexpr (NT > 2) _tile_zero(2);
  if constexpr (NT > 3) _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    const uint16_t* k = keys + s * 32;
    _tile_loadd(6, queries + s * 256, 64);
    _tile_loadd(4, k, key_row);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NT > 1) {
      _tile_loadd(5, k + tile, key_row);
      _tile_dpbf16ps(1, 5, 6);
    }
    if constexpr (NT > 2) {
      _tile_loadd(4, k + 2 * tile, key_row);
      _tile_dpbf16ps(2, 4, 6);
    }
    if constexpr (NT > 3) {
      _tile_loadd(5, k + 3 * tile, key_row);
      _tile_dpbf16ps(3, 5, 6);
    }
  }
  _tile_stored(0, out, 64);
  if constexpr (NT > 1) _tile_stored(1, out + 256, 64);
  if constexpr (NT > 2) _tile_stored(2, out + 512, 64);
  if constexpr (NT > 3) _tile_stored(3, out + 768, 64);
}

// The weighted sums of two tiles of 16 dims for 16 rows: tiles 0, 1 = the probabilities' high parts (tile 4, 32 keys
// a step) x the values (a step's lines `line` apart), tiles 2, 3 = their low parts' (tile 5) x the same values, each
// pair added once stored to out ([16][64]). Kept apart, no product waits for the one before it to finish.
inline void value_tiles(const uint32_t* high, const uint32_t* low, int64_t p_stride, const uint32_t* values,
                        int64_t line, int64_t steps, float* out) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    const uint32_t* v = values + s * 16 * line;
    _tile_loadd(4, high + s * 16, p_stride);
    _tile_loadd(5, low + s * 16, p_stride);
    _tile_loadd(6, v, line * 4);
    _tile_loadd(7, v + 16, line * 4);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, out, 256);
  _tile_stored(1, out + 16, 256);
  _tile_stored(2, out + 32, 256);
  _tile_stored(3, out + 48, 256);
}

// f(std::integral_constant<int, N>) for N = min(4, left) (1 .. 4)
template <typename F>
inline void up_to_four(int64_t left, const F& f) {
  switch (std::min<int64_t>(left, 4)) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    default: return f(std::integral_constant<int, 4>{});
  }
}

// 16 bf16 values of each of two rows paired: lane l = (even[l], odd[l]), tdpbf16ps's pair of inputs
inline __m512i paired(__m256i even, __m256i odd) {
  return _mm512_or_si512(_mm512_cvtepu16_epi32(even), _mm512_slli_epi32(_mm512_cvtepu16_epi32(odd), 16));
}

// two vectors' fp32 values rounded to bf16 and paired
inline __m512i bf16_pairs(__m512 even, __m512 odd) {
  return paired((__m256i)_mm512_cvtneps_pbh(even), (__m256i)_mm512_cvtneps_pbh(odd));
}

// what rounding v to bf16 lost
inline __m512 bf16_rest(__m512 v) {
  return _mm512_sub_ps(v, megapipe_bf16::widen((__m256i)_mm512_cvtneps_pbh(v)));
}

inline const float* as_floats(const void* p) {
  return static_cast<const float*>(p);
}
inline float* as_floats(void* p) {
  return static_cast<float*>(p);
}

// Rows b0 .. b0 + rows - 1 of one sequence at consecutive positions and kv head g, on AMX tiles
template <int C>
void attend_rows_amx(const Step<c10::BFloat16>& s, int64_t b0, int64_t rows, int64_t g, AmxScratch& x,
                     std::vector<int64_t>& at) {
  static_assert(C % 2 == 0 && C * 16 <= kAmxMaxDim, "AMX attention takes head dims of whole 32-dim steps");
  constexpr int64_t W = Vec::size(), dim = C * W, pairs = dim / 2, steps = dim / 32;
  alignas(64) static const uint16_t zeros[kAmxMaxDim] = {};
  const auto* k_pool = reinterpret_cast<const uint16_t*>(s.k);
  const auto* v_pool = reinterpret_cast<const uint16_t*>(s.v);
  const int64_t start = s.first_key(b0) / kAmxKeyAlign * kAmxKeyAlign;
  const int64_t n = s.lens[b0 + rows - 1] - start, padded = (n + kAmxKeyAlign - 1) / kAmxKeyAlign * kAmxKeyAlign;
  s.key_offsets(b0, g, start, n, dim, at);
  uint16_t* keys = aligned_room(x.keys, padded * dim);
  for (int64_t t = 0; t < padded; ++t) std::memcpy(keys + t * dim, t < n ? k_pool + at[t] : zeros, dim * 2);
  // values by key pair: line t / 2 holds (v[t][d], v[t + 1][d]) for each d
  uint32_t* values = aligned_room(x.values, padded / 2 * dim);
  for (int64_t t = 0; t < padded; t += 2) {
    const uint16_t* even = t < n ? v_pool + at[t] : zeros;
    const uint16_t* odd = t + 1 < n ? v_pool + at[t + 1] : zeros;
    for (int64_t d = 0; d < dim; d += 16)
      _mm512_store_si512(values + t / 2 * dim + d,
                         paired(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(even + d)),
                                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(odd + d))));
  }
  uint32_t* queries = aligned_room(x.queries, pairs * 16);
  float* scores = aligned_room(x.scores, padded * 16);  // [keys][16 rows]
  uint32_t* high = aligned_room(x.high, 16 * padded / 2);  // [16 rows][key pairs]
  uint32_t* low = aligned_room(x.low, 16 * padded / 2);
  float* sums = aligned_room(x.sums, 16 * 64);
  alignas(64) uint32_t lines[2][16][16];
  x.configure();
  const Vec minus_inf(-std::numeric_limits<float>::infinity()), vscale(s.scale);
  for (int64_t r0 = 0; r0 < rows; r0 += 16) {
    const int r = int(std::min<int64_t>(16, rows - r0));
    const int64_t b = b0 + r0;
    // the keys this block's rows reach, in whole steps of 32 (a tile step of the weighted sum)
    const int64_t reach = (s.lens[b + r - 1] - start + 31) / 32 * 32;
    // each lane's row (lanes past r: the last row's, computed and dropped)
    alignas(64) float len_lane[16], first_lane[16];
    for (int l = 0; l < 16; ++l) {
      const int64_t row = b + std::min(l, r - 1);
      len_lane[l] = float(s.lens[row]);
      first_lane[l] = float(s.first_key(row));
    }
    const Vec lens_v = Vec::loadu(len_lane), firsts_v = Vec::loadu(first_lane);
    for (int64_t j = 0; j < s.group; ++j) {
      const int64_t head = g * s.group + j;
      // the queries' pairs, [dim / 2][16 rows] (rows past r: zeros)
      if (r < 16) std::memset(queries, 0, pairs * 16 * 4);
      at::vec::transpose_mxn<float>(as_floats(s.q + b * s.q_row + head * s.q_head), s.q_row / 2, as_floats(queries),
                                    16, r, pairs);
      memory_barrier();
      for (int64_t t = 0; t < reach / 16; t += 4)
        up_to_four(reach / 16 - t, [&](auto nt) {
          score_tiles<nt.value>(keys + t * 16 * dim, 16 * dim, dim * 2, queries, steps, scores + t * 256);
        });
      memory_barrier();
      const float sink = s.sinks ? s.sinks[head] : -std::numeric_limits<float>::infinity();
      Vec top(sink), total(0.f);  // no sinks: exp(-inf) = 0 below
      for (int64_t t = 0; t < reach; ++t) {
        const Vec pos(float(start + t));
        const Vec v = Vec::blendv(minus_inf, Vec::loadu(scores + t * 16) * vscale,
                                  (pos < lens_v) & (pos >= firsts_v));
        v.store(scores + t * 16);
        top = at::vec::maximum(top, v);
      }
      // the probabilities by key pair, high and low parts ([key pairs][16 rows]), turned to [16 rows][key pairs]
      // 16 pairs (a tile step) at a time
      for (int64_t t0 = 0; t0 < reach; t0 += 32) {
        for (int64_t i = 0; i < 16; ++i) {
          const int64_t t = t0 + 2 * i;
          const __m512 even = (Vec::loadu(scores + t * 16) - top).exp_u20();
          const __m512 odd = (Vec::loadu(scores + (t + 1) * 16) - top).exp_u20();
          total = total + Vec(even) + Vec(odd);
          _mm512_store_si512(lines[0][i], bf16_pairs(even, odd));
          _mm512_store_si512(lines[1][i], bf16_pairs(bf16_rest(even), bf16_rest(odd)));
        }
        at::vec::transpose_mxn<float>(as_floats(lines[0]), 16, as_floats(high + t0 / 2), padded / 2, 16, 16);
        at::vec::transpose_mxn<float>(as_floats(lines[1]), 16, as_floats(low + t0 / 2), padded / 2, 16, 16);
      }
      if (s.sinks) total = total + (Vec(sink) - top).exp_u20();
      alignas(64) float inv[16];
      (Vec(1.f) / total).store(inv);
      memory_barrier();
      for (int64_t c = 0; c < C; c += 2) {
        value_tiles(high, low, padded * 2, values + c * W, dim, reach / 32, sums);
        memory_barrier();
        for (int i = 0; i < r; ++i) {
          c10::BFloat16* dst = s.out + (b + i) * s.out_row + head * dim + c * W;
          for (int d = 0; d < 2; ++d) {
            const float* sum = sums + i * 64 + d * W;
            store_row(dst + d * W, (Vec::loadu(sum) + Vec::loadu(sum + 2 * W)) * Vec(inv[i]));
          }
        }
      }
    }
  }
}
#endif

template <typename T, int C>
void attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
               const at::Tensor& block_table, const at::Tensor& seq_of_row, const at::Tensor& context_lens,
               int64_t block_size, int64_t window, double scale, at::Tensor& out, const float* sinks,
               bool amx_asked) {
  constexpr int64_t W = Vec::size(), dim = C * W;
  const int64_t batch = q.size(0), heads = q.size(1), kv_heads = k_pool.size(0), group = heads / kv_heads;
  const Step<T> s{q.const_data_ptr<T>(), k_pool.const_data_ptr<T>(), v_pool.const_data_ptr<T>(),
                  block_table.const_data_ptr<int32_t>(), context_lens.const_data_ptr<int32_t>(),
                  seq_of_row.const_data_ptr<int32_t>(), out.mutable_data_ptr<T>(), sinks, q.stride(0), q.stride(1),
                  out.stride(0), block_table.stride(0), k_pool.size(1), block_size, window, group,
                  static_cast<float>(scale)};
  // runs of a prefill chunk's consecutive rows, as many as fill the lanes with their query heads (on AMX tiles,
  // up to kAmxRows); decodes alone
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  constexpr bool amx_dim = std::is_same_v<T, c10::BFloat16> && C % 2 == 0 && dim <= kAmxMaxDim;
  const bool amx = amx_dim && amx_asked && megapipe_amx::permitted();
  const int64_t per_run = amx ? kAmxRows : std::max<int64_t>(1, W / group);
#else
  const int64_t per_run = std::max<int64_t>(1, W / group);
#endif
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
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    AmxScratch tiles;
#endif
    for (int64_t task; (task = queue.take()) >= 0;) {
      const int64_t item = items - 1 - task;
      const auto [b, rows] = runs[item / kv_heads];
      // a chunk's last row left alone in its run sums as its run-mates do, so a prompt row's output is the same
      // however its chunk splits into runs (which depends on where the chunk starts: a prefix-cache hit, a step's
      // token budget); alone takes a decode's order, which differs from it in the last bit
      const bool chunk_row = per_run > 1 && b > 0 && s.seq[b - 1] == s.seq[b] && s.lens[b] == s.lens[b - 1] + 1;
      if (rows == 1 && !chunk_row) {
        attend_row<T, C>(s, b, item % kv_heads, qv, acc, scores, total, at);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
      } else if (amx) {
        if constexpr (amx_dim) attend_rows_amx<C>(s, b, rows, item % kv_heads, tiles, at);
#endif
      } else {
        attend_rows<T, C>(s, b, rows, item % kv_heads, qt, scores, at);
      }
    }
  });
}

template <typename T>
void dispatch_dim(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                  const at::Tensor& block_table, const at::Tensor& seq_of_row, const at::Tensor& context_lens,
                  int64_t block_size, int64_t window, double scale, at::Tensor& out, const float* sinks,
                  bool amx) {
#define MEGAPIPE_DIM_CASE(c)                                                                                   \
  case c:                                                                                                      \
    return attention<T, c>(q, k_pool, v_pool, block_table, seq_of_row, context_lens, block_size, window, scale, \
                           out, sinks, amx);
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
                     const std::optional<at::Tensor>& sinks, bool amx) {
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
                                 scale, out, sink_ptr, amx);
    case at::kBFloat16:
      return dispatch_dim<c10::BFloat16>(q, k_pool, v_pool, block_table, seq_of_row, context_lens, block_size,
                                         window, scale, out, sink_ptr, amx);
    case at::kHalf:
      return dispatch_dim<c10::Half>(q, k_pool, v_pool, block_table, seq_of_row, context_lens, block_size, window,
                                     scale, out, sink_ptr, amx);
    default:
      TORCH_CHECK(false, "paged_attention: unsupported dtype ", q.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY(megapipe, m) {
  m.def(
      "paged_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_table, Tensor seq_of_row, "
      "Tensor context_lens, int block_size, int window, float scale, Tensor(a!) out, Tensor? sinks=None, "
      "bool amx=True) -> ()");
}

TORCH_LIBRARY_IMPL(megapipe, CPU, m) {
  m.impl("paged_attention", &paged_attention);
}
