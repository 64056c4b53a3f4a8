// Products on int8g weights (engine/backends/weight_ops.py): int8 codes in blocks of 16 output channels,
// codes [Nb, G, 256] (Nb = ceil(N / 16)): codes[b, g, 32 p + 2 c + j] = q[16 b + c, 16 g + 2 p + j], zero past N
// and K, so that 32 bytes hold the pair of k (2p, 2p + 1) of one group for 16 channels side by side; and fp32 scales
// [S, G', N], S = 1 (s) or 2 (s, z), per group of 16 along K (G' = G) or, where a file's scales hold for 32 values
// (Q8_0, the 4- and 5-bit types), per pair of groups (G' = ceil(K / 32)): a Q8_0 weight then takes 1.125 bytes a
// value, not 1.25. Where N is a multiple of 16 the scales lie in the codes' blocks, [N / 16, G', S, 16], so that a
// block's scales are one stream beside its codes: read at [S, G', N], each group's 64 bytes lay N * 4 bytes from
// the last, a new page each, and their loads took half a one-row product's time. The weight is w = s q (+ z): a
// GGUF file's values exactly (engine/model/gguf_int8g.py). Every product sums each group's q x and then adds
// s dot + z t (t the group's sum of x), so the weights s q + z are never rounded; only the fp32 sums are.
// - linear_int8g: decode-sized row counts. Each pair's 32 codes are widened in registers to two fp32 vectors
//   (lanes: 8 channels x the pair's two k) and multiplied into fp32 dot sums against the rows of x in fp32 (bf16
//   widened exactly, once a call); each group's scale and offset are permuted to those lanes, and a block's two
//   lanes per channel added at its end. The codes' stream is fetched ahead, non-temporal, so x stays in L1.
// - linear_int8g_bf16: the weight-only product on AVX-512 BF16 dot products (bf16_dots.h): each pair's codes
//   widen to one vector of 16 bf16 pairs, exact, with no transpose (the blocks hold the channels side by side):
//   in registers as they are used for up to 8 rows, once per call into a buffer for more.
// - linear_int8g_bf16_argmax: its greedy pick, each row's argmax of the fp32 sums, without the [M, N] sums.
// - dequantize_int8g: rows of the weight to bf16 (or fp32), for the larger row counts that take at::linear (prefill).
//
// out[m, n] = bf16(sum_k w[n, k] x[m, k] + bias[n]); each row's result depends on that row only.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "activation_quant.h"
#include "bf16_dots.h"
#include "parallel.h"
#include "row_best.h"
#include "vec.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define CPU_EXT_INT8G_AVX512 1
#include <immintrin.h>
#endif

int64_t int8g_channels(const torch::Tensor& scales);  // below: the decode stack calls it too

namespace {

using cpu_ext::OutRows;
using cpu_ext::out_rows;
using cpu_ext::output_rows;

constexpr int64_t kGroup = 16;                       // weights per group of codes along K (a scale's 16 or 32)
constexpr int64_t kChannels = 16;                    // output channels a block
constexpr int64_t kBlockBytes = kChannels * kGroup;  // one group of one block: 8 pairs x 16 channels x 2 codes
constexpr int kRows = 4;                             // rows of x per pass of linear_int8g
constexpr int64_t kAhead = 1024;                     // bytes of a block's codes fetched ahead of the products

struct GroupedWeights {
  const int8_t* codes;   // [blocks, groups, 256]
  const float* scale;    // [groups >> shift, n], or blocked: [blocks, groups >> shift, S, 16]
  const float* offset;   // as scale (blocked: scale + 16), or null
  const float* bias;     // [n], or null
  int64_t n, blocks, groups;
  int shift;             // 0: a scale per group of 16; 1: per pair of groups
  int64_t block_stride;  // blocked: floats from one group's scales of a block to the next (S * 16); else 0

