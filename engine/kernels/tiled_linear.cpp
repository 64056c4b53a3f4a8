// bf16 products on weights packed into 16x16-pair blocks, for decode batches and prefill chunks (2 rows up to
// packed_linear.max_tiled_rows(); the MLP's gate|up product with SiLU * up at any row count), streaming the weights
// once per slice of rows. Two engines run the same packed weights (amx.h):
// - tiles: Intel AMX, the blocks as B tiles (everything below up to the vector engine's section);
// - vectors: AVX-512 BF16 where the CPU has no AMX (AMD Zen 4/5). Each block row (16 columns x one pair of the
//   reduction) is one zmm register; 8 rows of A by 2 column blocks are 16 accumulators, one vdpbf16ps each per
//   pair (amx.h's vector_block, shared with prompt_attention.cpp).
// Why not oneDNN's packed matmul: it reads a decode step's weights well below the memory's bandwidth. This kernel
// walks the weights in the order they lie in memory, prefetches the next pair of column blocks into L2 while the
// current one is computed, and converts each 16x16 fp32 result tile to bf16 in registers. Figures, and the
// variants that were no faster: docs/performance.md, "Packed-block products" (python -m bench.tiled_linear).
//
// Layout of a packed weight, from tile_pack_bf16: [N/16, K/32, 16, 32] bf16. Block (n, k) is the B tile of
// columns n*16..n*16+15 and reduction indices k*32..k*32+31, in AMX's pair layout: tile row r holds, for each
// of the 16 columns c, the two bf16 W[c][2r] and W[c][2r+1]. One column block's K/32 tiles are contiguous.
//
// tiled_linear_argmax_bf16 runs the same product and keeps each row's argmax as the tiles come out, for greedy
// steps: the [M, N] logits are neither written nor read back by a separate argmax.
//
// tiled_linear_silu_mul_bf16 is the MLP's gate|up product on a weight packed with its 16-column blocks interleaved
// (gate block j, then up block j: packed_linear.pack_gate_up), so that each pair of column blocks holds the gate
// and up columns of the same 16 outputs. SiLU(gate) * up is computed from their bf16 values as the tiles come
// out, to the bit as silu_mul_bf16 computes it from the stored product, and only the [M, I] result is written.
//
// Each tile_pair's results go out while the next one's tile products run (Results): a few output rows per k
// block, so that the vector work after the tiles (conversion, stores, SiLU) overlaps the tile units.
//
// Each row's result depends only on that row (fixed reduction order over K), not on the other rows of the
// batch. Accumulation is fp32, one rounding to bf16 at the end (round to nearest even), as torch's.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <optional>
#include <vector>

#include "amx.h"
#include "parallel.h"
#include "row_best.h"
#include "vec.h"

namespace {

using namespace cpu_ext::amx;
using cpu_ext::RowBest;

#if defined(CPU_EXT_VECTOR_BF16)

struct Problem {
  const uint16_t* a;     // [row_tiles * 16, K] bf16, rows past M zero (vectors: [M, K], nothing past M read)
  const uint16_t* b;     // packed [N/16, K/32, 16, 32]
  const float* bias;     // [N] fp32 or null
  uint16_t* out;         // [M, out_cols] bf16: out_cols = N, or N / 2 for silu(gate) * up
  int64_t m, k, row_tiles, col_blocks, k_blocks, out_cols;
  bool tiles;              // the engine: AMX tiles, or vectors
  float* out32 = nullptr;  // [M, out_cols] fp32, written instead of `out` (the sums kept whole), or null
};

// Rounded to bf16 and widened back: the value a bf16 store followed by a bf16 load gives.
inline __m512 bf16_value(__m512 x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
}

// One row of a 16x16 fp32 result tile -> 16 bf16 of the output (or 16 fp32 where out32 is set), bias added first.
void store_row(const Problem& p, const float* c_row, int64_t row, int64_t col_block) {
  const int64_t col0 = col_block * kTileN;
  const __m512 bias = p.bias ? _mm512_loadu_ps(p.bias + col0) : _mm512_setzero_ps();
  const __m512 sum = _mm512_add_ps(_mm512_load_ps(c_row), bias);
  if (p.out32) {
    _mm512_storeu_ps(p.out32 + row * p.out_cols + col0, sum);
    return;
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p.out + row * p.out_cols + col0), (__m256i)_mm512_cvtneps_pbh(sum));
}

