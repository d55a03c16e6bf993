// A bf16 linear layer, out = act(x W^T + b) [* other], for CPUs with AVX512-BF16 (vdpbf16ps), the weight packed
// once by pack_bf16_weight into 64-byte lines of 16 outputs x 2 consecutive inputs ([N/16, K/2, 16, 2]), so each
// line feeds 16 output columns at once and no horizontal sums are needed. A decode step's few rows stream every
// weight from DRAM once; this loop keeps that stream at the memory's speed where oneDNN's packed matmul reaches
// about two thirds of it (tools/bench_generate.py). Products and sums in fp32 (vdpbf16ps, or FMAs on the values
// widened where a measurement finds them faster: bf16_loop), the epilogue (bias, SiLU, the product with `other`)
// in fp32 before one rounding to bf16. Where the CPU has AMX the same packed lines are tiles for tdpbf16ps
// (tile_block below), which serve any row count.
//
// Built only where the CPU has AVX512-BF16 (megapipe/inference/kernels.py).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>
#include <immintrin.h>

#include "amx_tiles.h"
#include "bf16_epilogue.h"
#include "linear_tiles.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using namespace megapipe_linear;

using Epilogue = megapipe_linear::Epilogue<c10::BFloat16>;

// A matmul's inputs from row m0 on: x [M, 2 * pairs], and optionally x2 [M, 2 * pairs2], whose values meet the
// weight's inputs after x's (a weight extended by more input columns: LoRA's low-rank sums, megapipe.inference.lora)
struct Inputs {
  const uint16_t* x;
  int64_t x_row, pairs;
  const uint16_t* x2;
  int64_t x2_row, pairs2;
  Bands bands;  // by absolute row: from_row keeps them
  // band_steps of each block of `block_rows` rows (block b: rows b * block_rows ..), where with_block_steps made them
  const std::pair<int64_t, int64_t>* block_steps = nullptr;
  int64_t block_rows = 0;
  Inputs from_row(int64_t m0) const {
    Inputs in = *this;
    in.x += m0 * x_row;
    if (x2) in.x2 += m0 * x2_row;
    return in;
  }
  // The pairs of x2 that rows m0 .. m0 + mb - 1 (absolute row numbers, as the bands are kept) multiply on AMX
  // tiles, in whole tile steps of 16 pairs: all of x2 without bands, else the steps that meet some row's band (none
  // where no row has one). A block of one adapter's rows takes its band's step alone, as the loop's bands do per row
  // (LoRA on the AMX Xeon, 8 adapters over 64 requests: 0.79-0.80x -> 0.83-0.84x the base).
  std::pair<int64_t, int64_t> band_steps(int64_t m0, int mb) const {
    if (block_steps) return block_steps[m0 / block_rows];
    if (!bands.start) return {0, pairs2};
    int64_t lo = pairs2, hi = 0;
    for (int m = 0; m < mb; ++m) {
      const int64_t start = bands.start[m0 + m];
      if (start < 0) continue;
      lo = std::min(lo, start / 2 / 16 * 16);
      hi = std::max(hi, std::min(pairs2, ((start + bands.len) / 2 + 15) / 16 * 16));
    }
    return {lo, std::max(lo, hi)};
  }
  // These inputs with the band steps of each block of `rows` rows (M of them) looked up in `table`, not made again
  // for every tile group that the block meets (a decode's 96 groups of a SwiGLU: ~1/3 of what a band cost it)
  Inputs with_block_steps(int64_t m, int64_t rows, std::vector<std::pair<int64_t, int64_t>>& table) const {
    if (!bands.start) return *this;
    table.clear();
    for (int64_t m0 = 0; m0 < m; m0 += rows) table.push_back(band_steps(m0, int(std::min(rows, m - m0))));
    Inputs in = *this;
    in.block_steps = table.data(), in.block_rows = rows;
    return in;
  }
  // the input pairs whose weight lines a block fetches ahead for the next task: with bands its own inputs' only
  // (which band the next task's rows take is not known here; a decode's rows take every adapter's)
  int64_t steps() const { return pairs + (bands.start ? 0 : pairs2); }
};

// The weight lines a block fetches ahead for the thread's next task (Ahead): the same run of lines (bytes `offset`
// to `end`) of each of the next task's weight tiles, kLinesPerFetch of each every kLinesPerFetch * `spacing` steps
// of the block's products
struct Prefetch {
  static constexpr int kMaxTiles = 4;
  static constexpr int kLinesPerFetch = 4;
  const char* tiles[kMaxTiles] = {};
  int count = 0, spacing = 0;
  int64_t offset = 0, end = 0;  // bytes into each tile
  // fetches the next lines of each tile at step `step` of `steps`; returns the step at which to fetch again
  int64_t fetch(int64_t step, int64_t steps) {
    if (offset >= end) return steps;
    const int64_t stop = std::min(end, offset + kLinesPerFetch * 64);
    for (int i = 0; i < count; ++i)
      for (int64_t at = offset; at < stop; at += 64) _mm_prefetch(tiles[i] + at, _MM_HINT_T1);
    offset = stop;
    return std::min(steps, step + kLinesPerFetch * spacing);
  }
  // the share of the lines that step `step` of a block's `steps` fetches (AMX tiles: a step is 16 pairs, a block
  // ~18-50 of them), so that the block's last step has asked for them all
  void fetch_share(int64_t step, int64_t steps) const {
    const int64_t lines = (end - offset) / 64;
    const int64_t from = offset + lines * step / steps * 64, to = offset + lines * (step + 1) / steps * 64;
    for (int i = 0; i < count; ++i)
      for (int64_t at = from; at < to; at += 64) _mm_prefetch(tiles[i] + at, _MM_HINT_T1);
  }
};