  const int8_t* group(int64_t block, int64_t g) const { return codes + (block * groups + g) * kBlockBytes; }
  // The scales (offsets) of block `block`'s 16 channels in group g.
  int64_t at(int64_t block, int64_t g) const {
    const int64_t row = g >> shift;
    return block_stride ? (block * ((groups + shift) >> shift) + row) * block_stride : row * n + block * kChannels;
  }
  const float* scales16(int64_t block, int64_t g) const { return scale + at(block, g); }
  const float* offsets16(int64_t block, int64_t g) const { return offset + at(block, g); }
};

// codes and scales checked as the layout above for K columns -> the weight (bias null).
GroupedWeights int8g_weights(const torch::Tensor& codes, const torch::Tensor& scales, int64_t k, const char* name) {
  const int64_t groups = (k + kGroup - 1) / kGroup, pairs = (k + 2 * kGroup - 1) / (2 * kGroup);
  const bool blocked = scales.dim() == 4;
  const int64_t count = blocked ? scales.size(2) : scales.size(0);  // S
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && (count == 1 || count == 2) &&
                  (blocked ? scales.size(3) == kChannels : scales.dim() == 3) &&
                  (scales.size(1) == groups || scales.size(1) == pairs),
              name, ": scales must be fp32 [1 or 2, G', N] or [N / 16, G', 1 or 2, 16], G' = ceil(K / 16) or ",
              "ceil(K / 32), for K = ", k);
  const int shift = scales.size(1) == groups ? 0 : 1;
  const int64_t n = int8g_channels(scales), blocks = (n + kChannels - 1) / kChannels;
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.dim() == 3 && codes.is_contiguous() &&
                  codes.size(0) == blocks && codes.size(1) == groups && codes.size(2) == kBlockBytes,
              name, ": codes must be int8 [ceil(N / 16), ceil(K / 16), 256] for N = ", n, ", K = ", k);
  const float* sp = scales.data_ptr<float>();
  const float* offsets = count == 1 ? nullptr : blocked ? sp + kChannels : sp + scales.size(1) * n;
  return {codes.data_ptr<int8_t>(), sp, offsets, nullptr, n, blocks, groups, shift, blocked ? count * kChannels : 0};
}

// x [M, K] (bf16 or fp32) as fp32 rows [M, G * 16], zero past K, and each group's fp32 sum t [M, G] (with offsets).
struct FloatRows {
  std::vector<float> x, t;
  int64_t kp;
};

template <typename X>
FloatRows float_rows(const X* src, int64_t m, int64_t k, int64_t groups, bool sums) {
  FloatRows rows{std::vector<float>(m * groups * kGroup, 0.f), std::vector<float>(sums ? m * groups : 0),
                 groups * kGroup};
  for (int64_t r = 0; r < m; ++r) {
    float* dst = rows.x.data() + r * rows.kp;
    for (int64_t i = 0; i < k; ++i) {
      if constexpr (std::is_same_v<X, float>) dst[i] = src[r * k + i];
      else dst[i] = cpu_ext::bf16_to_float(src[r * k + i]);
    }
    if (sums)
      for (int64_t g = 0; g < groups; ++g) {
        float t = 0.f;
        for (int64_t i = 0; i < kGroup; ++i) t += dst[g * kGroup + i];
        rows.t[r * groups + g] = t;
      }
  }
  return rows;
}

#if defined(CPU_EXT_INT8G_AVX512)
// 16 results (channels 16 block ..) of one row, bias added, into out's row; channels past N not written.
inline void store16(OutRows out, int64_t row, const GroupedWeights& w, int64_t block, __m512 v) {
  const int64_t n0 = block * kChannels;
  const __mmask16 live = cpu_ext::lanes_below(w.n - n0);
  if (w.bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(live, w.bias + n0));
  const int64_t at = row * w.n + n0;
  if (out.fp32) _mm512_mask_storeu_ps(static_cast<float*>(out.data) + at, live, v);
  else _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out.data) + at, live, cpu_ext::bf16_round(v));
}