// The next pair's weights, asked into L2 a few lines per k block over all of this pair's row-tile passes, so
// that every pass has memory traffic under its tile work (not only the first, which streams its own B).
struct Prefetch {
  const char* base = nullptr;  // null: nothing to prefetch
  int64_t total = 0, per_block = 0, next = 0;  // 64-byte lines: all, per k block, the next to ask for

  void step() {
    for (int64_t i = 0; i < per_block && next < total; ++i, ++next) _mm_prefetch(base + next * 64, _MM_HINT_T1);
  }
};

// The next pair's weights (none after the last of the run): `iterations` k blocks take them, a few lines each.
Prefetch next_pair(const Problem& p, int64_t pair, int64_t end, int64_t iterations) {
  if (pair + 1 >= end) return {};
  const int64_t pair_lines = 2 * p.k_blocks * kBlockElems * 2 / 64;
  return {reinterpret_cast<const char*>(p.b) + (pair + 1) * pair_lines * 64, pair_lines,
          (pair_lines + iterations - 1) / iterations, 0};
}

#if defined(CPU_EXT_AMX)

// The results of one tile_pair, parked in `c` [2 row tiles, 2 column blocks, 16, 16] fp32, handed to the sink
// a few rows at a time while the next tile_pair's products run: the sink's vector work (conversion, stores,
// an epilogue) overlaps the tile units' instead of following it. sink(c0_row, c1_row, row, n0) takes one
// output row of column block n0 (c0_row) and of n0 + 1 (c1_row, null when there is none).
template <typename Sink>
struct Results {
  const Sink& sink;
  float* c;
  int64_t row0 = 0, rows = 0, next = 0, n0 = 0;  // rows parked: [row0, row0 + rows); `next` the first not given
  bool two_cols = false;

  void give(int64_t count) {
    for (; count > 0 && next < rows; --count, ++next) {
      const float* c0 = c + ((next / kTileRows) * 2 * kTileRows + next % kTileRows) * kTileN;
      sink(c0, two_cols ? c0 + kTileRows * kTileN : nullptr, row0 + next, n0);
    }
  }
  void give_all() { give(rows); }

  // rows [first, first + count) of column blocks n0 (and n0 + 1 when `both`) are now in `c`
  void park(int64_t first, int64_t count, int64_t block, bool both) {
    row0 = first;
    rows = count;
    next = 0;
    n0 = block;
    two_cols = both;
  }
};

// Column blocks n0 and n0 + 1 (n0 alone when `two_cols` is false) for row tiles m0 and m0 + 1; the previous
// tile_pair's results go to the sink during the products, this one's are parked in `results` at the end.
// Tiles: 0-3 C (two row tiles x two column blocks), 4-5 B (two column blocks), 6-7 A (two row tiles).
template <typename Sink>
void tile_pair(const Problem& p, int64_t n0, bool two_cols, int64_t m0, Prefetch& prefetch, Results<Sink>& results) {
  const bool two_rows = m0 + 1 < p.row_tiles;
  const uint16_t* b0 = p.b + n0 * p.k_blocks * kBlockElems;
  const uint16_t* b1 = two_cols ? b0 + p.k_blocks * kBlockElems : b0;
  const uint16_t* a0 = p.a + m0 * kTileRows * p.k;
  const uint16_t* a1 = two_rows ? a0 + kTileRows * p.k : a0;
  const int64_t a_stride = p.k * 2, rows_per_block = (2 * kTileRows + p.k_blocks - 1) / p.k_blocks;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t kb = 0; kb < p.k_blocks; ++kb) {
    prefetch.step();
    _tile_loadd(6, a0 + kb * kTileK, a_stride);
    _tile_loadd(4, b0 + kb * kBlockElems, 64);
    _tile_dpbf16ps(0, 6, 4);
    _tile_loadd(5, b1 + kb * kBlockElems, 64);
    _tile_dpbf16ps(1, 6, 5);
    _tile_loadd(7, a1 + kb * kTileK, a_stride);
    _tile_dpbf16ps(2, 7, 4);
    _tile_dpbf16ps(3, 7, 5);
    results.give(rows_per_block);
  }
  results.give_all();
  float* c = results.c;
  constexpr int64_t kTile = kTileRows * kTileN;
  _tile_stored(0, c, 64);
  if (two_cols) _tile_stored(1, c + kTile, 64);
  if (two_rows) {
    _tile_stored(2, c + 2 * kTile, 64);
    if (two_cols) _tile_stored(3, c + 3 * kTile, 64);
  }
  const int64_t row0 = m0 * kTileRows;
  results.park(row0, std::min<int64_t>((two_rows ? 2 : 1) * kTileRows, p.m - row0), n0, two_cols);
}

