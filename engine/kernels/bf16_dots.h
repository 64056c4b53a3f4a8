// Weight-only products on AVX-512 BF16 dot products, for the quantised formats' many-row steps (int4_linear.cpp
// linear_int4_bf16, int8_grouped.cpp linear_int8g_bf16).
//
// An integer code up to 8 bits is exact in bf16, and its product with a bf16 activation exact in fp32, so vdpbf16ps
// on the codes gives each group's sum_k q[n, k] x[m, k] with only its fp32 additions rounded; then
//   out[m, n] = sum_g (s[g, n] * dot[m, g, n] + z[g, n] * t[m, g]) + bias[n],
// t the fp32 group sums of x, the weights s q + z never rounded: 32 products an instruction, where the fp32 kernels
// widen each code to a float and do 16. Per group of 16 or 32 k this costs one or two FMAs beside the dot products,
// so at compute-bound row counts it runs at 0.85-0.9 of the bf16 vector kernel (tiled_linear.cpp), on a quarter
// or half of its weight bytes.
//
// A format supplies `widen`: the codes of kBlocks 16-channel blocks, a chunk of groups at a time, as vectors of bf16
// pairs (lane c: the codes of k = order[2p], order[2p + 1] of channel c) and each group's scales and offsets as fp32;
// the activations are copied once into the same pair order. The threads claim pairs of blocks and run every row
// over one pair before the next, so each weight is widened once a call. Each row's result depends on that row only.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "activation_quant.h"
#include "parallel.h"
#include "vec.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)
#define CPU_EXT_BF16_DOTS 1
#include <immintrin.h>

namespace cpu_ext::dots {

constexpr int kRows = 6;              // rows of x a pass: 2 blocks x (group sum + total) x 6 rows = 24 registers
constexpr int kLanes = 8;             // row slots of a pass in PairRows: up to 8 rows for a format's own one-pass path
constexpr int64_t kBlocks = 2;        // 16-channel blocks a pass
constexpr int64_t kChannels = 16;     // output channels a block: one fp32 lane each
constexpr int64_t kChunkPairs = 1024;  // pairs of k widened at a time: 2 blocks x 64 KiB stay in L2
constexpr int64_t kCopyGrain = 256;    // rows of x pair_rows copies on one thread

// x [M, K] bf16 as the passes read it: the rows split into ceil(M / pass_rows) passes of as equal sizes as may be (8
// rows: 4 + 4, not 6 + 2); for each pass and group, pair p of the pass's row r at [p, r] (two bf16 a word, in the
// format's pair order), so that one pointer serves a pass's broadcasts; zeros past K. t: each group's fp32 sum.
// The lanes a pass leaves empty are never read, so the buffers are not cleared; they are the calling thread's own
// (pair_buffers), valid until its next pair_rows.
struct PairRows {
  uint32_t* pairs;  // [passes, G, group / 2, kLanes]
  float* t;         // [passes, G, kLanes]
  int64_t groups, group_pairs, m, passes;