// Block `block` for rows [first, first + R) of x: fp32 FMAs on the codes widened in registers. Lanes 2c + j of
// the low vector are channel c's code of k = 2p + j (c < 8), of the high vector channel 8 + c's.
template <int R, bool Offsets>
void block_rows(const GroupedWeights& w, const FloatRows& x, int64_t first, int64_t block, OutRows out) {
  const __m512i lo_lanes = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i hi_lanes = _mm512_add_epi32(lo_lanes, _mm512_set1_epi32(8));
  const int64_t n0 = block * kChannels;
  const __mmask16 live = cpu_ext::lanes_below(w.n - n0);
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < w.groups; ++g) {
    const int8_t* q = w.group(block, g);
    for (int line = 0; line < 4; ++line)  // the stream's next lines, non-temporal: x's rows stay in L1
      _mm_prefetch(reinterpret_cast<const char*>(q) + kAhead + 64 * line, _MM_HINT_NTA);
    __m512 dot[R][2];
    for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int p = 0; p < 8; ++p) {
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + 32 * p))));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + 32 * p + 16))));
      for (int r = 0; r < R; ++r) {
        double pair;  // x[2p], x[2p + 1] of the row, broadcast to every lane pair
        std::memcpy(&pair, x.x.data() + (first + r) * x.kp + g * kGroup + 2 * p, sizeof(pair));
        const __m512 xv = _mm512_castpd_ps(_mm512_set1_pd(pair));
        dot[r][0] = _mm512_fmadd_ps(lo, xv, dot[r][0]);
        dot[r][1] = _mm512_fmadd_ps(hi, xv, dot[r][1]);
      }
    }
    const __m512 s = _mm512_maskz_loadu_ps(live, w.scales16(block, g));
    const __m512 s_lo = _mm512_permutexvar_ps(lo_lanes, s), s_hi = _mm512_permutexvar_ps(hi_lanes, s);
    for (int r = 0; r < R; ++r) {
      acc[r][0] = _mm512_fmadd_ps(s_lo, dot[r][0], acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(s_hi, dot[r][1], acc[r][1]);
    }
    if (Offsets) {  // z t once a channel: in its even lane
      const __m512 z = _mm512_maskz_loadu_ps(live, w.offsets16(block, g));
      const __m512 z_lo = _mm512_maskz_permutexvar_ps(0x5555, lo_lanes, z);
      const __m512 z_hi = _mm512_maskz_permutexvar_ps(0x5555, hi_lanes, z);
      for (int r = 0; r < R; ++r) {
        const __m512 t = _mm512_set1_ps(x.t[(first + r) * w.groups + g]);
        acc[r][0] = _mm512_fmadd_ps(z_lo, t, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(z_hi, t, acc[r][1]);
      }
    }
  }
  const __m512i evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odds = _mm512_add_epi32(evens, _mm512_set1_epi32(1));
  for (int r = 0; r < R; ++r)
    store16(out, first + r, w, block,
            _mm512_add_ps(_mm512_permutex2var_ps(acc[r][0], evens, acc[r][1]),
                          _mm512_permutex2var_ps(acc[r][0], odds, acc[r][1])));
}
#else
// Block `block` for rows [first, first + R): the same sums in scalar code.
template <int R, bool Offsets>
void block_rows(const GroupedWeights& w, const FloatRows& x, int64_t first, int64_t block, OutRows out) {
  for (int64_t c = 0; c < kChannels && block * kChannels + c < w.n; ++c) {
    const int64_t channel = block * kChannels + c;
    for (int r = 0; r < R; ++r) {
      const float* row = x.x.data() + (first + r) * x.kp;
      float total = 0.f;
      for (int64_t g = 0; g < w.groups; ++g) {
        const int8_t* q = w.group(block, g);
        float dot = 0.f;
        for (int64_t i = 0; i < kGroup; ++i)
          dot += static_cast<float>(q[(i / 2) * 32 + 2 * c + i % 2]) * row[g * kGroup + i];
        total = std::fma(w.scales16(block, g)[c], dot, total);
        if (Offsets) total = std::fma(w.offsets16(block, g)[c], x.t[(first + r) * w.groups + g], total);
      }
      out.put((first + r) * w.n + channel, total + (w.bias ? w.bias[channel] : 0.f));
    }
  }
}
#endif