// acc[m][t] += the products of `pairs` input pairs of rows x (x_row apart) with the weight lines w[t] .. (one line
// of 16 outputs per pair)
template <int MB, int NT>
inline void accumulate(__m512 (&acc)[MB][NT], const uint16_t* x, int64_t x_row, const uint16_t* const* w,
                       int64_t pairs, Prefetch& ahead) {
  // copied in: vector types may alias anything, so the stores of the fetches ahead would otherwise send the sums
  // through memory
  __m512 sums[MB][NT];
  for (int m = 0; m < MB; ++m)
    for (int t = 0; t < NT; ++t) sums[m][t] = acc[m][t];
  // runs of steps between fetches ahead (kLinesPerFetch lines of each tile at a time): fetched from inside the
  // loop, a line every few steps, the fetch's state took registers from the products and cost more than it saved
  for (int64_t k = 0; k < pairs;) {
    for (const int64_t stop = ahead.fetch(k, pairs); k < stop; ++k) {
      __m512i wv[NT];
      for (int t = 0; t < NT; ++t) wv[t] = _mm512_loadu_si512(w[t] + k * 2 * kTile);
      for (int m = 0; m < MB; ++m) {
        const __m512i xv = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x + m * x_row + 2 * k));
        for (int t = 0; t < NT; ++t) sums[m][t] = _mm512_dpbf16_ps(sums[m][t], (__m512bh)xv, (__m512bh)wv[t]);
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int t = 0; t < NT; ++t) acc[m][t] = sums[m][t];
}

// The same sums on fp32 FMAs: each weight line widened to its even inputs' 16 outputs (the pair's low halves
// shifted up) and its odd inputs' (the high halves masked), and x's rows widened 256 pairs at a time into a buffer
// the multiply-adds broadcast from. Where the CPU runs vdpbf16ps at under half its FMAs' rate (the AMX Xeon here,
// per core: 1.8 G vdpbf16ps/s, 7.0 G FMAs/s) this is ~1.5x the vdpbf16ps loop from 8 rows up (1536x576 weight at
// 32 rows: 230 -> 330 GFLOP/s on 2 cores); the products are the same exact ones, summed one at a time in fp32.
template <int MB, int NT>
inline void accumulate_fma(__m512 (&sums)[MB][NT], const uint16_t* x, int64_t x_row, const uint16_t* const* w,
                           int64_t pairs, Prefetch& ahead) {
  constexpr int64_t kPairsWidened = 256;
  alignas(64) float xf[MB][2 * kPairsWidened];
  const __m512i high_halves = _mm512_set1_epi32(int(0xFFFF0000u));
  __m512 acc[MB][NT];  // in registers: accumulating into `sums` made the compiler store them every step
  for (int m = 0; m < MB; ++m)
    for (int t = 0; t < NT; ++t) acc[m][t] = sums[m][t];
  for (int64_t k0 = 0; k0 < pairs; k0 += kPairsWidened) {
    const int64_t kn = std::min(kPairsWidened, pairs - k0);
    for (int m = 0; m < MB; ++m)
      for (int64_t i = 0; i < 2 * kn; i += kTile) {
        const __mmask16 mask = column_mask(i, 2 * kn);
        _mm512_store_ps(xf[m] + i, widen(_mm256_maskz_loadu_epi16(mask, x + m * x_row + 2 * k0 + i)));
      }
    for (int64_t kk = 0; kk < kn;)
      for (const int64_t stop = std::min(kn, ahead.fetch(k0 + kk, pairs) - k0); kk < stop; ++kk) {
        const int64_t line = (k0 + kk) * 2 * kTile;
        __m512 wv[NT];  // the even inputs' weights, then the odd ones' in the same registers
        for (int t = 0; t < NT; ++t)
          wv[t] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(w[t] + line), 16));
        for (int m = 0; m < MB; ++m) {
          const __m512 xe = _mm512_set1_ps(xf[m][2 * kk]);
          for (int t = 0; t < NT; ++t) acc[m][t] = _mm512_fmadd_ps(xe, wv[t], acc[m][t]);
        }
        for (int t = 0; t < NT; ++t)
          wv[t] = _mm512_castsi512_ps(_mm512_and_si512(_mm512_loadu_si512(w[t] + line), high_halves));
        for (int m = 0; m < MB; ++m) {
          const __m512 xo = _mm512_set1_ps(xf[m][2 * kk + 1]);
          for (int t = 0; t < NT; ++t) acc[m][t] = _mm512_fmadd_ps(xo, wv[t], acc[m][t]);
        }
      }
  }
  for (int m = 0; m < MB; ++m)
    for (int t = 0; t < NT; ++t) sums[m][t] = acc[m][t];
}

// How the loop multiplies (bf16_loop below): -1 until first asked, then a LoopProducts. One choice for every call
// whatever its row count, so a row's sums never depend on the rows beside it (a verification step of speculative
// decoding, or a batch, gives the tokens a lone decode gives); one row alone on vdpbf16ps would have been ~5%
// faster per batch-1 decode step, its weights' stream bounding it either way.
enum LoopProducts : int { kPairProducts = 0, kFmaProducts = 1 };
std::atomic<int> loop_products{-1};
std::string loop_measurement;