// Pairs [begin, end) of column blocks: the weights of each streamed once, the next pair's prefetched meanwhile.
template <typename Sink>
void run_tile_pairs(const Problem& p, int64_t begin, int64_t end, const Sink& sink) {
  load_tile_config();
  alignas(64) float c[4 * kTileRows * kTileN];
  Results<Sink> results{sink, c};
  for (int64_t pair = begin; pair < end; ++pair) {
    const int64_t n0 = 2 * pair;
    const bool two_cols = n0 + 1 < p.col_blocks;
    Prefetch prefetch = next_pair(p, pair, end, (p.row_tiles + 1) / 2 * p.k_blocks);
    for (int64_t m0 = 0; m0 < p.row_tiles; m0 += 2)  // after the first pass, B comes from cache
      tile_pair(p, n0, two_cols, m0, prefetch, results);
  }
  results.give_all();
  _tile_release();
}

#endif  // CPU_EXT_AMX

// ---- The vector engine -----------------------------------------------------------------------------------

// Rows [row, row + R) of A times column blocks b0 | b1 (b1 = b0 when there is one) -> sink, one row at a time.
template <int R, typename Sink>
void vector_rows(const Problem& p, int64_t row, const uint16_t* b0, const uint16_t* b1, int64_t n0, bool two_cols,
                 Prefetch& prefetch, const Sink& sink) {
  alignas(64) float c[R][2 * kTileN];
  vector_block<R>(p.a + row * p.k, p.k, b0, b1, kBlockElems, p.k_blocks, c[0], 2 * kTileN, [&] { prefetch.step(); });
  for (int r = 0; r < R; ++r) sink(c[r], two_cols ? c[r] + kTileN : nullptr, row + r, n0);
}

// R = 1..7 rows: the last rows of A.
template <typename Sink, int R = kVectorRows - 1>
void vector_tail(int rows, const Problem& p, int64_t row, const uint16_t* b0, const uint16_t* b1, int64_t n0,
                 bool two_cols, Prefetch& prefetch, const Sink& sink) {
  if constexpr (R >= 1) {
    if (rows == R) return vector_rows<R>(p, row, b0, b1, n0, two_cols, prefetch, sink);
    vector_tail<Sink, R - 1>(rows, p, row, b0, b1, n0, two_cols, prefetch, sink);
  }
}

// run_tile_pairs on the vector engine: each pair of column blocks over all of A's rows, 8 at a time (after the
// first 8, the pair's weights come from L1/L2), the next pair's prefetched meanwhile.
template <typename Sink>
void run_vector_pairs(const Problem& p, int64_t begin, int64_t end, const Sink& sink) {
  const int64_t chunks = (p.m + kVectorRows - 1) / kVectorRows;
  for (int64_t pair = begin; pair < end; ++pair) {
    const int64_t n0 = 2 * pair;
    const bool two_cols = n0 + 1 < p.col_blocks;
    const uint16_t* b0 = p.b + n0 * p.k_blocks * kBlockElems;
    const uint16_t* b1 = two_cols ? b0 + p.k_blocks * kBlockElems : b0;
    Prefetch prefetch = next_pair(p, pair, end, chunks * p.k_blocks);
    int64_t row = 0;
    for (; row + kVectorRows <= p.m; row += kVectorRows)
      vector_rows<kVectorRows>(p, row, b0, b1, n0, two_cols, prefetch, sink);
    vector_tail(static_cast<int>(p.m - row), p, row, b0, b1, n0, two_cols, prefetch, sink);
  }
}

template <typename Sink>
void run_pairs(const Problem& p, int64_t begin, int64_t end, const Sink& sink) {
#if defined(CPU_EXT_AMX)
  if (p.tiles) return run_tile_pairs(p, begin, end, sink);
#endif
  run_vector_pairs(p, begin, end, sink);
}

// A's rows in slices of about 1 MiB, so that a slice stays in L2 while every pair of column blocks passes over
// it (a 2048 x 576 A is 2.3 MiB: unsliced, it streamed from L3 once per pair). Each slice streams the weights
// again, which is cheap next to that (slice sizes measured: docs/performance.md).
constexpr int64_t kSliceBytes = 1 << 20;