template <bool Offsets>
void block_pass(int64_t rows, const GroupedWeights& w, const FloatRows& x, int64_t first, int64_t block, OutRows out) {
  switch (rows) {
    case 1: block_rows<1, Offsets>(w, x, first, block, out); break;
    case 2: block_rows<2, Offsets>(w, x, first, block, out); break;
    case 3: block_rows<3, Offsets>(w, x, first, block, out); break;
    default: block_rows<kRows, Offsets>(w, x, first, block, out); break;
  }
}

// The threads claim runs of blocks and run every pass of kRows rows over one block before the next, so a block's
// codes come from memory once and from cache for the later passes.
void int8g_product(const GroupedWeights& w, const FloatRows& x, int64_t m, OutRows out) {
  cpu_ext::parallel_claim(w.blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block)
      for (int64_t first = 0; first < m; first += kRows) {
        const int64_t rows = std::min<int64_t>(kRows, m - first);
        if (w.offset) block_pass<true>(rows, w, x, first, block, out);
        else block_pass<false>(rows, w, x, first, block, out);
      }
  });
}

#if defined(CPU_EXT_BF16_DOTS)
// One pair of a group for 16 channels (32 codes at q) -> 16 bf16 pairs, exact.
inline __m512bh widen_pair(const int8_t* q) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)q)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + 16))));
  return _mm512_cvtne2ps_pbh(hi, lo);
}

// Groups [g0, g0 + count) of block `block` -> codes [count, 8 pairs, 16 channels] (bf16 pairs) and scales
// [count, 2, 16]: each pair's 32 codes widened to fp32 and packed to 16 bf16 pairs (both exact); zero past N.
void widen_int8g(const GroupedWeights& w, int64_t block, int64_t g0, int64_t count, uint32_t* codes, float* scales) {
  const int64_t n0 = block * kChannels;
  const __mmask16 live = cpu_ext::lanes_below(w.n - n0);
  // The same groups of the next pair of blocks, into L2 under this pair's products (the bf16 kernel's order).
  const int64_t next = block + cpu_ext::dots::kBlocks < w.blocks ? block + cpu_ext::dots::kBlocks : -1;
  for (int64_t i = 0; i < count; ++i) {
    const int8_t* q = w.group(block, g0 + i);
    if (next >= 0)
      for (int64_t line = 0; line < kBlockBytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(w.group(next, g0 + i)) + line, _MM_HINT_T1);
#pragma GCC unroll 8
    for (int p = 0; p < 8; ++p) _mm512_storeu_si512(codes + (i * 8 + p) * kChannels, (__m512i)widen_pair(q + 32 * p));
    float* dst = scales + i * 2 * kChannels;
    const int64_t g = g0 + i;
    _mm512_storeu_ps(dst, _mm512_maskz_loadu_ps(live, w.scales16(block, g)));
    _mm512_storeu_ps(dst + kChannels,
                     w.offset ? _mm512_maskz_loadu_ps(live, w.offsets16(block, g)) : _mm512_setzero_ps());
  }
}

// Up to kLanes rows in one pass, the codes widened in registers as they are used (no buffer): blocks
// [block, block + C) for rows 0..R-1 of x (PairRows of one pass), their fp32 totals to finish(part, R, block, C).
// D chains a row and block hide the dot products' latency at one or two rows (a group's pairs then added in
// another order: a product of 1-2 rows may differ in its last bits from the same rows among more).
template <int R, int C, bool Offsets, typename Finish>
void direct_blocks(const GroupedWeights& w, const cpu_ext::dots::PairRows& x, int64_t block, const Finish& finish) {
  constexpr int D = R <= 2 ? 2 : 1;
  constexpr int64_t kLanes = cpu_ext::dots::kLanes;
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t g = 0; g < w.groups; ++g) {
    __m512 dot[R][C][D];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c)
        for (int d = 0; d < D; ++d) dot[r][c][d] = _mm512_setzero_ps();
    const uint32_t* xp = x.pass_pairs(0, g);
    for (int c = 0; c < C; ++c)  // the stream's next lines, non-temporal: x's pairs stay in L1
      for (int line = 0; line < 4; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(w.group(block + c, g)) + kAhead + 64 * line, _MM_HINT_NTA);