template <int MB, int NT>
inline void accumulate_with(int products, __m512 (&acc)[MB][NT], const uint16_t* x, int64_t x_row,
                            const uint16_t* const* w, int64_t pairs, Prefetch& ahead) {
  if (products == kFmaProducts) {
    accumulate_fma<MB, NT>(acc, x, x_row, w, pairs, ahead);
  } else {
    accumulate<MB, NT>(acc, x, x_row, w, pairs, ahead);
  }
}

// acc += the products of x2's rows (from m0 on) with the weight's extra inputs over each row's band only
// (Inputs::bands): one pass for the block where its rows share a band (a prefill's rows of one sequence), else
// row by row
template <int MB, int NT>
inline void band_products(int products, __m512 (&acc)[MB][NT], const Inputs& in, const uint16_t* const* w,
                          int64_t m0, Prefetch& ahead) {
  const int64_t pairs = in.bands.len / 2;
  auto at = [&](int64_t start) {  // the weight lines of the band from x2's column `start` on
    std::array<const uint16_t*, NT> w2;
    for (int t = 0; t < NT; ++t) w2[t] = w[t] + (in.pairs + start / 2) * 2 * kTile;
    return w2;
  };
  in.bands.each(
      m0, MB,
      [&](int64_t start) {
        accumulate_with<MB, NT>(products, acc, in.x2 + start, in.x2_row, at(start).data(), pairs, ahead);
      },
      [&](int m, int64_t start) {
        __m512 row[1][NT];
        for (int t = 0; t < NT; ++t) row[0][t] = acc[m][t];
        accumulate_with<1, NT>(products, row, in.x2 + m * in.x2_row + start, in.x2_row, at(start).data(), pairs,
                               ahead);
        for (int t = 0; t < NT; ++t) acc[m][t] = row[0][t];
      });
}

// A register block: rows m0 .. m0 + MB of the inputs against the weight tiles at w[0 .. NT), its fp32 sums handed
// to `finish` (a LinearFinish or a GluFinish)
template <int MB, int NT, typename Finish>
inline void block(const Inputs& in, const uint16_t* const* w, int64_t m0, const Finish& finish, int products,
                  Prefetch& ahead) {
  __m512 acc[MB][NT];
  for (int m = 0; m < MB; ++m)
    for (int t = 0; t < NT; ++t) acc[m][t] = _mm512_setzero_ps();
  accumulate_with<MB, NT>(products, acc, in.x, in.x_row, w, in.pairs, ahead);
  if (in.pairs2 && !in.bands.start) {
    std::array<const uint16_t*, NT> w2;
    for (int t = 0; t < NT; ++t) w2[t] = w[t] + in.pairs * 2 * kTile;
    accumulate_with<MB, NT>(products, acc, in.x2, in.x2_row, w2.data(), in.pairs2, ahead);
  } else if (in.pairs2) {
    band_products<MB, NT>(products, acc, in, w, m0, ahead);
  }
  finish.template rows<NT>(m0, MB, [&](int m, int t) { return acc[m][t]; });
}

