// Intel AMX tiles: whether this build and process may use them, and the one tile configuration the kernels
// share (all eight tiles 16 rows x 64 bytes: a 16x32 bf16 A tile, a 16x16-pair bf16 B tile, a 16x16 fp32 C tile);
// and the choice between the tiles and AVX-512 BF16 vectors, which run the same packed blocks.
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define CPU_EXT_VECTOR_BF16 1  // the vector engine: vdpbf16ps on zmm registers (AMD Zen 4/5, Intel since Cooper Lake)
#include <immintrin.h>
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(CPU_EXT_VECTOR_BF16)
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
  // ldtilecfg through asm with the whole struct as its operand: GCC 12 does not see _tile_loadconfig read the
  // 64 bytes, drops the stores of rows and colsb where it inlines this, and the instruction then faults (#GP).
  asm volatile("ldtilecfg %0" : : "m"(config));
}

#endif  // CPU_EXT_AMX

// The engines of the products on packed bf16 blocks (tiled_linear.cpp, prompt_attention.cpp): AMX tiles, or the
// same blocks read a row at a time into zmm registers for vdpbf16ps. The codes are the kernels' `engine` argument.
enum class Engine : int64_t { kAuto = 0, kTiles = 1, kVectors = 2 };

// The engines' names by code, as cpu_ext reads them (phase_serve::engine_names).
inline std::vector<std::string> engine_names() { return {"auto", "tiles", "vectors"}; }

inline bool tiles_available() {
#if defined(CPU_EXT_AMX)
  return permitted();
#else
  return false;
#endif
}

constexpr bool vectors_available() {
#if defined(CPU_EXT_VECTOR_BF16)
  return true;
#else
  return false;
#endif
}

// engine (a code above) -> true for the tiles, false for the vectors; throws where that engine is not here.
inline bool use_tiles(int64_t engine, const char* name) {
  TORCH_CHECK(engine >= 0 && engine <= 2, name, ": engine ", engine, " (0 auto, 1 tiles, 2 vectors)");
  const bool tiles = engine == static_cast<int64_t>(Engine::kTiles) ||
                     (engine == static_cast<int64_t>(Engine::kAuto) && tiles_available());
  TORCH_CHECK(tiles ? tiles_available() : vectors_available(), name, ": no ", tiles ? "AMX tiles" : "AVX-512 BF16",
              " in this build or process (see cpu_ext.matrix_engines)");
  return tiles;
}

#if defined(CPU_EXT_VECTOR_BF16)

// The vector engine's product: c[r, 0..31] = sum over `steps` packed blocks of row r of A's pairs (2j, 2j + 1)
// times block row j of b0 | b1 (one zmm each: 16 columns x one pair), for R rows of A `a_stride` elements apart.
// b0 and b1 advance by `b_step` elements a block, A by 32; before each block, on_step() (a prefetch, or nothing).
// 2R accumulators, one vdpbf16ps each per pair: R = 8 keeps 16 in registers.
template <int R, typename OnStep>
inline void vector_block(const uint16_t* a, int64_t a_stride, const uint16_t* b0, const uint16_t* b1, int64_t b_step,
                         int64_t steps, float* c, int64_t c_stride, const OnStep& on_step) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t step = 0; step < steps; ++step, a += kTileK, b0 += b_step, b1 += b_step) {
    on_step();
#pragma GCC unroll 16
    for (int64_t j = 0; j < kTileRows; ++j) {
      const __m512bh left = (__m512bh)_mm512_loadu_si512(b0 + j * 2 * kTileN);
      const __m512bh right = (__m512bh)_mm512_loadu_si512(b1 + j * 2 * kTileN);
      const uint16_t* pairs = a + 2 * j;  // walked down the rows: one register, not R row pointers (they spilled)
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r, pairs += a_stride) {
        int32_t pair;
        std::memcpy(&pair, pairs, sizeof pair);
        const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, left);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, right);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(c + r * c_stride, acc[r][0]);
    _mm512_storeu_ps(c + r * c_stride + kTileN, acc[r][1]);
  }
}

constexpr int64_t kVectorRows = 8;  // rows of A a vector_block keeps in registers: 16 accumulators

#endif  // CPU_EXT_VECTOR_BF16

// The engines here, as codes: what cpu_ext.matrix_engines reports.
inline std::vector<int64_t> available_engines() {
  std::vector<int64_t> engines;
  if (tiles_available()) engines.push_back(static_cast<int64_t>(Engine::kTiles));
  if (vectors_available()) engines.push_back(static_cast<int64_t>(Engine::kVectors));
  return engines;
}

}  // namespace cpu_ext::amx