  int64_t pass_first(int64_t pass) const { return pass * (m / passes) + std::min(pass, m % passes); }
  const uint32_t* pass_pairs(int64_t pass, int64_t g) const {
    return pairs + ((pass * groups + g) * group_pairs) * kLanes;
  }
  const float* pass_sums(int64_t pass, int64_t g) const { return t + (pass * groups + g) * kLanes; }
};

// The calling thread's PairRows buffers, grown and kept: at 32-64 rows a product's copy of x is 100-300 KiB, which a
// fresh zeroed allocation took from mmap, a page fault a page, every call.
struct PairBuffers {
  std::vector<uint32_t> pairs;
  std::vector<float> t;
};

inline PairBuffers& pair_buffers(int64_t pairs, int64_t sums) {
  thread_local PairBuffers buffers;
  if (static_cast<int64_t>(buffers.pairs.size()) < pairs) buffers.pairs.resize(pairs);
  if (static_cast<int64_t>(buffers.t.size()) < sums) buffers.t.resize(sums);
  return buffers;
}

// x [M, K] bf16 -> PairRows for groups of `group` (16 or 32) k, pair p of a group holding k = order[2p],
// order[2p + 1] (null: 2p, 2p + 1): each group's values permuted by one vpermw and scattered to their pass's lane,
// t summed in fp32 by a vector reduction. On one thread up to kCopyGrain rows: a decode step's copy takes some
// microseconds, less than waking a sleeping OpenMP team (OMP_WAIT_POLICY=PASSIVE) for a parallel region.
inline PairRows pair_rows(const torch::Tensor& x, int64_t groups, int64_t group, const int* order,
                          int64_t pass_rows = kRows) {
  TORCH_CHECK(1 <= pass_rows && pass_rows <= kLanes, "pair_rows: passes of 1 to ", kLanes, " rows");
  const int64_t m = x.size(0), k = x.size(1), passes = (m + pass_rows - 1) / pass_rows, half = group / 2;
  const int64_t base = m / passes, extra = m % passes;  // pass i has base + (i < extra) rows
  const torch::Tensor xc = x.contiguous();
  const auto* src = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  PairBuffers& buffers = pair_buffers(passes * groups * half * kLanes, passes * groups * kLanes);
  PairRows rows{buffers.pairs.data(), buffers.t.data(), groups, half, m, passes};
  alignas(64) int16_t permute_words[32];
  alignas(64) int32_t lanes[16];
  for (int64_t i = 0; i < 32; ++i) permute_words[i] = static_cast<int16_t>(order && i < group ? order[i] : i);
  for (int64_t p = 0; p < 16; ++p) lanes[p] = static_cast<int32_t>(p * kLanes);
  const __m512i permute = _mm512_load_si512(permute_words), scatter = _mm512_load_si512(lanes);
  const __mmask16 pair_lanes = lanes_below(half);
  at::parallel_for(0, m, kCopyGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t long_rows = extra * (base + 1);
      const int64_t pass = r < long_rows ? r / (base + 1) : extra + (r - long_rows) / base;
      const int64_t lane = r - rows.pass_first(pass);
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t count = std::min<int64_t>(group, k - g * group);
        const __mmask32 live = count >= 32 ? ~__mmask32{0} : (__mmask32{1} << count) - 1;
        const __m512i v = _mm512_maskz_loadu_epi16(live, src + r * k + g * group);
        const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(v)), 16));
        const __m512 hi =
            _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1)), 16));
        rows.t[(pass * groups + g) * kLanes + lane] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
        uint32_t* dst = rows.pairs + ((pass * groups + g) * half) * kLanes + lane;
        _mm512_mask_i32scatter_epi32(dst, pair_lanes, scatter, _mm512_permutexvar_epi16(permute, v), 4);
      }
    }
  });
  return rows;
}

// A chunk of widened groups of C blocks: codes[c] [count, P, 16] (bf16 pairs as uint32), scales[c] [count, 2, 16]
// (s, then z: zero past channel N).
template <int C>
struct Widened {
  uint32_t* codes[C];
  float* scales[C];
};

