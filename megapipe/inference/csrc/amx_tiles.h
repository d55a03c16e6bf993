// What megapipe's AMX kernels share (linear_bf16.cpp's matmuls, paged_attention.cpp's prefill): Linux's permission
// for the tile registers and the tile configuration. Compiled in only where the build has -mamx-tile -mamx-bf16
// (megapipe/inference/kernels.py: CPUs with AMX).
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace megapipe_amx {

// Linux hands a process AMX's tile registers only once it asks (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA)
inline bool permitted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}

// ldtilecfg's 64-byte operand (palette 1): each tile's rows and bytes per row
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  void load() const {
    // GCC's _tile_loadconfig tells the compiler it reads 8 bytes of the config, so the other stores could be
    // dropped as dead (and were, in one build: ldtilecfg then faults on rows without columns): all of it is read
    asm volatile("" : : "r"(this) : "memory");
    _tile_loadconfig(this);
  }
};

}  // namespace megapipe_amx
#endif