// Calls fn(slice, first_row) for p's rows in slices of about kSliceBytes of A, each slice a problem of its own.
template <typename Fn>
void for_row_slices(const Problem& p, const Fn& fn) {
  const int64_t slice = std::max<int64_t>(2, kSliceBytes / (p.k * 2 * kTileRows) / 2 * 2);  // row tiles, even
  for (int64_t first = 0; first < p.row_tiles; first += slice) {
    Problem s = p;
    s.a += first * kTileRows * p.k;
    if (s.out) s.out += first * kTileRows * p.out_cols;
    if (s.out32) s.out32 += first * kTileRows * p.out_cols;
    s.m = std::min(p.m - first * kTileRows, slice * kTileRows);
    s.row_tiles = std::min(slice, p.row_tiles - first);
    fn(s, first * kTileRows);
  }
}

// Threads claim runs of pairs as they free up (parallel.h); each pair's result is the same whoever computes it.
void run(const Problem& p) {
  for_row_slices(p, [](const Problem& s, int64_t) {
    const auto store = [&](const float* c0, const float* c1, int64_t row, int64_t n0) {
      store_row(s, c0, row, n0);
      if (c1) store_row(s, c1, row, n0 + 1);
    };
    cpu_ext::parallel_claim((s.col_blocks + 1) / 2, 2,
                            [&](int64_t begin, int64_t end) { run_pairs(s, begin, end, store); });
  });
}

// One row of an interleaved gate|up pair (gate and up columns of block `block`, fp32) -> 16 bf16 of
// silu(gate) * up, computed as silu_mul_bf16 (cpu_ext.cpp) computes it from the bf16 products store_row would
// have written (the + 0 is store_row's bias: it turns -0 into +0 as there).
void store_silu_mul_row(const Problem& p, const float* gate_row, const float* up_row, int64_t row, int64_t block) {
  const __m512 zero = _mm512_setzero_ps();
  const __m512 gate = bf16_value(_mm512_add_ps(_mm512_load_ps(gate_row), zero));
  const __m512 up = bf16_value(_mm512_add_ps(_mm512_load_ps(up_row), zero));
  const __m512 exp_minus_gate = cpu_ext::exp512(_mm512_sub_ps(zero, gate));
  const __m512 silu = bf16_value(_mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.f), exp_minus_gate)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p.out + row * p.out_cols + block * kTileN),
                      (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(silu, up)));
}

// run() for an interleaved gate|up weight: each pair of column blocks is (gate block j, up block j).
void run_silu_mul(const Problem& p) {
  for_row_slices(p, [](const Problem& s, int64_t) {
    const auto store = [&](const float* gate_row, const float* up_row, int64_t row, int64_t n0) {
      store_silu_mul_row(s, gate_row, up_row, row, n0 / 2);
    };
    cpu_ext::parallel_claim(s.col_blocks / 2, 2, [&](int64_t begin, int64_t end) { run_pairs(s, begin, end, store); });
  });
}

// One row of a 16x16 fp32 tile as store_row would write it with out32 (the fp32 sums), offered to `best`.
void best_in_row(const Problem& p, const float* c_row, int64_t row, int64_t col_block, RowBest& best) {
  const int64_t col0 = col_block * kTileN;
  const __m512 bias = p.bias ? _mm512_loadu_ps(p.bias + col0) : _mm512_setzero_ps();
  cpu_ext::offer_lanes(best, row, _mm512_add_ps(_mm512_load_ps(c_row), bias), col0);
}

// Each claim keeps its rows' best in its own RowBest, folded into `into` at its end.
void run_argmax(const Problem& p, RowBest& into) {
  std::mutex fold;
  for_row_slices(p, [&](const Problem& s, int64_t first_row) {
    cpu_ext::parallel_claim((s.col_blocks + 1) / 2, 2, [&](int64_t begin, int64_t end) {
      RowBest mine(s.m);
      run_pairs(s, begin, end, [&](const float* c0, const float* c1, int64_t row, int64_t n0) {
        best_in_row(s, c0, row, n0, mine);
        if (c1) best_in_row(s, c1, row, n0 + 1, mine);
      });
      const std::lock_guard<std::mutex> hold(fold);
      into.fold(mine, first_row);
    });
  });
}