// Groups [g0, g0 + count) of the chunk against the R rows of pass `pass`: adds into part [R, C, 16] (fp32 totals).
template <int R, int C, int P, bool Offsets>
void dot_pass(const PairRows& x, int64_t pass, int64_t g0, int64_t count, const Widened<C>& w, float* part) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_loadu_ps(part + (r * C + c) * kChannels);
  for (int64_t i = 0; i < count; ++i) {
    __m512 dot[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) dot[r][c] = _mm512_setzero_ps();
    const uint32_t* xp = x.pass_pairs(pass, g0 + i);
    const uint32_t* wp[C];
    for (int c = 0; c < C; ++c) wp[c] = w.codes[c] + i * P * kChannels;
#pragma GCC unroll 16
    for (int p = 0; p < P; ++p) {
      __m512bh wv[C];
      for (int c = 0; c < C; ++c) wv[c] = (__m512bh)_mm512_loadu_si512(wp[c] + p * kChannels);
      for (int r = 0; r < R; ++r) {
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(xp[p * kLanes + r]);
        for (int c = 0; c < C; ++c) dot[r][c] = _mm512_dpbf16_ps(dot[r][c], xv, wv[c]);
      }
    }
    const float* t = x.pass_sums(pass, g0 + i);
    for (int c = 0; c < C; ++c) {
      const __m512 s = _mm512_loadu_ps(w.scales[c] + i * 2 * kChannels);
      for (int r = 0; r < R; ++r) acc[r][c] = _mm512_fmadd_ps(s, dot[r][c], acc[r][c]);
      if (Offsets) {
        const __m512 z = _mm512_loadu_ps(w.scales[c] + i * 2 * kChannels + kChannels);
        for (int r = 0; r < R; ++r) acc[r][c] = _mm512_fmadd_ps(z, _mm512_set1_ps(t[r]), acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(part + (r * C + c) * kChannels, acc[r][c]);
}

template <int C, int P, bool Offsets>
void dot_rows(int64_t rows, const PairRows& x, int64_t pass, int64_t g0, int64_t count, const Widened<C>& w,
              float* part) {
  switch (rows) {
    case 1: dot_pass<1, C, P, Offsets>(x, pass, g0, count, w, part); break;
    case 2: dot_pass<2, C, P, Offsets>(x, pass, g0, count, w, part); break;
    case 3: dot_pass<3, C, P, Offsets>(x, pass, g0, count, w, part); break;
    case 4: dot_pass<4, C, P, Offsets>(x, pass, g0, count, w, part); break;
    case 5: dot_pass<5, C, P, Offsets>(x, pass, g0, count, w, part); break;
    default: dot_pass<kRows, C, P, Offsets>(x, pass, g0, count, w, part); break;
  }
}

// Per-thread scratch: widened codes and scales of kBlocks blocks, and the rows' totals. Kept by each thread between
// calls (thread_local) and never cleared: every claim of blocks writes what it reads, and a fresh allocation a
// claim (some 100 KiB, zeroed) cost a fifth of a 64-row product on two threads.
struct Scratch {
  std::vector<uint32_t> codes;  // [kBlocks, chunk, P, 16]
  std::vector<float> scales;    // [kBlocks, chunk, 2, 16]
  std::vector<float> part;      // [M, kBlocks, 16]

  static Scratch& for_thread(int64_t chunk_pairs, int64_t chunk, int64_t m) {
    thread_local Scratch scratch;
    const auto grow = [](auto& v, int64_t size) {
      if (static_cast<int64_t>(v.size()) < size) v.resize(size);
    };
    grow(scratch.codes, kBlocks * chunk_pairs * kChannels);
    grow(scratch.scales, kBlocks * chunk * 2 * kChannels);
    grow(scratch.part, m * kBlocks * kChannels);
    return scratch;
  }
};

// Rows [first, first + m) of the output from part [m, C, 16] (the fp32 totals of blocks block..block + C - 1) plus
// bias: channels past N not written.
template <int C>
void store_rows(const float* part, int64_t m, int64_t n, const float* bias, OutRows out, int64_t block,
                int64_t first = 0) {
  for (int c = 0; c < C; ++c) {
    const int64_t n0 = (block + c) * kChannels;
    const __mmask16 live = lanes_below(n - n0);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(live, bias + n0) : _mm512_setzero_ps();
    for (int64_t r = 0; r < m; ++r) {
      const __m512 sum = _mm512_add_ps(_mm512_loadu_ps(part + (r * C + c) * kChannels), b);
      const int64_t at = (first + r) * n + n0;
      if (out.fp32) _mm512_mask_storeu_ps(static_cast<float*>(out.data) + at, live, sum);
      else _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out.data) + at, live, bf16_round(sum));
    }
  }
}

// store_rows for C = c (1, 2 or 4) blocks.
inline void store_blocks(const float* part, int64_t m, int c, int64_t n, const float* bias, OutRows out,
                         int64_t block) {
  switch (c) {
    case 4: store_rows<4>(part, m, n, bias, out, block); break;
    case 2: store_rows<2>(part, m, n, bias, out, block); break;
    default: TORCH_CHECK(c == 1, "store_blocks: 1, 2 or 4 blocks"); store_rows<1>(part, m, n, bias, out, block);
  }
}

// Groups widened at a time for groups of P pairs: kChunkPairs pairs, or every group where fewer.
template <int P>
constexpr int64_t chunk_groups(int64_t groups) {
  return std::min<int64_t>(kChunkPairs / P, groups);
}

// Blocks [block, block + C) for every row: the groups widened a chunk at a time, each chunk run over all the rows,
// the rows' fp32 totals kept in part [M, C, 16] between chunks; then finish(part, M, block, C).
template <int C, int P, bool Offsets, typename Widen, typename Finish>
void dot_blocks(const PairRows& x, int64_t block, Scratch& buf, const Widen& widen, const Finish& finish) {
  const int64_t m = x.m, chunk = chunk_groups<P>(x.groups);
  std::fill(buf.part.begin(), buf.part.begin() + m * C * kChannels, 0.f);
  Widened<C> w;
  for (int c = 0; c < C; ++c) {
    w.codes[c] = buf.codes.data() + c * chunk * P * kChannels;
    w.scales[c] = buf.scales.data() + c * chunk * 2 * kChannels;
  }
  for (int64_t g0 = 0; g0 < x.groups; g0 += chunk) {
    const int64_t count = std::min(chunk, x.groups - g0);
    for (int c = 0; c < C; ++c)
      widen(block + c, g0, count, w.codes[c], w.scales[c]);
    for (int64_t pass = 0; pass < x.passes; ++pass) {
      const int64_t first = x.pass_first(pass);
      dot_rows<C, P, Offsets>(x.pass_first(pass + 1) - first, x, pass, g0, count, w,
                              buf.part.data() + first * C * kChannels);
    }
  }
  finish(buf.part.data(), m, block, C);
}

// The product of x (PairRows) and N channels' widened weights, each pair of blocks' fp32 totals handed to
// `finish(part [M, C, 16], M, block, C)` on the thread that made them: `widen(block, g0, count, codes, scales)` as
// above, P pairs a group; Offsets: the groups have offsets z.
template <int P, bool Offsets, typename Widen, typename Finish>
void run(const PairRows& x, int64_t n, const Widen& widen, const Finish& finish) {
  const int64_t blocks = (n + kChannels - 1) / kChannels, chunk = chunk_groups<P>(x.groups);
  cpu_ext::parallel_claim((blocks + kBlocks - 1) / kBlocks, 1, [&](int64_t begin, int64_t end) {
    Scratch& buf = Scratch::for_thread(chunk * P, chunk, x.m);
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t block = pair * kBlocks;
      if (block + kBlocks <= blocks) dot_blocks<2, P, Offsets>(x, block, buf, widen, finish);
      else dot_blocks<1, P, Offsets>(x, block, buf, widen, finish);
    }
  });
}

