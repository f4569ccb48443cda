// What the AMX kernels share: LOOM_AMX_TILES where the compiler targets tiles with bf16
// products (Intel Sapphire Rapids on), the process's permission to use them, and the tile
// configuration's layout.
#pragma once

#include <cstdint>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define LOOM_AMX_TILES 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace {

// Linux hands out the tile registers' state only to a process that asks (once).
inline bool amx_permitted() {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                        18 /* XFEATURE_XTILEDATA */) == 0;
  return permitted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};  // bytes per row, per tile
  uint8_t rows[16] = {};
};

}  // namespace
#endif