#endif  // CPU_EXT_VECTOR_BF16

}  // namespace

// weight [N, K] bf16, N % 16 == 0, K % 32 == 0 -> [N/16, K/32, 16, 32] bf16 (layout above).
torch::Tensor tile_pack_bf16(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.size(0) % kTileN == 0 &&
                  weight.size(1) % kTileK == 0,
              "tile_pack_bf16: weight must be bf16 [N, K] with N % 16 == 0 and K % 32 == 0");
  weight = weight.contiguous();
  const int64_t n = weight.size(0), k = weight.size(1), col_blocks = n / kTileN, k_blocks = k / kTileK;
  torch::Tensor packed = torch::empty({col_blocks, k_blocks, kTileRows, 2 * kTileN}, weight.options());
  const auto* src = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  auto* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  at::parallel_for(0, col_blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb)
      for (int64_t kb = 0; kb < k_blocks; ++kb) {
        uint16_t* tile = dst + (nb * k_blocks + kb) * kBlockElems;
        for (int64_t r = 0; r < kTileRows; ++r)
          for (int64_t c = 0; c < kTileN; ++c) {
            const uint16_t* w = src + (nb * kTileN + c) * k + kb * kTileK + 2 * r;
            tile[(r * kTileN + c) * 2] = w[0];
            tile[(r * kTileN + c) * 2 + 1] = w[1];
          }
      }
  });
  return packed;
}

namespace {

// Checks the operands and the engine -> true for the tiles, false for the vectors.
bool check_operands(const torch::Tensor& x, const torch::Tensor& packed, int64_t engine, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && packed.dim() == 4 &&
                  packed.scalar_type() == at::kBFloat16 && packed.size(2) == kTileRows &&
                  packed.size(3) == 2 * kTileN && packed.is_contiguous() && x.size(1) == packed.size(1) * kTileK,
              name, ": x [M, K] bf16 and a weight from tile_pack_bf16 with the same K");
  return use_tiles(engine, name);
}

#if defined(CPU_EXT_VECTOR_BF16)

// x's rows as whole tiles (rows past M zero; `x` itself when it already is).
torch::Tensor whole_row_tiles(const torch::Tensor& x) {
  const int64_t m = x.size(0), row_tiles = (m + kTileRows - 1) / kTileRows;
  if (m % kTileRows == 0 && x.is_contiguous()) return x;
  torch::Tensor a = torch::zeros({row_tiles * kTileRows, x.size(1)}, x.options());
  a.narrow(0, 0, m).copy_(x);
  return a;
}

// A as the engine reads it (the tiles: whole row tiles; the vectors: x's rows, contiguous), kept alive by the
// caller, and the problem over it.
struct Operands {
  torch::Tensor a;
  Problem p;

  Operands(const torch::Tensor& x, const torch::Tensor& packed, const float* bias, uint16_t* out, int64_t out_cols,
           bool tiles)
      : a(tiles ? whole_row_tiles(x) : x.contiguous()),
        p{reinterpret_cast<const uint16_t*>(a.data_ptr<at::BFloat16>()),
          reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), bias, out, x.size(0), x.size(1),
          (a.size(0) + kTileRows - 1) / kTileRows, packed.size(0), packed.size(1), out_cols, tiles} {}
};

uint16_t* bf16_data(torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

#endif  // CPU_EXT_VECTOR_BF16

}  // namespace

// x [M, K] bf16, packed from tile_pack_bf16, bias [N] or empty -> [M, N] bf16 (fp32 with fp32_out: the sums kept
// whole) = x W^T + b. engine: 0 the fastest here (tiles, then vectors), 1 AMX tiles, 2 AVX-512 BF16 vectors.
torch::Tensor tiled_linear_bf16(torch::Tensor x, torch::Tensor packed, torch::Tensor bias, int64_t engine,
                                bool fp32_out) {
  const int64_t n = packed.dim() == 4 ? packed.size(0) * kTileN : 0;
  TORCH_CHECK(bias.numel() == 0 || bias.numel() == n, "tiled_linear_bf16: bias");
  const auto out_dtype = fp32_out ? at::kFloat : at::kBFloat16;
  if (x.dim() == 2 && x.size(0) == 0) return torch::empty({0, n}, x.options().dtype(out_dtype));
  const bool tiles = check_operands(x, packed, engine, "tiled_linear_bf16");
  torch::Tensor out = torch::empty({x.size(0), n}, x.options().dtype(out_dtype));
#if defined(CPU_EXT_VECTOR_BF16)
  torch::Tensor bias32 = bias.numel() ? bias.to(torch::kFloat32).contiguous() : bias;
  Operands ops(x, packed, bias.numel() ? bias32.data_ptr<float>() : nullptr, fp32_out ? nullptr : bf16_data(out), n,
               tiles);
  if (fp32_out) ops.p.out32 = out.data_ptr<float>();
  run(ops.p);
#endif
  return out;
}