// run() into out [M, N] (bias added): the rows stored as store_rows writes them.
template <int P, bool Offsets, typename Widen>
void run(const PairRows& x, int64_t n, const float* bias, OutRows out, const Widen& widen) {
  run<P, Offsets>(x, n, widen, [&](const float* part, int64_t m, int64_t block, int c) {
    store_blocks(part, m, c, n, bias, out, block);
  });
}

// One pass of up to kLanes rows whose codes a format widens in registers as it uses them (int4_linear.cpp and
// int8_grouped.cpp direct_blocks): for R = rows, the threads claim runs of C = BlocksFor(R) blocks and call
// body(R, C, block) on each (as std::integral_constant), C = 1 on the blocks past the last whole run.
template <int R, int (*BlocksFor)(int), typename Body>
void direct_runs(int64_t blocks, const Body& body) {
  constexpr int C = BlocksFor(R);
  const std::integral_constant<int, R> rows;
  cpu_ext::parallel_claim((blocks + C - 1) / C, 1, [&](int64_t begin, int64_t end) {
    for (int64_t run = begin; run < end; ++run) {
      int64_t block = run * C;
      if (block + C <= blocks) {
        body(rows, std::integral_constant<int, C>{}, block);
        continue;
      }
      for (; block < blocks; ++block) body(rows, std::integral_constant<int, 1>{}, block);
    }
  });
}

template <int (*BlocksFor)(int), typename Body>
void direct_pass(int64_t rows, int64_t blocks, const Body& body) {
  switch (rows) {
    case 1: direct_runs<1, BlocksFor>(blocks, body); break;
    case 2: direct_runs<2, BlocksFor>(blocks, body); break;
    case 3: direct_runs<3, BlocksFor>(blocks, body); break;
    case 4: direct_runs<4, BlocksFor>(blocks, body); break;
    case 5: direct_runs<5, BlocksFor>(blocks, body); break;
    case 6: direct_runs<6, BlocksFor>(blocks, body); break;
    case 7: direct_runs<7, BlocksFor>(blocks, body); break;
    default: direct_runs<kLanes, BlocksFor>(blocks, body); break;
  }
}

}  // namespace cpu_ext::dots

#endif  // CPU_EXT_BF16_DOTS