#pragma GCC unroll 8
    for (int p = 0; p < 8; ++p)
      for (int c = 0; c < C; ++c) {
        const __m512bh q = widen_pair(w.group(block + c, g) + 32 * p);
        for (int r = 0; r < R; ++r)
          dot[r][c][p % D] =
              _mm512_dpbf16_ps(dot[r][c][p % D], (__m512bh)_mm512_set1_epi32(xp[p * kLanes + r]), q);
      }
    const float* sums = x.pass_sums(0, g);
    for (int c = 0; c < C; ++c) {
      const int64_t n0 = (block + c) * kChannels;
      const __mmask16 live = cpu_ext::lanes_below(w.n - n0);
      const __m512 s = _mm512_maskz_loadu_ps(live, w.scales16(block + c, g));
      const __m512 z = Offsets ? _mm512_maskz_loadu_ps(live, w.offsets16(block + c, g)) : _mm512_setzero_ps();
      for (int r = 0; r < R; ++r) {
        const __m512 d = D == 2 ? _mm512_add_ps(dot[r][c][0], dot[r][c][D - 1]) : dot[r][c][0];
        acc[r][c] = _mm512_fmadd_ps(s, d, acc[r][c]);
        if (Offsets) acc[r][c] = _mm512_fmadd_ps(z, _mm512_set1_ps(sums[r]), acc[r][c]);
      }
    }
  }
  alignas(64) float part[R * C * kChannels];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_store_ps(part + (r * C + c) * kChannels, acc[r][c]);
  finish(part, R, block, C);
}

// Blocks a thread claims side by side in direct_blocks' pass of R rows: four at one or two rows, else one
// (bench.lm_head on the EPYC: two blocks at 3-6 rows ran 10-25% slower than one).
constexpr int direct_blocks_for(int rows) { return rows <= 2 ? 4 : 1; }

// The product on bf16 dot products, each block's (or pair of blocks') fp32 totals to finish(part [m, c, 16], m,
// block, c): up to kLanes rows in one pass widened in registers (direct_pass), more through bf16_dots.h's run(),
// each pair's codes widened once a call into a buffer that every pass of kRows rows reads.
template <typename Finish>
void int8g_dots(const torch::Tensor& x, const GroupedWeights& w, const Finish& finish) {
  const int64_t m = x.size(0);
  const bool direct = m <= cpu_ext::dots::kLanes;
  const cpu_ext::dots::PairRows rows = cpu_ext::dots::pair_rows(
      x, w.groups, kGroup, nullptr, direct ? cpu_ext::dots::kLanes : cpu_ext::dots::kRows);
  if (direct) {
    cpu_ext::dots::direct_pass<direct_blocks_for>(m, w.blocks, [&](auto r, auto c, int64_t block) {
      if (w.offset) direct_blocks<decltype(r)::value, decltype(c)::value, true>(w, rows, block, finish);
      else direct_blocks<decltype(r)::value, decltype(c)::value, false>(w, rows, block, finish);
    });
    return;
  }
  const auto widen = [&](int64_t block, int64_t g0, int64_t count, uint32_t* dst, float* group_scales) {
    widen_int8g(w, block, g0, count, dst, group_scales);
  };
  if (w.offset) cpu_ext::dots::run<kGroup / 2, true>(rows, w.n, widen, finish);
  else cpu_ext::dots::run<kGroup / 2, false>(rows, w.n, widen, finish);
}
#endif

}  // namespace