// x [M, K] bf16, packed from tile_pack_bf16 of a gate|up weight [2I, K] interleaved by 16-row blocks (gate block
// j, then up block j: packed_linear.pack_gate_up) -> [M, I] bf16 silu(gate) * up: silu_mul_bf16 of the plain
// product to the bit, without writing or rereading the [M, 2I] product. engine: as tiled_linear_bf16.
torch::Tensor tiled_linear_silu_mul_bf16(torch::Tensor x, torch::Tensor packed, int64_t engine) {
  TORCH_CHECK(packed.dim() == 4 && packed.size(0) % 2 == 0, "tiled_linear_silu_mul_bf16: the packed weight must "
              "have an even number of 16-column blocks (gate and up interleaved)");
  const int64_t width = packed.size(0) / 2 * kTileN;
  if (x.dim() == 2 && x.size(0) == 0) return torch::empty({0, width}, x.options());
  const bool tiles = check_operands(x, packed, engine, "tiled_linear_silu_mul_bf16");
  torch::Tensor out = torch::empty({x.size(0), width}, x.options());
#if defined(CPU_EXT_VECTOR_BF16)
  const Operands ops(x, packed, nullptr, bf16_data(out), width, tiles);
  run_silu_mul(ops.p);
#endif
  return out;
}

// x [M, K] bf16 (M >= 1), packed from tile_pack_bf16 -> [M] int64: for each row, the first column of the maximum
// (NaN counting as the maximum) of tiled_linear_bf16(x, packed, fp32_out) (torch's max on those fp32 sums), without
// writing the [M, N] product: the greedy pick straight off the LM head. engine: as tiled_linear_bf16.
torch::Tensor tiled_linear_argmax_bf16(torch::Tensor x, torch::Tensor packed, int64_t engine) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1, "tiled_linear_argmax_bf16: x must have rows");
  const bool tiles = check_operands(x, packed, engine, "tiled_linear_argmax_bf16");
  torch::Tensor out = torch::empty({x.size(0)}, x.options().dtype(torch::kLong));
#if defined(CPU_EXT_VECTOR_BF16)
  const Operands ops(x, packed, nullptr, nullptr, packed.size(0) * kTileN, tiles);
  RowBest best(ops.p.m);
  run_argmax(ops.p, best);
  std::copy(best.column.begin(), best.column.end(), out.data_ptr<int64_t>());
#endif
  return out;
}

namespace {

torch::Tensor tiled_linear_op(torch::Tensor x, torch::Tensor packed, const std::optional<torch::Tensor>& bias,
                              int64_t engine, bool fp32_out) {
  return tiled_linear_bf16(std::move(x), std::move(packed), bias ? *bias : torch::empty({0}), engine, fp32_out);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(phase_serve, m) {
  m.def("matrix_engines() -> int[]", &cpu_ext::amx::available_engines);  // fastest first: 1 tiles, 2 vectors
  m.def("engine_names() -> str[]", &cpu_ext::amx::engine_names);  // by code: the `engine` arguments below
  m.def("tile_pack_bf16(Tensor weight) -> Tensor");
  m.def("tiled_linear_bf16(Tensor x, Tensor packed, Tensor? bias, int engine, bool fp32_out=False) -> Tensor");
  m.def("tiled_linear_silu_mul_bf16(Tensor x, Tensor packed, int engine) -> Tensor");
  m.def("tiled_linear_argmax_bf16(Tensor x, Tensor packed, int engine) -> Tensor");
}

TORCH_LIBRARY_IMPL(phase_serve, CPU, m) {
  m.impl("tile_pack_bf16", &tile_pack_bf16);
  m.impl("tiled_linear_bf16", &tiled_linear_op);
  m.impl("tiled_linear_silu_mul_bf16", &tiled_linear_silu_mul_bf16);
  m.impl("tiled_linear_argmax_bf16", &tiled_linear_argmax_bf16);
}
