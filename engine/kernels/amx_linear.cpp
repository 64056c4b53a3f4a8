// bf16 products for decode-sized batches (2..128 rows) on Intel AMX tiles, streaming the weights once.
//
// oneDNN's packed matmul (torch.ops.mkldnn._linear_pointwise) read the weights of a decode step at 7-11 GB/s at
// 32-64 rows on this 2-core host, against 12-14 GB/s for a plain sum over the same bytes. This kernel walks
// the weights in the order they lie in memory, prefetches the next pair of column blocks into L2 while the
// tiles work on the current one, and converts each 16x16 fp32 result tile to bf16 in registers. Figures:
// engine/kernels/packed_linear.py (python -m bench.amx_linear).
//
// Layout of a packed weight, from amx_pack_bf16: [N/16, K/32, 16, 32] bf16. Block (n, k) is the B tile of
// columns n*16..n*16+15 and reduction indices k*32..k*32+31, in AMX's pair layout: tile row r holds, for each
// of the 16 columns c, the two bf16 W[c][2r] and W[c][2r+1]. One column block's K/32 tiles are contiguous.
//
// Each row's result depends only on that row (fixed reduction order over K), not on the other rows of the
// batch. Accumulation is fp32, one rounding to bf16 at the end (round to nearest even), as torch's.
//
// Not for prefill. oneDNN's brgemm runs the 2048-row products of a prefill step at 0.4-1.0 TFLOPS here, and
// two threads often gain little over one (a layer's four products: 20.9 ms on one, 18.8-21.2 on two). The
// tile units are not the limit: a loop of tile products on registers alone reaches 2.0-2.5 TFLOPS a core,
// and two processes each reach it at once. With K = 576 an A or B panel is 36 KiB, so in 2x2 blocking one
// operand streams from L2, 1 KiB of tile loads per product; a probe of that loop (A and B pre-tiled, no
// stores) ran at ~0.5 TFLOPS a thread, ~10% more with software prefetch. This kernel at 2048 rows (row blocks
// of 64-512, A re-laid as contiguous tiles, either loop order) ran at 0.6-0.7 TFLOPS against oneDNN's 0.7-0.8
// in the same process (session 7).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>

#include "amx.h"
#include "parallel.h"

namespace {

using namespace cpu_ext::amx;

#if defined(CPU_EXT_AMX)

struct Problem {
  const uint16_t* a;     // [row_tiles * 16, K] bf16, rows past M zero
  const uint16_t* b;     // packed [N/16, K/32, 16, 32]
  const float* bias;     // [N] fp32 or null
  uint16_t* out;         // [M, N] bf16
  int64_t m, n, k, row_tiles, col_blocks, k_blocks;
};

// One 16x16 fp32 tile (already stored to `c`) -> bf16 rows of the output, bias added first.
void store_tile(const Problem& p, const float* c, int64_t row_tile, int64_t col_block) {
  const int64_t row0 = row_tile * kTileRows, col0 = col_block * kTileN;
  const __m512 bias = p.bias ? _mm512_loadu_ps(p.bias + col0) : _mm512_setzero_ps();
  for (int64_t r = 0; r < kTileRows && row0 + r < p.m; ++r) {
    const __m512 values = _mm512_add_ps(_mm512_load_ps(c + r * kTileN), bias);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p.out + (row0 + r) * p.n + col0),
                        (__m256i)_mm512_cvtneps_pbh(values));
  }
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

// Column blocks n0 and n0 + 1 (n0 alone when `two_cols` is false) for row tiles m0 and m0 + 1.
// Tiles: 0-3 C (two row tiles x two column blocks), 4-5 B (two column blocks), 6-7 A (two row tiles).
void tile_pair(const Problem& p, int64_t n0, bool two_cols, int64_t m0, Prefetch& prefetch, float* c) {
  const bool two_rows = m0 + 1 < p.row_tiles;
  const uint16_t* b0 = p.b + n0 * p.k_blocks * kBlockElems;
  const uint16_t* b1 = two_cols ? b0 + p.k_blocks * kBlockElems : b0;
  const uint16_t* a0 = p.a + m0 * kTileRows * p.k;
  const uint16_t* a1 = two_rows ? a0 + kTileRows * p.k : a0;
  const int64_t a_stride = p.k * 2;
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
  }
  _tile_stored(0, c, 64);
  store_tile(p, c, m0, n0);
  if (two_cols) {
    _tile_stored(1, c, 64);
    store_tile(p, c, m0, n0 + 1);
  }
  if (two_rows) {
    _tile_stored(2, c, 64);
    store_tile(p, c, m0 + 1, n0);
    if (two_cols) {
      _tile_stored(3, c, 64);
      store_tile(p, c, m0 + 1, n0 + 1);
    }
  }
}