// The seconds `products` takes for a register block of kRows x kTiles over 64 input pairs, all in the L1 cache:
// the fastest of 5 rounds of 50 blocks
double time_loop_block(int products) {
  constexpr int64_t pairs = 64;
  alignas(64) static uint16_t x[kRows][2 * pairs], w[kTiles][pairs * 2 * kTile];
  for (auto& row : x) std::fill(std::begin(row), std::end(row), uint16_t(0x3f80));  // 1.0
  for (auto& tile : w) std::fill(std::begin(tile), std::end(tile), uint16_t(0x3c00));  // 2^-7
  static_assert(kTiles == 3, "the measurement names its tiles");
  const uint16_t* tiles[kTiles] = {w[0], w[1], w[2]};
  Prefetch none;
  double best = 1e30;
  float sink = 0.f;
  for (int round = 0; round < 5; ++round) {
    const auto start = std::chrono::steady_clock::now();
    for (int rep = 0; rep < 50; ++rep) {
      __m512 acc[kRows][kTiles];
      for (auto& row : acc)
        for (auto& v : row) v = _mm512_setzero_ps();
      accumulate_with<kRows, kTiles>(products, acc, x[0], 2 * pairs, tiles, pairs, none);
      sink += _mm512_reduce_add_ps(acc[rep % kRows][rep % kTiles]);
    }
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  TORCH_CHECK(sink == 5 * 50 * kTile * 2 * pairs * (1.f / 128),  // 16 lanes of 128 products of 2^-7
              "bf16_loop: the measurement's sums are wrong: ", sink);
  return best;
}

const char* loop_name(int products) {
  return products == kFmaProducts ? "fma" : "vdpbf16ps";
}

// The loop's multiplication: "vdpbf16ps" or "fma" as set, or with "auto" whichever a short measurement at first
// use finds faster on this CPU (~2 ms); "" keeps the current one. Returns the one in use and the measurement.
std::tuple<std::string, std::string> bf16_loop(const std::string& setting) {
  static std::mutex lock;
  std::lock_guard<std::mutex> guard(lock);
  if (setting == "vdpbf16ps" || setting == "fma") {
    loop_products = setting == "fma" ? kFmaProducts : kPairProducts;
    loop_measurement = "as set";
  } else if (setting == "auto" || (setting.empty() && loop_products < 0)) {
    // alternated, after a first untimed pass of each: the first wide instructions after an idle spell run slowly
    // (AMD's Zen 4 here: the vdpbf16ps loop timed first measured 1.2x slower than the FMA loop, a matmul on it
    // ~1.8x faster)
    time_loop_block(kPairProducts), time_loop_block(kFmaProducts);
    double pairs = 1e30, fma = 1e30;
    for (int round = 0; round < 4; ++round) {
      pairs = std::min(pairs, time_loop_block(kPairProducts));
      fma = std::min(fma, time_loop_block(kFmaProducts));
    }
    loop_products = fma < pairs ? kFmaProducts : kPairProducts;
    loop_measurement = std::string("measured: ") + loop_name(loop_products) + " " +
                       std::to_string(std::max(pairs, fma) / std::min(pairs, fma)).substr(0, 4) + "x " +
                       loop_name(loop_products == kFmaProducts ? kPairProducts : kFmaProducts);
  } else {
    TORCH_CHECK(setting.empty(), "bf16_loop: '", setting, "' must be one of auto, vdpbf16ps, fma");
  }
  return {loop_name(loop_products), loop_measurement};
}

int current_loop_products() {
  const int products = loop_products.load(std::memory_order_relaxed);
  return products >= 0 ? products : (bf16_loop(""), loop_products.load());
}

template <int NT, typename Finish, int R = kRows>
inline void rows_block(int mb, const Inputs& in, const uint16_t* const* w, int64_t m0, const Finish& finish,
                       int products, Prefetch& ahead) {
  if (mb == R) return block<R, NT>(in, w, m0, finish, products, ahead);
  if constexpr (R > 1) rows_block<NT, Finish, R - 1>(mb, in, w, m0, finish, products, ahead);
}

// How a block's sums become outputs. A linear layer's: each weight tile its own 16 columns from n0 on, through the
// epilogue (bias, SiLU, * other).
template <typename Out>
struct LinearFinish {
  // on AMX tiles each block's epilogue runs right after it (spread over the next block's products it was 12-20%
  // slower: a linear's epilogue is light, and each part pays its setup)
  static constexpr bool kSpread = false;
  const Epilogue& ep;
  Out* out;
  int64_t out_row, n, n0;
  template <int NT, typename Sum>
  void rows(int64_t m0, int mb, const Sum& sum) const {
    for (int t = 0; t < NT; ++t) {
      const TileColumns cols(n0 + t * kTile, n, ep);
      for (int m = 0; m < mb; ++m) finish_row(sum(m, t), cols, m0 + m, ep, out, out_row);
    }
  }
};

// The largest of a row's values seen so far and its column: the first of equal values, and a NaN above any number
// (the first NaN above later ones), as argmax_rows (layer_ops.cpp) picks from stored logits
struct Best {
  float value = 0.f;
  int64_t col = -1;  // none yet
  bool beaten_by(float v, int64_t c) const {
    if (col < 0) return true;
    if (std::isnan(v)) return !std::isnan(value) || c < col;
    if (std::isnan(value)) return false;
    return v > value || (v == value && c < col);
  }
};

// A head's greedy tokens without its logits: each row's outputs as LinearFinish would store them (+ bias, rounded to
// bf16), the best of them kept per thread (best: [threads, M]; merged after the matmul). A block that holds no NaN
// and nothing above the row's best so far costs a lane maximum and one compare, which is nearly every block past
// a row's first few; writing 64 rows of a 49k vocabulary's fp32 logits and reading them back cost more (~3 ms).
struct ArgmaxFinish {
  static constexpr bool kSpread = false;
  const Epilogue& ep;  // its bias only
  Best* best;
  int64_t m, n, n0;
  template <int NT, typename Sum>
  void rows(int64_t m0, int mb, const Sum& sum) const {
    Best* mine = best + int64_t(at::get_thread_num()) * m;
    for (int r = 0; r < mb; ++r) {
      Best& b = mine[m0 + r];
      __m512 v[NT];
      __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      __mmask16 nan = 0;
      for (int t = 0; t < NT; ++t) {
        const TileColumns cols(n0 + t * kTile, n, ep);
        const __m512 rounded = widen((__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(sum(r, t), cols.bias)));
        v[t] = _mm512_mask_blend_ps(cols.mask, top, rounded);
        nan |= _mm512_cmp_ps_mask(v[t], v[t], _CMP_UNORD_Q);
      }
      if (!nan && b.col >= 0) {
        for (int t = 0; t < NT; ++t) top = _mm512_max_ps(top, v[t]);
        if (std::isnan(b.value) || _mm512_reduce_max_ps(top) < b.value) continue;
      }
      for (int t = 0; t < NT; ++t) {
        alignas(64) float lanes[kTile];
        _mm512_store_ps(lanes, v[t]);
        const int64_t col = n0 + t * kTile;
        for (int l = 0; l < kTile && col + l < n; ++l)
          if (b.beaten_by(lanes[l], col + l)) b = Best{lanes[l], col + l};
      }
    }
  }
};

// A gated unit's (SwiGLU: silu(x W_gate^T) * (x W_up^T)): its two tiles, gate and up, are one tile of outputs from
// col on
struct GluFinish {
  static constexpr bool kSpread = true;  // its SiLU is worth overlapping with the next block's tile products
  c10::BFloat16* out;
  int64_t out_row, n, col;
  template <int NT, typename Sum>
  void rows(int64_t m0, int mb, const Sum& sum) const {
    static_assert(NT == 2, "a gated unit's block is its gate tile and its up tile");
    const __mmask16 mask = column_mask(col, n);
    for (int m = 0; m < mb; ++m)
      store_row(_mm512_mul_ps(silu(sum(m, 0)), sum(m, 1)), mask, out + (m0 + m) * out_row + col);
  }
};

// Rows and weight tiles of a block on AMX tiles (tile_block)
constexpr int kTileRows = 32, kTileGroup = 2;
// rows per parallel task on AMX tiles: a task's weight tiles are read from the L1 cache by 8 blocks of rows, not 2
// (a 2048-row prefill ~6% faster end to end than with the loop's 64)
constexpr int64_t kTileRowChunk = 256;

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// AMX: the packed weight's 16 lines of 2 inputs x 16 outputs are exactly a tile of the second operand of tdpbf16ps,
// so a tile multiply takes 16 rows x 32 inputs of x against 32 inputs x 16 outputs of the weight in one
// instruction; a decode's matmul is then the weight stream alone, with no per-call cost to speak of (oneDNN's call
// costs ~20 us before any arithmetic, a decode step makes ~150 of them). A block is up to 32 rows (two x tiles) by
// two weight tiles: four products per four tile loads, as a prefill's many rows need.

// A thread's tile configuration over the tasks it takes, and its last block's sums: the configuration set when a
// block's row count differs from the last one's (loading it costs too much to repeat for every block), released
// when the thread's last task ends, so oneDNN's AMX kernels on this thread start from released tiles as they
// expect. Where the finish asks for it (kSpread: the gated unit's), a block's sums go through its epilogue a few
// rows per step of the next block's tile products (finish_rows), which the tile unit runs meanwhile; run after the
// block's own products, the epilogue leaves the tile unit idle (the fused SwiGLU at 2048 rows of 576 or 1536
// inputs: ~10% faster spread).
template <typename Finish>
class TaskTiles {
 public:
  ~TaskTiles() {
    finish_rows(kTileRows);  // the task's last block
    if (rows_) _tile_release();
  }
  // tiles 0, 1: the fp32 sums of two weight tiles for the block's first 16 rows; 2, 3: for the rest; 4, 5: those
  // rows' 32 inputs of x; 6, 7: two weight tiles' 16 lines (32 inputs x 16 outputs)
  void configure(int mb) {
    if (mb == rows_) return;
    const int top = std::min(mb, 16), bottom = mb - top;
    megapipe_amx::TileConfig cfg;
    for (int t : {0, 1, 4}) cfg.rows[t] = top;
    for (int t : {2, 3, 5}) cfg.rows[t] = bottom;
    cfg.rows[6] = cfg.rows[7] = 16;
    for (int t = 0; t < 8; ++t) cfg.colsb[t] = cfg.rows[t] ? 64 : 0;
    cfg.load();
    rows_ = mb;
  }
  // where the block being multiplied stores its sums: [top/bottom][weight tile][row][output]
  float (&sums())[2][2][16][kTile] { return sums_[current_]; }
  // the block whose sums were just stored waits for its epilogue (the one before it finished first); only a
  // spread finish (a gated unit's: two weight tiles per block) is held
  void hold(const Finish& finish, int64_t m0, int mb) {
    static_assert(Finish::kSpread, "only a spread epilogue waits for the next block");
    finish_rows(kTileRows);
    held_.emplace(finish);
    m0_ = m0, mb_ = mb, done_ = 0, current_ ^= 1;
  }
  // the held block's next `rows` rows through its epilogue
  void finish_rows(int rows) {
    if constexpr (Finish::kSpread) {
      if (!held_) return;
      const int first = done_, count = std::min(mb_ - first, rows);
      const auto& sums = sums_[current_ ^ 1];
      held_->template rows<2>(m0_ + first, count, [&](int m, int t) {
        return _mm512_load_ps(sums[(first + m) / 16][t][(first + m) % 16]);
      });
      done_ += count;
      if (done_ == mb_) held_.reset();
    }
  }

 private:
  alignas(64) float sums_[2][2][2][16][kTile];
  std::optional<Finish> held_;
  int64_t m0_ = 0;
  int rows_ = 0, mb_ = 0, done_ = 0, current_ = 0;
};

// The tile products of `pairs` input pairs of rows x (x_row apart; the first 16 into tiles 0, 1, the rest into 2, 3)
// with the weight lines w[t] .., between(): after each step of 32 inputs. With `stream`, x's tiles are loaded with
// tileloaddt1's hint that they will not be reused: a prefill's task rereads its weight tiles from the L1 cache for
// each of its blocks of rows and reads each block's rows once, so those rows are kept from pushing the weights out
// (one thread, 2048 rows: the 576-input matmuls 1.47-1.50 -> 1.74-1.88 TF/s, the 1536-input down projection as
// before; a 2048-token prefill of SmolLM2 on the AMX Xeon ~3% faster). A decode's few rows stay for every task.
template <int NT, typename Between>
inline void tile_products(const uint16_t* x, int64_t x_row, const uint16_t* const* w, int64_t pairs, bool bottom,
                          bool stream, const Between& between) {
  for (int64_t k = 0; k < pairs; k += 16) {
    if (stream) {
      _tile_stream_loadd(4, x + 2 * k, x_row * 2);
    } else {
      _tile_loadd(4, x + 2 * k, x_row * 2);
    }
    _tile_loadd(6, w[0] + k * 2 * kTile, 64);
    if constexpr (NT == 2) _tile_loadd(7, w[1] + k * 2 * kTile, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NT == 2) _tile_dpbf16ps(1, 4, 7);
    if (bottom) {
      if (stream) {
        _tile_stream_loadd(5, x + 16 * x_row + 2 * k, x_row * 2);
      } else {
        _tile_loadd(5, x + 16 * x_row + 2 * k, x_row * 2);
      }
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (NT == 2) _tile_dpbf16ps(3, 5, 7);
    }
    between();
  }
}

template <int NT, typename Finish>
void tile_block(const Inputs& in, const uint16_t* const* w, int64_t m0, int mb, TaskTiles<Finish>& tiles,
                const Finish& finish, const Prefetch& ahead, bool stream) {
  static_assert(NT == 1 || NT == 2, "tile_block names its tiles: one or two weight tiles at once");
  tiles.configure(mb);
  const bool bottom = mb > 16;
  _tile_zero(0);
  if constexpr (NT == 2) _tile_zero(1);
  if (bottom) {
    _tile_zero(2);
    if constexpr (NT == 2) _tile_zero(3);
  }
  const auto [lo, hi] = in.band_steps(m0, mb);
  const int64_t steps = (in.pairs + hi - lo) / 16;
  const int per_step = int((kTileRows + steps - 1) / steps);  // the last block's rows finished per step
  int64_t step = 0;
  auto between = [&] {
    if constexpr (Finish::kSpread) tiles.finish_rows(per_step);
    if (ahead.count) ahead.fetch_share(step++, steps);
  };
  tile_products<NT>(in.x, in.x_row, w, in.pairs, bottom, stream, between);
  if (hi > lo) {
    std::array<const uint16_t*, NT> w2;
    for (int t = 0; t < NT; ++t) w2[t] = w[t] + (in.pairs + lo) * 2 * kTile;
    tile_products<NT>(in.x2 + 2 * lo, in.x2_row, w2.data(), hi - lo, bottom, stream, between);
  }
  auto& sums = tiles.sums();
  _tile_stored(0, sums[0][0], kTile * 4);
  if constexpr (NT == 2) _tile_stored(1, sums[0][1], kTile * 4);
  if (bottom) {
    _tile_stored(2, sums[1][0], kTile * 4);
    if constexpr (NT == 2) _tile_stored(3, sums[1][1], kTile * 4);
  }
  if constexpr (Finish::kSpread) {
    tiles.hold(finish, m0, mb);
  } else {
    finish.template rows<NT>(m0, mb, [&](int m, int t) { return _mm512_load_ps(sums[m / 16][t][m % 16]); });
  }
}

bool amx_serves(const Inputs& in) {
  return in.pairs % 16 == 0 && in.pairs2 % 16 == 0 && megapipe_amx::permitted();
}
#else
template <typename Finish>
struct TaskTiles {};
bool amx_serves(const Inputs&) {
  return false;
}
template <int NT, typename Finish>
void tile_block(const Inputs&, const uint16_t* const*, int64_t, int, TaskTiles<Finish>&, const Finish&,
                const Prefetch&, bool) {}
#endif

// The groups of `group` 16-output tiles that one task takes so that its bf16 outputs are whole 64-byte lines: the
// two cores writing the two halves of one line passed it between them for every row (the fused SwiGLU's one-tile
// groups at 2048 rows on the AMX Xeon: 3.25 -> 2.27 ms; the loop's 3-tile groups 2-5% faster there without AMX)
constexpr int whole_lines(int group) {
  return group % 2 ? 2 : 1;
}

// for_each_block with a prefill's tasks writing whole lines; a decode's few rows keep one group per task, so that
// the weight stream splits into as many tasks as a large machine has threads
template <int Rows, int Group, typename TaskState, int64_t RowChunk, typename Block>
void for_each_block_in_lines(int64_t m, int64_t tiles, const Block& block) {
  if (m > kTileRows) {
    for_each_block<Rows, Group, TaskState, RowChunk, whole_lines(Group)>(m, tiles, block);
  } else {
    for_each_block<Rows, Group, TaskState, RowChunk, 1>(m, tiles, block);
  }
}

// Every block of the inputs against the packed weight tiles, on AMX tiles where they serve, else the vdpbf16ps
// loop: the outputs' tiles in groups (TileGroup or LoopGroup of them, the last ones alone where that does not
// divide), each output tile made from Width weight tiles; weights<NT>(t0) gives the NT weight tiles of output tiles
// t0 .., finish(t0) what their sums become.
// With out_bands, a block none of whose rows' bands meets its output tiles takes zero sums without multiplying (on
// AMX tiles a block is 32 rows, on the loop 8).
template <int TileGroup, int LoopGroup, int Width, typename Weights, typename MakeFinish>
void run_blocks(const Inputs& in, int64_t m, int64_t tiles, bool amx, const Weights& weights,
                const MakeFinish& finish, const Bands& out_bands = {}) {
  static_assert(std::max(TileGroup, LoopGroup) * Width <= Prefetch::kMaxTiles,
                "a task's weight tiles must fit Prefetch");
  const int64_t steps = in.steps();
  // the lines of the next task's weight tiles that this block fetches ahead (its part of every tile's lines: a tile
  // has a 64-byte line per input pair)
  auto fetch_ahead = [&](const Ahead& next) {
    Prefetch ahead;
    if (next.tiles) {
      for (int64_t t = next.t0; t < next.t0 + next.tiles; ++t)
        for (const uint16_t* tile : weights(std::integral_constant<int, Width>{}, t))
          ahead.tiles[ahead.count++] = reinterpret_cast<const char*>(tile);
      const int64_t first = steps * next.part / next.parts, last = steps * (next.part + 1) / next.parts;
      ahead.offset = first * 64, ahead.end = last * 64;
      ahead.spacing = int(std::max<int64_t>(1, steps / std::max<int64_t>(1, last - first)));
    }
    return ahead;
  };
  auto skipped = [&](auto nt, int64_t t0, int64_t m0, int mb) {
    if (!out_bands.skips(t0 * kTile, (t0 + decltype(nt)::value) * kTile, m0, mb)) return false;
    finish(t0).template rows<decltype(nt)::value * Width>(m0, mb, [](int, int) { return _mm512_setzero_ps(); });
    return true;
  };
  if (amx && amx_serves(in)) {
    using Tiles = TaskTiles<decltype(finish(0))>;
    std::vector<std::pair<int64_t, int64_t>> table;
    const Inputs tiled = in.with_block_steps(m, kTileRows, table);
    auto block = [&](auto nt, int64_t t0, int64_t m0, int mb, const Ahead& next, Tiles& state) {
      constexpr int NT = decltype(nt)::value * Width;
      if (skipped(nt, t0, m0, mb)) return;
      // a prefill's tasks fetch the next task's tiles ahead over their later blocks (a 2048-token prefill of
      // SmolLM2 on the AMX Xeon 1-4% faster) and stream their rows past the L1 cache; a decode's, one block each,
      // leave the weight stream to the hardware and keep their rows
      const bool prefill = m > kTileRows;
      tile_block<NT>(tiled.from_row(m0), weights(std::integral_constant<int, NT>{}, t0).data(), m0, mb, state,
                     finish(t0), prefill ? fetch_ahead(next) : Prefetch{}, prefill);
    };
    for_each_block_in_lines<kTileRows, TileGroup, Tiles, kTileRowChunk>(m, tiles, block);
    return;
  }
  const int products = current_loop_products();
  for_each_block_in_lines<kRows, LoopGroup, NoTaskState, kRowChunk>(
      m, tiles, [&](auto nt, int64_t t0, int64_t m0, int mb, const Ahead& next) {
        constexpr int NT = decltype(nt)::value * Width;
        if (skipped(nt, t0, m0, mb)) return;
        Prefetch ahead = fetch_ahead(next);
        rows_block<NT>(mb, in.from_row(m0), weights(std::integral_constant<int, NT>{}, t0).data(), m0, finish(t0),
                       products, ahead);
      });
}

const uint16_t* rows_of(const at::Tensor& x) {
  return reinterpret_cast<const uint16_t*>(x.const_data_ptr<c10::BFloat16>());
}

// The inputs x [M, K] and x2 [M, K2] (or none) checked against the weight [N/16, (K + K2)/2, 16, 2] for n outputs
// and out [M, N]. The weight may be a view of the first inputs of a wider packed weight (its 16-output tiles then
// lie further apart than its own inputs take).
Inputs checked_inputs(const char* op, const at::Tensor& x, const std::optional<at::Tensor>& x2,
                      const at::Tensor& weight, int64_t n, const at::Tensor& out, bool fp32_out = false,
                      const std::optional<at::Tensor>& x2_start = std::nullopt, int64_t x2_band = 0) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 &&
                  (out.scalar_type() == at::kBFloat16 || (out.scalar_type() == at::kFloat && fp32_out)) &&
                  (!x2 || x2->scalar_type() == at::kBFloat16),
              op, " takes bf16 tensors", fp32_out ? " (out: bf16 or fp32)" : "");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && weight.dim() == 4 && weight.size(2) == kTile &&
                  weight.size(3) == 2 && weight.stride(3) == 1 && weight.stride(2) == 2 &&
                  weight.stride(1) == 2 * kTile, op, ": x [M, K], weight [N/16, K/2, 16, 2]");
  const int64_t m = x.size(0), k = x.size(1), k2 = x2 ? x2->size(1) : 0, pairs = weight.size(1);
  TORCH_CHECK(!x2 || (x2->dim() == 2 && x2->size(0) == m && x2->stride(1) == 1 && k % 2 == 0),
              op, ": x2 must be [M, K2] beside an x of even K");
  TORCH_CHECK(k + k2 == 2 * pairs && (n + kTile - 1) / kTile == weight.size(0), op, ": x has ", k,
              x2 ? " (+ x2's " + std::to_string(k2) + ")" : std::string(), " features and the weight ", 2 * pairs,
              " for ", n, " outputs");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == m && out.size(1) == n && out.stride(1) == 1,
              op, ": out must be [M, N]");
  return {rows_of(x), x.stride(0), k / 2, x2 ? rows_of(*x2) : nullptr, x2 ? x2->stride(0) : 0, k2 / 2,
          checked_bands(op, "x2", x2_start, x2_band, m, k2, 2)};
}

