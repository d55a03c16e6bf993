// The work split of megapipe's linear kernels (linear_bf16.cpp, linear_f32.cpp): the packed weight's 16-output
// tiles in groups of kTiles, the rows in chunks of kRowChunk, each (group, chunk) one parallel task, whose rows go
// through the register block in runs of at most kRows (the AMX tile path sets its own group and run sizes).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <type_traits>

#include "parallel_tasks.h"

namespace megapipe_linear {

constexpr int kTile = 16;  // outputs per 64-byte weight line
// rows of x x weight tiles per register block: 24 accumulators and 3 weight lines of the 32 vector registers; of
// the blocks that fit, the one that loads the fewest weight lines per product, and whose 3-tile groups split a
// layer's 36 / 60 / 96 tiles evenly between two threads
constexpr int kRows = 8;
constexpr int kTiles = 3;
constexpr int64_t kRowChunk = 64;  // rows per parallel task (AMX's tile path: its own, more)

// What a kernel applies to each [M, N] output before storing it: + bias, SiLU, * other (T: the kernel's dtype)
template <typename T>
struct Epilogue {
  const T* bias;  // [N] or null
  bool swish;
  const T* other;  // [M, other_row] or null
  int64_t other_row;
};

// The lanes of the outputs col .. col + 15 that are under n
inline __mmask16 column_mask(int64_t col, int64_t n) {
  const int64_t valid = std::min<int64_t>(kTile, n - col);
  return valid >= kTile ? __mmask16(0xffff) : __mmask16((1u << valid) - 1);
}

// The epilogue of op's [m, n] output, its optional bias [N] and other [M, N] checked to be `type` (named `type_name`
// in the errors) with contiguous rows
template <typename T>
Epilogue<T> checked_epilogue(const char* op, at::ScalarType type, const char* type_name, int64_t m, int64_t n,
                             bool swish, const std::optional<at::Tensor>& bias,
                             const std::optional<at::Tensor>& other) {
  Epilogue<T> ep{nullptr, swish, nullptr, 0};
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == type && bias->is_contiguous() && bias->numel() == n,
                op, ": bias must be ", type_name, " [N]");
    ep.bias = bias->const_data_ptr<T>();
  }
  if (other) {
    TORCH_CHECK(other->scalar_type() == type && other->dim() == 2 && other->size(0) == m && other->size(1) == n &&
                    other->stride(1) == 1, op, ": other must be ", type_name, " [M, N]");
    ep.other = other->const_data_ptr<T>();
    ep.other_row = other->stride(0);
  }
  return ep;
}

// Rows whose extra inputs (x2: LoRA's low-rank sums, megapipe.inference.lora) are zero outside a band of `len`
// columns from start[m] on (-1: all zero), the row's own adapter's: a kernel multiplies that band alone, the same
// sums as over all of x2 without the products of zeros (a prefill of one adapter's rows skipped 7 of 8 adapters'
// bands). start null: every column of x2 is multiplied.
struct Bands {
  const int32_t* start = nullptr;
  int64_t len = 0;
  // the start rows m0 .. m0 + mb share, or kMixed
  static constexpr int64_t kMixed = -2;
  int64_t shared(int64_t m0, int mb) const {
    for (int m = 1; m < mb; ++m)
      if (start[m0 + m] != start[m0]) return kMixed;
    return start[m0];
  }
  // x2's products of rows m0 .. m0 + mb over their bands: shared(start) once where they share one, else
  // row(m, start) for each row (m from 0) that has one
  template <typename Shared, typename Row>
  void each(int64_t m0, int mb, const Shared& shared_band, const Row& row) const {
    const int64_t first = shared(m0, mb);
    if (first >= 0) {
      shared_band(first);
    } else if (first == kMixed) {
      for (int m = 0; m < mb; ++m)
        if (start[m0 + m] >= 0) row(m, int64_t(start[m0 + m]));
    }
  }
  // out bands: whether a block of rows m0 .. m0 + mb skips its output columns lo .. hi - 1 (no row's band meets
  // them); never without bands
  bool skips(int64_t lo, int64_t hi, int64_t m0, int mb) const {
    if (!start) return false;
    for (int m = 0; m < mb; ++m)
      if (start[m0 + m] >= 0 && start[m0 + m] < hi && start[m0 + m] + len > lo) return false;
    return true;
  }
};