// Pairs [begin, end) of column blocks: the weights of each streamed once, the next pair's prefetched meanwhile.
void run_pairs(const Problem& p, int64_t begin, int64_t end) {
  const int64_t pair_bytes = 2 * p.k_blocks * kBlockElems * 2;
  load_tile_config();
  alignas(64) float c[kTileRows * kTileN];
  for (int64_t pair = begin; pair < end; ++pair) {
    const int64_t n0 = 2 * pair;
    const bool two_cols = n0 + 1 < p.col_blocks;
    Prefetch prefetch;
    if (pair + 1 < end) {
      const int64_t iterations = (p.row_tiles + 1) / 2 * p.k_blocks;
      prefetch = {reinterpret_cast<const char*>(p.b) + (pair + 1) * pair_bytes, pair_bytes / 64,
                  (pair_bytes / 64 + iterations - 1) / iterations, 0};
    }
    for (int64_t m0 = 0; m0 < p.row_tiles; m0 += 2)  // after the first pass, B comes from cache
      tile_pair(p, n0, two_cols, m0, prefetch, c);
  }
  _tile_release();
}

// Threads claim runs of pairs as they free up (parallel.h); each pair's result is the same whoever computes it.
void run(const Problem& p) {
  const int64_t pairs = (p.col_blocks + 1) / 2;
  cpu_ext::parallel_claim(pairs, 2, [&](int64_t begin, int64_t end) { run_pairs(p, begin, end); });
}

#endif  // CPU_EXT_AMX

}  // namespace

bool amx_linear_available() {
#if defined(CPU_EXT_AMX)
  return permitted();
#else
  return false;
#endif
}

// weight [N, K] bf16, N % 16 == 0, K % 32 == 0 -> [N/16, K/32, 16, 32] bf16 (layout above).
torch::Tensor amx_pack_bf16(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.size(0) % kTileN == 0 &&
                  weight.size(1) % kTileK == 0,
              "amx_pack_bf16: weight must be bf16 [N, K] with N % 16 == 0 and K % 32 == 0");
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

// x [M, K] bf16, packed from amx_pack_bf16, bias [N] or empty -> [M, N] bf16 = x W^T + b.
torch::Tensor amx_linear_bf16(torch::Tensor x, torch::Tensor packed, torch::Tensor bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && packed.dim() == 4 &&
                  packed.scalar_type() == at::kBFloat16 && packed.size(2) == kTileRows &&
                  packed.size(3) == 2 * kTileN && packed.is_contiguous() && x.size(1) == packed.size(1) * kTileK,
              "amx_linear_bf16: x [M, K] bf16 and a weight from amx_pack_bf16 with the same K");
  const int64_t m = x.size(0), k = x.size(1), n = packed.size(0) * kTileN;
  TORCH_CHECK(bias.numel() == 0 || bias.numel() == n, "amx_linear_bf16: bias");
  torch::Tensor out = torch::empty({m, n}, x.options());
  if (m == 0) return out;
#if defined(CPU_EXT_AMX)
  TORCH_CHECK(permitted(), "amx_linear_bf16: the kernel did not grant this process AMX tiles");
  const int64_t row_tiles = (m + kTileRows - 1) / kTileRows;
  torch::Tensor a = x;
  if (m % kTileRows || !x.is_contiguous()) {  // whole tiles of rows: the rows past M are zero
    a = torch::zeros({row_tiles * kTileRows, k}, x.options());
    a.narrow(0, 0, m).copy_(x);
  }
  torch::Tensor bias32 = bias.numel() ? bias.to(torch::kFloat32).contiguous() : bias;
  const Problem p{reinterpret_cast<const uint16_t*>(a.data_ptr<at::BFloat16>()),
                  reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()),
                  bias.numel() ? bias32.data_ptr<float>() : nullptr,
                  reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()),
                  m, n, k, row_tiles, packed.size(0), packed.size(1)};
  run(p);
  return out;
#else
  TORCH_CHECK(false, "amx_linear_bf16: built without AMX (see amx_linear_available)");
#endif
}

void bind_amx_linear(pybind11::module& m) {
  m.def("amx_linear_available", &amx_linear_available, "whether this build and this process can use AMX tiles");
  m.def("amx_pack_bf16", &amx_pack_bf16, "pack a bf16 [N, K] weight into AMX B tiles");
  m.def("amx_linear_bf16", &amx_linear_bf16, "x W^T + b for 2..128 bf16 rows on AMX tiles, weights streamed once");
}