// weights(std::integral_constant<int, NT>, t0): the NT weight tiles of output tiles t0 .. of a linear's packed weight
inline auto tile_pointers(const at::Tensor& weight) {
  return [wp = rows_of(weight), tile_stride = weight.stride(0)](auto nt, int64_t t0) {
    constexpr int NT = decltype(nt)::value;
    std::array<const uint16_t*, NT> w;
    for (int t = 0; t < NT; ++t) w[t] = wp + (t0 + t) * tile_stride;
    return w;
  };
}

// x [M, K] bf16 (rows contiguous), weight from pack_bf16_weight for N outputs, bias [N] or none, other [M, N] or
// none; out [M, N], bf16 or fp32 (then holding the bf16-rounded outputs). With x2 [M, K2], the weight's last K2
// inputs take x2's values; with x2_start [M] too, row m's x2 is zero but for x2_band columns from x2_start[m] on
// (Bands). With out_start [M], row m's products are taken only in the 16-output tiles that meet its out_band
// columns from out_start[m] on, its other outputs being the epilogue of zero sums: exact where `other` is zero
// there (LoRA's low-rank sums, masked to each row's adapter's band).
void linear_bf16(const at::Tensor& x, const at::Tensor& weight, int64_t n, const std::optional<at::Tensor>& bias,
                 bool swish, const std::optional<at::Tensor>& other, at::Tensor out, bool amx,
                 const std::optional<at::Tensor>& x2, const std::optional<at::Tensor>& x2_start, int64_t x2_band,
                 const std::optional<at::Tensor>& out_start, int64_t out_band) {
  const Inputs in = checked_inputs("linear_bf16", x, x2, weight, n, out, true, x2_start, x2_band);
  const Bands out_bands = checked_bands("linear_bf16", "out", out_start, out_band, x.size(0), n, 1);
  const Epilogue ep = checked_epilogue<c10::BFloat16>("linear_bf16", at::kBFloat16, "bf16", x.size(0), n, swish,
                                                      bias, other);
  const int64_t out_row = out.stride(0);
  const auto weights = tile_pointers(weight);
  auto run = [&](auto* op) {
    using Out = std::remove_pointer_t<decltype(op)>;
    run_blocks<kTileGroup, kTiles, 1>(in, x.size(0), weight.size(0), amx, weights,
                                      [&](int64_t t0) { return LinearFinish<Out>{ep, op, out_row, n, t0 * kTile}; },
                                      out_bands);
  };
  if (out.scalar_type() == at::kFloat) {
    run(out.mutable_data_ptr<float>());
  } else {
    run(out.mutable_data_ptr<c10::BFloat16>());
  }
}