// Bands (`name`_start, `name`_band: of x2's columns, or of out's) checked against the k2 columns they lie in:
// int32 [M], each -1 or a start in 0 .. k2 - len (a multiple of `align`); none without a start tensor
inline Bands checked_bands(const char* op, const char* name, const std::optional<at::Tensor>& starts, int64_t len,
                           int64_t m, int64_t k2, int64_t align) {
  if (!starts) return {};
  TORCH_CHECK(k2 > 0 && starts->scalar_type() == at::kInt && starts->dim() == 1 && starts->size(0) == m &&
                  starts->stride(0) == 1, op, ": ", name, "_start must be int32 [M] beside an ", name);
  TORCH_CHECK(len > 0 && len <= k2 && len % align == 0, op, ": ", name, "_band ", len, " must be in 1 .. ", k2,
              " and a multiple of ", align);
  const int32_t* start = starts->const_data_ptr<int32_t>();
  for (int64_t r = 0; r < m; ++r)
    TORCH_CHECK(start[r] == -1 || (start[r] >= 0 && start[r] + len <= k2 && start[r] % align == 0), op, ": ",
                name, "_start[", r, "] = ", start[r], " is not -1 or a start of a band of ", len, " in ", name,
                "'s ", k2, " columns (a multiple of ", align, ")");
  return {start, len};
}

struct NoTaskState {};

// The weight tiles a thread's next task reads (output tiles t0 .. t0 + tiles; none where tiles is 0) and the share
// of them a block fetches ahead into the cache while it multiplies (part of parts). A task's first block of rows
// streams its tiles from memory and the rest find them in the cache; fetched ahead over those later blocks, the next
// task's tiles arrive while the cores compute instead of stalling its first block (SmolLM2's 30 layers and head at
// 64 rows, weights out of the cache: 43.1-43.8 -> 41.4-42.5 ms, the 49k-output head 9.3 -> 8.7 ms).
struct Ahead {
  int64_t t0 = 0, tiles = 0;
  int part = 0, parts = 1;
};

// block(std::integral_constant<int, NT>, first tile, first row, rows (<= Rows), Ahead[, state]) for every block of
// the matmul: NT = Tiles, or 1 for each tile of a last, partial group. With a TaskState, each thread makes one and
// passes it to every block of the tasks it takes (AMX's tile configuration, set once and released at its end). A
// task is TaskGroups groups of tiles over RowChunk rows, one group after the other: with groups of one 16-output
// tile, two make a task whose bf16 outputs are whole 64-byte lines, which one core then writes alone.
template <int Rows = kRows, int Tiles = kTiles, typename TaskState = NoTaskState, int64_t RowChunk = kRowChunk,
          int TaskGroups = 1, typename Block>
void for_each_block(int64_t m, int64_t tiles, const Block& block) {
  const int64_t groups = (tiles + Tiles - 1) / Tiles, chunks = (m + RowChunk - 1) / RowChunk;
  const int64_t task_groups = (groups + TaskGroups - 1) / TaskGroups;
  megapipe_parallel::parallel_tasks(task_groups * chunks, [&](megapipe_parallel::TaskQueue& queue) {
    TaskState state;
    auto run = [&](auto nt, int64_t t0, int64_t m0, int mb, const Ahead& ahead) {
      if constexpr (std::is_same_v<TaskState, NoTaskState>) {
        block(nt, t0, m0, mb, ahead);
      } else {
        block(nt, t0, m0, mb, ahead, state);
      }
    };
    // each task takes the thread's next one as it starts, so that its blocks can fetch that one's tiles ahead
    for (int64_t item = queue.take(), following; item >= 0; item = following) {
      following = queue.take();
      const int64_t chunk = item / task_groups, g_end = std::min(groups, (item % task_groups + 1) * TaskGroups);
      for (int64_t g = item % task_groups * TaskGroups; g < g_end; ++g) {
        const int64_t t0 = g * Tiles, nt = std::min<int64_t>(Tiles, tiles - t0);
        const int64_t first = chunk * RowChunk, last = std::min(m, (chunk + 1) * RowChunk);
        const int blocks = int((last - first + Rows - 1) / Rows);
        // the group after this one: the task's next, or the next task's first
        const int64_t next_group = g + 1 < g_end ? g + 1 : following >= 0 ? following % task_groups * TaskGroups : -1;
        Ahead next;
        if (next_group >= 0) {
          next.t0 = next_group * Tiles;
          next.tiles = std::min<int64_t>(Tiles, tiles - next.t0);
        }
        // the first block reads its own tiles from memory: the next task's are fetched over the others
        next.parts = std::max(blocks - 1, 1);
        for (int64_t m0 = first; m0 < last; m0 += Rows) {
          const int b = int((m0 - first) / Rows), mb = int(std::min<int64_t>(Rows, m - m0));
          Ahead ahead = next;
          if (blocks > 1 && b == 0) ahead.tiles = 0;
          ahead.part = std::max(b - 1, 0);
          if (nt == Tiles) {
            run(std::integral_constant<int, Tiles>{}, t0, m0, mb, ahead);
          } else {
            for (int64_t t = t0; t < t0 + nt; ++t) {
              run(std::integral_constant<int, 1>{}, t, m0, mb, ahead);
              ahead.tiles = 0;
            }
          }
        }
      }
    }
  });
}

}  // namespace megapipe_linear