// x [M, K] bf16 or fp32, codes and scales as above, bias [N] (any float dtype) or None -> [M, N] bf16 (fp32 with
// fp32_out).
torch::Tensor linear_int8g(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                           const std::optional<torch::Tensor>& bias, bool fp32_out) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "linear_int8g: x must be bf16 or fp32 [M, K]");
  const int64_t m = x.size(0), k = x.size(1);
  GroupedWeights w = int8g_weights(codes, scales, k, "linear_int8g");
  torch::Tensor out = output_rows(x, m, w.n, fp32_out);
  if (m == 0 || w.n == 0) return out;
  const cpu_ext::FloatBias bf = cpu_ext::float_bias(bias, w.n, "linear_int8g");
  w.bias = bf.data();
  const torch::Tensor xc = x.contiguous();
  const FloatRows rows =
      x.scalar_type() == at::kBFloat16
          ? float_rows(reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()), m, k, w.groups, w.offset)
          : float_rows(xc.data_ptr<float>(), m, k, w.groups, w.offset);
  int8g_product(w, rows, m, out_rows(out));
  return out;
}

// x [M, K] bf16, codes and scales as above, bias [N] or None -> [M, N] bf16 or (fp32_out) fp32: the weight-only
// product on bf16 dot products (elsewhere linear_int8g: tests only).
torch::Tensor linear_int8g_bf16(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                                const std::optional<torch::Tensor>& bias, bool fp32_out) {
#if defined(CPU_EXT_BF16_DOTS)
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "linear_int8g_bf16: x must be bf16 [M, K]");
  const int64_t m = x.size(0), k = x.size(1);
  const GroupedWeights w = int8g_weights(codes, scales, k, "linear_int8g_bf16");
  torch::Tensor out = output_rows(x, m, w.n, fp32_out);
  if (m == 0 || w.n == 0) return out;
  const cpu_ext::FloatBias bf = cpu_ext::float_bias(bias, w.n, "linear_int8g_bf16");
  const float* bp = bf.data();
  const OutRows into = out_rows(out);
  int8g_dots(x, w, [&](const float* part, int64_t rows, int64_t block, int c) {
    cpu_ext::dots::store_blocks(part, rows, c, w.n, bp, into, block);
  });
  return out;
#else
  return linear_int8g(x, codes, scales, bias, fp32_out);
#endif
}

// x [M, K] bf16 (M >= 1), codes and scales as above -> [M] int64: for each row, the first column of the maximum
// (NaN counting as the maximum) of linear_int8g_bf16(x, codes, scales, None, fp32_out=True) (torch's max on those
// fp32 sums), without writing the [M, N] product: the greedy pick straight off the LM head.
torch::Tensor linear_int8g_bf16_argmax(torch::Tensor x, torch::Tensor codes, torch::Tensor scales) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1, "linear_int8g_bf16_argmax: x must have rows");
  torch::Tensor out = torch::empty({x.size(0)}, x.options().dtype(torch::kLong));
#if defined(CPU_EXT_BF16_DOTS)
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "linear_int8g_bf16_argmax: x must be bf16 [M, K]");
  const int64_t m = x.size(0);
  const GroupedWeights w = int8g_weights(codes, scales, x.size(1), "linear_int8g_bf16_argmax");
  std::vector<cpu_ext::RowBest> mine(at::get_num_threads(), cpu_ext::RowBest(m));  // each thread's own
  int8g_dots(x, w, [&](const float* part, int64_t rows, int64_t block, int c) {
    cpu_ext::RowBest& best = mine[at::get_thread_num()];
    for (int64_t r = 0; r < rows; ++r)
      for (int j = 0; j < c; ++j) {
        const int64_t n0 = (block + j) * kChannels;
        cpu_ext::offer_lanes(best, r, _mm512_loadu_ps(part + (r * c + j) * kChannels), n0,
                             cpu_ext::lanes_below(w.n - n0));
      }
  });
  cpu_ext::RowBest best(m);
  for (const cpu_ext::RowBest& one : mine) best.fold(one);
  std::copy(best.column.begin(), best.column.end(), out.data_ptr<int64_t>());