// out [M] int64 = each row's argmax over act-free linear_bf16 outputs (x W^T + b, rounded to bf16): a head's greedy
// tokens, equal to argmax_rows over linear_bf16's fp32 out, without writing the logits
void linear_bf16_argmax(const at::Tensor& x, const at::Tensor& weight, int64_t n,
                        const std::optional<at::Tensor>& bias, at::Tensor out, bool amx) {
  const int64_t m = x.size(0);
  TORCH_CHECK(out.scalar_type() == at::kLong && out.dim() == 1 && out.size(0) == m && out.stride(0) == 1,
              "linear_bf16_argmax: out must be int64 [M]");
  TORCH_CHECK(n > 0, "linear_bf16_argmax: no outputs to choose from");
  const at::Tensor shape = x.new_empty({m, n}, x.options().device(at::kMeta));  // checked like linear_bf16's out
  const Inputs in = checked_inputs("linear_bf16_argmax", x, std::nullopt, weight, n, shape);
  const Epilogue ep = checked_epilogue<c10::BFloat16>("linear_bf16_argmax", at::kBFloat16, "bf16", m, n, false,
                                                      bias, std::nullopt);
  const int64_t threads = at::get_num_threads();
  std::vector<Best> best(threads * m);
  run_blocks<kTileGroup, kTiles, 1>(in, m, weight.size(0), amx, tile_pointers(weight),
                                    [&](int64_t t0) { return ArgmaxFinish{ep, best.data(), m, n, t0 * kTile}; });
  int64_t* dst = out.mutable_data_ptr<int64_t>();
  for (int64_t r = 0; r < m; ++r) {
    Best b;
    for (int64_t t = 0; t < threads; ++t) {
      const Best& other = best[t * m + r];
      if (other.col >= 0 && b.beaten_by(other.value, other.col)) b = other;
    }
    dst[r] = b.col;
  }
}

