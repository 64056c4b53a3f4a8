// Intel AMX tiles: whether this build and process may use them, and the one tile configuration the kernels
// share (all eight tiles 16 rows x 64 bytes: a 16x32 bf16 A tile, a 16x16-pair bf16 B tile, a 16x16 fp32 C tile).
#pragma once

#include <cstdint>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define CPU_EXT_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace cpu_ext::amx {

constexpr int64_t kTileRows = 16;  // rows of an A or C tile; k pairs of a B tile
constexpr int64_t kTileK = 32;     // bf16 reduction indices in one tile row of A
constexpr int64_t kTileN = 16;     // fp32 columns of a C tile
constexpr int64_t kBlockElems = kTileRows * 2 * kTileN;  // bf16 elements of one B tile (1 KiB)

#if defined(CPU_EXT_AMX)

// Linux hands out AMX's tile state only to a process that asks for it (once per process).
inline bool permitted() {
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  static const bool granted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};  // bytes per row of each tile
  uint8_t rows[16] = {};
};

// Once per thread before its first tile instruction (the configuration is per thread).
inline void load_tile_config() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = kTileRows;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

#endif  // CPU_EXT_AMX

}  // namespace cpu_ext::amx