#else
  out.copy_(std::get<1>(at::max(linear_int8g(x, codes, scales, std::nullopt, true), 1)));
#endif
  return out;
}

// Whether linear_int8g_bf16 runs on AVX-512 BF16 here (else on linear_int8g: tests only).
bool int8g_bf16_vectorized() {
#if defined(CPU_EXT_BF16_DOTS)
  return true;
#else
  return false;
#endif
}

// N, the output channels of an int8g weight, from its scales ([S, G', N] or blocked [N / 16, G', S, 16]).
int64_t int8g_channels(const torch::Tensor& scales) {
  return scales.dim() == 4 ? scales.size(0) * kChannels : scales.size(2);
}

// Output channels [begin, end) of the int8g weight of K columns -> bf16 [end - begin, K]: bf16(s q (+ z)), the fp32
// value rounded once, as weight_ops.int8g_rows computes it; with fp32_out that fp32 value (the table's linear32).
torch::Tensor dequantize_int8g(torch::Tensor codes, torch::Tensor scales, int64_t k, int64_t begin, int64_t end,
                               bool fp32_out) {
  const GroupedWeights w = int8g_weights(codes, scales, k, "dequantize_int8g");
  TORCH_CHECK(0 <= begin && begin <= end && end <= w.n, "dequantize_int8g: rows [", begin, ", ", end, ") of ", w.n);
  const int64_t b0 = begin / kChannels, b1 = (end + kChannels - 1) / kChannels, rows = end - begin;
  // [blocks, G, 8 pairs, 16 channels, 2] -> channel rows [blocks * 16, G * 16]
  torch::Tensor q = codes.narrow(0, b0, b1 - b0)
                        .view({b1 - b0, w.groups, kGroup / 2, kChannels, 2})
                        .permute({0, 3, 1, 2, 4})
                        .reshape({(b1 - b0) * kChannels, w.groups * kGroup})
                        .narrow(0, begin - b0 * kChannels, rows);
  torch::Tensor values = q.to(at::kFloat).view({rows, w.groups, kGroup});
  // [S, G', N] (or blocked [N / 16, G', S, 16]) -> the rows' factors per group [S, rows, G]
  const torch::Tensor flat =
      scales.dim() == 4 ? scales.permute({2, 1, 0, 3}).reshape({scales.size(2), scales.size(1), w.n}) : scales;
  torch::Tensor factors = flat.narrow(2, begin, rows).transpose(1, 2);
  if (w.shift) factors = factors.repeat_interleave(2, 2).narrow(2, 0, w.groups);
  values.mul_(factors[0].unsqueeze(2));
  if (w.offset) values.add_(factors[1].unsqueeze(2));
  return values.view({rows, w.groups * kGroup}).narrow(1, 0, k).to(fp32_out ? at::kFloat : at::kBFloat16);
}

TORCH_LIBRARY_FRAGMENT(phase_serve, m) {
  m.def("linear_int8g(Tensor x, Tensor codes, Tensor scales, Tensor? bias, bool fp32_out=False) -> Tensor");
  m.def("dequantize_int8g(Tensor codes, Tensor scales, int k, int begin, int end, bool fp32_out=False) -> Tensor");
  m.def("linear_int8g_bf16(Tensor x, Tensor codes, Tensor scales, Tensor? bias, bool fp32_out=False) -> Tensor");
  m.def("linear_int8g_bf16_argmax(Tensor x, Tensor codes, Tensor scales) -> Tensor");
  m.def("int8g_bf16_vectorized() -> bool", &int8g_bf16_vectorized);
}

TORCH_LIBRARY_IMPL(phase_serve, CPU, m) {
  m.impl("linear_int8g", &linear_int8g);
  m.impl("dequantize_int8g", &dequantize_int8g);
  m.impl("linear_int8g_bf16", &linear_int8g_bf16);
  m.impl("linear_int8g_bf16_argmax", &linear_int8g_bf16_argmax);
}