// out [M, N] = silu(x W_gate^T) * (x W_up^T), gate and up from pack_bf16_weight (N outputs each): a SwiGLU MLP's
// first half in one pass, each block the gate's and the up projection's tiles of the same 16 outputs (x2 and its
// bands as in linear_bf16, for both)
void glu_bf16(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& up, int64_t n, at::Tensor out,
              bool amx, const std::optional<at::Tensor>& x2, const std::optional<at::Tensor>& x2_start,
              int64_t x2_band) {
  const Inputs in = checked_inputs("glu_bf16", x, x2, gate, n, out, false, x2_start, x2_band);
  checked_inputs("glu_bf16", x, x2, up, n, out);
  TORCH_CHECK(gate.stride(0) == up.stride(0), "glu_bf16: gate and up must be packed alike");
  const uint16_t *gp = rows_of(gate), *up_p = rows_of(up);
  c10::BFloat16* op = out.mutable_data_ptr<c10::BFloat16>();
  const int64_t tile_stride = gate.stride(0), out_row = out.stride(0);
  run_blocks<1, 1, 2>(
      in, x.size(0), gate.size(0), amx,
      [&](auto, int64_t t0) { return std::array<const uint16_t*, 2>{gp + t0 * tile_stride, up_p + t0 * tile_stride}; },
      [&](int64_t t0) { return GluFinish{op, out_row, n, t0 * kTile}; });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(megapipe, m) {
  m.def(
      "linear_bf16(Tensor x, Tensor weight, int n, Tensor? bias, bool swish, Tensor? other, Tensor(a!) out, "
      "bool amx=True, Tensor? x2=None, Tensor? x2_start=None, int x2_band=0, Tensor? out_start=None, "
      "int out_band=0) -> ()");
  m.def("linear_bf16_argmax(Tensor x, Tensor weight, int n, Tensor? bias, Tensor(a!) out, bool amx=True) -> ()");
  m.def(
      "glu_bf16(Tensor x, Tensor gate, Tensor up, int n, Tensor(a!) out, bool amx=True, Tensor? x2=None, "
      "Tensor? x2_start=None, int x2_band=0) -> ()");
  m.def("bf16_loop(str setting='') -> (str, str)", &bf16_loop);
}

TORCH_LIBRARY_IMPL(megapipe, CPU, m) {
  m.impl("linear_bf16", &linear_bf16);
  m.impl("linear_bf16_argmax", &linear_bf16_argmax);
  m.impl("glu_bf16", &glu_bf16);
}
