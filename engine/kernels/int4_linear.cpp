// Products on int4 weights (engine/model/quant.py, `--weight-dtype int4`): codes 0..15, two per byte, with an
// fp16 scale s and offset z per group of 32 along K, value w = s * q + z.
// - linear_w4a8: decode-sized row counts. The activations are quantised to int8 in groups of 32 (the same groups
//   as the weights', activation_quant.h), the nibbles unpacked in registers and multiplied by AVX-512 VNNI into
//   exact int32 sums per group.
// - linear_int4: decode-sized row counts, weight-only: the nibbles widened to fp32 in registers against the fp32
//   activations (AVX2, FMA and F16C), so the activations keep all their bits; past one pass of rows each group
//   widened once into L1 for every pass.
// - linear_int4_gemm: linear_int4's arithmetic on AVX-512 for any row count: each group of a 16-channel block
//   widened once per pass of up to 8 rows (a 16-float table lookup per nibble position), every value the same.
// - linear_int4_bf16: the weight-only product for many rows on AVX-512 BF16 dot products (bf16_dots.h): the
//   codes, exact in bf16, widened once per call and multiplied by vdpbf16ps against the bf16 activations, 32
//   products an instruction where linear_int4_gemm's fp32 FMAs do 16.
// - dequantize_int4: rows of the weight to bf16 (or fp32), for the larger row counts that take at::linear (prefill).
// Figures: docs/performance.md, "int8 and int4 weights" (python -m bench.weight_quant).
//
// Layout (quant.py pack_int4): packed uint8 [ceil(N / 16), G, 4, 16, 4], G = ceil(K / 32); the 64 bytes of
// [b, g, t] hold 16 output channels x 4 consecutive k: byte [c, j] = q[16 b + c, 32 g + 4 t + j] in its low
// nibble and q[16 b + c, 32 g + 16 + 4 t + j] in its high one. scales fp16 [2, G, N]: s at [0, g, n], z at
// [1, g, n]; or, where N is a multiple of 16 (every projection and vocabulary of a real model), blocked: fp16
// [N / 16, G, 2, 16], s of channel 16 b + c at [b, g, 0, c] and z at [b, g, 1, c], so that a block's scales follow
// its codes group by group. A one-row product streams the blocked layout a fifth faster: each group of [2, G, N]
// is a new line 2N bytes on, a read the memory system serves worse than the codes' own stream. Codes past K and
// channels past N are 0 (and carry no scale: the row loops stop at N).
//
// With a[m, g] and codes x[m, k] the activations' groups, x_sum[m, g] the sum of their codes, t[m, g] the fp32 sum
// of the group's own (unquantised) values, and the weights split about their group's midpoint z + 7.5 s:
//   out[m, n] = bf16(sum_g (a[m, g] * (s[g, n] / 2) * float(2 sum_{k in g} q[n, k] x[m, k] - 15 x_sum[m, g])
//                           + (z[g, n] + 7.5 s[g, n]) * t[m, g]) + bias[n]),
// the integer sums exact, the sum over groups in fp32 in group order (two fused multiply-adds a group); each row's
// result depends on that row only. The activations' rounding error then meets only s (q - 7.5), the weights less
// their group's middle, never more than half the group's range.

// Kept over torch's aten._weight_int4pack_mm_for_cpu on the same codes: 1.23x its decode tok/s at batch 1, 1.15x at
// batch 8 (per-round medians of python -m bench.weight_quant, int4-layers against int4-torch).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "activation_quant.h"
#include "bf16_dots.h"
#include "parallel.h"
#include "vec.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define CPU_EXT_INT4_VNNI 1
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define CPU_EXT_INT4_AVX2 1
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define CPU_EXT_INT4_AVX512 1
#include <immintrin.h>
#endif

// An int4 weight's output channels N, from its scales: fp16 [2, G, N], or blocked [N / 16, G, 2, 16].
int64_t int4_channels(const torch::Tensor& scales) {
  return scales.dim() == 4 ? scales.size(0) * scales.size(3) : scales.size(2);
}

namespace {

using cpu_ext::QuantRows;
using cpu_ext::OutRows;
using cpu_ext::out_rows;
using cpu_ext::output_rows;
using cpu_ext::to_bf16;

constexpr int64_t kGroup = cpu_ext::kActGroup;  // weight and activation values per scale
constexpr int64_t kChannels = 16;               // output channels per packed block (one int32 lane each)
constexpr int64_t kGroupBytes = kGroup * kChannels / 2;
constexpr int kMaxRows = 8;  // rows of x per pass: R accumulator sets stay in registers
constexpr int64_t kAhead = 1024;  // bytes of a block's codes fetched ahead of a one- or two-row product
constexpr int64_t kScalesAhead = 4;  // groups ahead whose scales and offsets a one- or two-row product fetches

struct Int4Weights {
  const uint8_t* packed;
  const at::Half* scales;  // [2, G, N], or blocked [N / 16, G, 2, 16]
  bool blocked;
  const float* bias;  // [N] or null
  int64_t n, groups;

  // The scales of group g's 16 channels from n0 (a multiple of 16), and their offsets.
  const at::Half* scale(int64_t g, int64_t n0) const {
    return blocked ? scales + ((n0 / kChannels) * groups + g) * 2 * kChannels : scales + g * n + n0;
  }
  const at::Half* offset(int64_t g, int64_t n0) const {
    return blocked ? scale(g, n0) + kChannels : scales + (groups + g) * n + n0;
  }
};

// Stores channels [n0, n0 + 16) of R rows from their fp32 sums; channels past n are padding.
template <int R>
void store(const float (&sums)[R][kChannels], const Int4Weights& w, int64_t first, OutRows out, int64_t n0) {
  const int64_t count = std::min<int64_t>(kChannels, w.n - n0);
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < count; ++j)
      out.put((first + r) * w.n + n0 + j, sums[r][j] + (w.bias ? w.bias[n0 + j] : 0.f));
}

// Blocks [block, block + C) of 16 channels for rows [first, first + R): each 64-byte vector gives two of
// unsigned codes (low and high nibbles), each added into its own int32 accumulator by vpdpbusd against a
// broadcast dword of 4 activation codes, so that 2 * C independent chains hide its latency at one row.
template <int R, int C>
void w4a8_blocks(const Int4Weights& w, const QuantRows& q, int64_t first, OutRows out, int64_t block) {
  float sums[C][R][kChannels];
#if defined(CPU_EXT_INT4_VNNI)
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 accf[C][R];
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) accf[c][r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < q.groups; ++g) {
    __m512i lo[C][R], hi[C][R];
    for (int c = 0; c < C; ++c)
      for (int r = 0; r < R; ++r) lo[c][r] = hi[c][r] = _mm512_setzero_si512();
    for (int64_t t = 0; t < 4; ++t) {
      for (int c = 0; c < C; ++c) {
        const __m512i v = _mm512_loadu_si512(w.packed + ((block + c) * w.groups + g) * kGroupBytes + t * 64);
        const __m512i wl = _mm512_and_si512(v, nibble), wh = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
        for (int r = 0; r < R; ++r) {
          const int8_t* codes = q.codes.data() + (first + r) * q.kp + g * kGroup + 4 * t;
          int32_t quad_lo, quad_hi;
          std::memcpy(&quad_lo, codes, 4);
          std::memcpy(&quad_hi, codes + 16, 4);
          lo[c][r] = _mm512_dpbusd_epi32(lo[c][r], wl, _mm512_set1_epi32(quad_lo));
          hi[c][r] = _mm512_dpbusd_epi32(hi[c][r], wh, _mm512_set1_epi32(quad_hi));
        }
      }
    }
    for (int c = 0; c < C; ++c) {
      const int64_t n0 = (block + c) * kChannels;
      const __mmask16 mask = cpu_ext::lanes_below(w.n - n0);
      const __m512 s = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, w.scale(g, n0)));
      const __m512 z = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, w.offset(g, n0)));
      const __m512 half = _mm512_mul_ps(s, _mm512_set1_ps(0.5f)), mid = _mm512_fmadd_ps(s, _mm512_set1_ps(7.5f), z);
      for (int r = 0; r < R; ++r) {
        const int64_t at = (first + r) * q.groups + g;
        const __m512i twice = _mm512_slli_epi32(_mm512_add_epi32(lo[c][r], hi[c][r]), 1);
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(twice, _mm512_set1_epi32(15 * q.sums[at])));
        accf[c][r] = _mm512_fmadd_ps(_mm512_mul_ps(half, dot), _mm512_set1_ps(q.scale[at]), accf[c][r]);
        accf[c][r] = _mm512_fmadd_ps(mid, _mm512_set1_ps(q.totals[at]), accf[c][r]);
      }
    }
  }
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(sums[c][r], accf[c][r]);
#else
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r)
      for (int64_t j = 0; j < kChannels; ++j) {
        const int64_t channel = (block + c) * kChannels + j;
        float total = 0.f;
        for (int64_t g = 0; g < q.groups && channel < w.n; ++g) {
          const uint8_t* bytes = w.packed + ((block + c) * w.groups + g) * kGroupBytes;
          const int8_t* codes = q.codes.data() + (first + r) * q.kp + g * kGroup;
          int32_t dot = 0;
          for (int64_t t = 0; t < 4; ++t)
            for (int64_t i = 0; i < 4; ++i) {
              const uint8_t byte = bytes[t * 64 + j * 4 + i];
              dot += (byte & 0x0F) * codes[4 * t + i] + (byte >> 4) * codes[16 + 4 * t + i];
            }
          const int64_t at = (first + r) * q.groups + g;
          const float s = static_cast<float>(w.scale(g, (block + c) * kChannels)[j]);
          const float z = static_cast<float>(w.offset(g, (block + c) * kChannels)[j]);
          const float centred = static_cast<float>(2 * dot - 15 * q.sums[at]);
          total = std::fma(std::fma(s, 7.5f, z), q.totals[at], std::fma(s * 0.5f * centred, q.scale[at], total));
        }
        sums[c][r][j] = total;
      }
#endif
  for (int c = 0; c < C; ++c) store<R>(sums[c], w, first, out, (block + c) * kChannels);
}

template <int R>
void w4a8_rows(const Int4Weights& w, const QuantRows& q, int64_t first, OutRows out, int64_t begin, int64_t end) {
  constexpr int C = R == 1 ? 4 : R == 2 ? 2 : 1;
  int64_t block = begin;
  for (; block + C <= end; block += C) w4a8_blocks<R, C>(w, q, first, out, block);
  for (; block < end; ++block) w4a8_blocks<R, 1>(w, q, first, out, block);
}

void w4a8_pass(int64_t rows, const Int4Weights& w, const QuantRows& q, int64_t first, OutRows out, int64_t begin,
               int64_t end) {
  switch (rows) {
    case 1: w4a8_rows<1>(w, q, first, out, begin, end); break;
    case 2: w4a8_rows<2>(w, q, first, out, begin, end); break;
    case 3: w4a8_rows<3>(w, q, first, out, begin, end); break;
    case 4: w4a8_rows<4>(w, q, first, out, begin, end); break;
    case 5: w4a8_rows<5>(w, q, first, out, begin, end); break;
    case 6: w4a8_rows<6>(w, q, first, out, begin, end); break;
    case 7: w4a8_rows<7>(w, q, first, out, begin, end); break;
    default: w4a8_rows<8>(w, q, first, out, begin, end); break;
  }
}

// ---- weight-only: fp32 activations against the int4 weights (linear_int4) ------------------------------------
//
// With t[m, g] the fp32 sum of row m's values in group g:
//   out[m, n] = bf16(sum_g (s[g, n] * sum_{k in g} q[n, k] x[m, k] + z[g, n] * t[m, g]) + bias[n]),
// every sum in fp32. The weights s * q + z are exact in fp32; the reference (F.linear on bf16(s * q + z)) rounds
// them to bf16 first, so the two differ by that rounding, this kernel being the closer to the file's values.

constexpr int kWeightOnlyRows = 2;  // rows of x per pass: 2 x 4 accumulator chains of 8 lanes stay in registers

struct FloatRows {
  const float* x;  // [M, G * 32], zero past K
  const float* t;  // [M, G]
  int64_t kp, groups;
};

// The 16 channels of block `block` for rows [first, first + R): each 64-byte slice of a group holds 4 k for 16
// channels (4 bytes a channel), so a 256-bit load is 8 channels' lanes, and shifting each lane by 8 j (+4) and
// masking gives the codes of k = 4 t + j (+16) for those 8 channels, widened once for the R rows.
template <int R>
void int4_block(const Int4Weights& w, const FloatRows& x, int64_t first, OutRows out, int64_t block) {
  float sums[R][kChannels];
  const int64_t n0 = block * kChannels, count = std::min<int64_t>(kChannels, w.n - n0);
#if defined(CPU_EXT_INT4_AVX2)
  const __m256i nibble = _mm256_set1_epi32(0x0F);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < w.groups; ++g) {
    __m256 dot[R][2][2];  // [row][half of the 16 channels][low or high nibble]
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h) dot[r][h][0] = dot[r][h][1] = _mm256_setzero_ps();
    const uint8_t* bytes = w.packed + (block * w.groups + g) * kGroupBytes;
    for (int64_t t = 0; t < 4; ++t) {
      const __m256i v[2] = {_mm256_loadu_si256((const __m256i*)(bytes + t * 64)),
                            _mm256_loadu_si256((const __m256i*)(bytes + t * 64 + 32))};
      for (int j = 0; j < 4; ++j) {
        for (int h = 0; h < 2; ++h) {
          const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v[h], 8 * j), nibble));
          const __m256 hi = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v[h], 8 * j + 4), nibble));
          for (int r = 0; r < R; ++r) {
            const float* xr = x.x + (first + r) * x.kp + g * kGroup + 4 * t + j;
            dot[r][h][0] = _mm256_fmadd_ps(lo, _mm256_set1_ps(xr[0]), dot[r][h][0]);
            dot[r][h][1] = _mm256_fmadd_ps(hi, _mm256_set1_ps(xr[16]), dot[r][h][1]);
          }
        }
      }
    }
    alignas(32) at::Half s[kChannels] = {}, z[kChannels] = {};
    std::memcpy(s, w.scale(g, n0), count * sizeof(at::Half));
    std::memcpy(z, w.offset(g, n0), count * sizeof(at::Half));
    for (int h = 0; h < 2; ++h) {
      const __m256 sv = _mm256_cvtph_ps(_mm_load_si128((const __m128i*)(s + 8 * h)));
      const __m256 zv = _mm256_cvtph_ps(_mm_load_si128((const __m128i*)(z + 8 * h)));
      for (int r = 0; r < R; ++r) {
        acc[r][h] = _mm256_fmadd_ps(sv, _mm256_add_ps(dot[r][h][0], dot[r][h][1]), acc[r][h]);
        acc[r][h] = _mm256_fmadd_ps(zv, _mm256_set1_ps(x.t[(first + r) * x.groups + g]), acc[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(sums[r] + 8 * h, acc[r][h]);
#else
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < count; ++c) {
      float total = 0.f;
      for (int64_t g = 0; g < w.groups; ++g) {
        const uint8_t* bytes = w.packed + (block * w.groups + g) * kGroupBytes + c * 4;
        const float* xr = x.x + (first + r) * x.kp + g * kGroup;
        float lo = 0.f, hi = 0.f;
        for (int64_t t = 0; t < 4; ++t)
          for (int64_t j = 0; j < 4; ++j) {
            lo = std::fma(static_cast<float>(bytes[t * 64 + j] & 0x0F), xr[4 * t + j], lo);
            hi = std::fma(static_cast<float>(bytes[t * 64 + j] >> 4), xr[16 + 4 * t + j], hi);
          }
        total = std::fma(static_cast<float>(w.scale(g, n0)[c]), lo + hi, total);
        total = std::fma(static_cast<float>(w.offset(g, n0)[c]), x.t[(first + r) * x.groups + g], total);
      }
      sums[r][c] = total;
    }
#endif
  store<R>(sums, w, first, out, n0);
}

// Many rows (more than one pass): int4_block's arithmetic, each group's codes widened once for every row instead of
// once a pass. The widened group (2 KB) and the rows' sums (M x 16 floats) stay in L1; a pass reads the codes'
// vectors where int4_block makes them (three ALU ops a vector, which left AVX2's FMAs idle half the time), in
// the same order, so every sum is int4_block's to the bit.
#if defined(CPU_EXT_INT4_AVX2)
// Group g of a block -> wq[t][j][h][nibble][8 lanes]: the codes int4_block's (t, j, h) step widens, as fp32.
inline void widen_group(const uint8_t* bytes, float* wq) {
  const __m256i nibble = _mm256_set1_epi32(0x0F);
  for (int64_t t = 0; t < 4; ++t) {
    const __m256i v[2] = {_mm256_loadu_si256((const __m256i*)(bytes + t * 64)),
                          _mm256_loadu_si256((const __m256i*)(bytes + t * 64 + 32))};
    for (int j = 0; j < 4; ++j)
      for (int h = 0; h < 2; ++h) {
        float* dst = wq + ((t * 4 + j) * 2 + h) * 16;
        _mm256_store_ps(dst, _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v[h], 8 * j), nibble)));
        _mm256_store_ps(dst + 8, _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v[h], 8 * j + 4), nibble)));
      }
  }
}

// Group g's contribution to rows [first, first + R): acc[r] (16 floats a row) += s * (lo + hi) + z * t[r, g].
template <int R>
void widened_group_rows(const float* wq, const FloatRows& x, int64_t first, int64_t g, const __m256 (&sv)[2],
                        const __m256 (&zv)[2], float* acc) {
  __m256 dot[R][2][2];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) dot[r][h][0] = dot[r][h][1] = _mm256_setzero_ps();
  for (int64_t t = 0; t < 4; ++t)
    for (int j = 0; j < 4; ++j)
      for (int h = 0; h < 2; ++h) {
        const float* codes = wq + ((t * 4 + j) * 2 + h) * 16;
        const __m256 lo = _mm256_load_ps(codes), hi = _mm256_load_ps(codes + 8);
        for (int r = 0; r < R; ++r) {
          const float* xr = x.x + (first + r) * x.kp + g * kGroup + 4 * t + j;
          dot[r][h][0] = _mm256_fmadd_ps(lo, _mm256_set1_ps(xr[0]), dot[r][h][0]);
          dot[r][h][1] = _mm256_fmadd_ps(hi, _mm256_set1_ps(xr[16]), dot[r][h][1]);
        }
      }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) {
      float* a = acc + r * kChannels + 8 * h;
      __m256 sum = _mm256_fmadd_ps(sv[h], _mm256_add_ps(dot[r][h][0], dot[r][h][1]), _mm256_loadu_ps(a));
      sum = _mm256_fmadd_ps(zv[h], _mm256_set1_ps(x.t[(first + r) * x.groups + g]), sum);
      _mm256_storeu_ps(a, sum);
    }
}
#endif

// Every row of x against block `block`, its groups widened once (acc: M x 16 floats of scratch).
void int4_block_widened(const Int4Weights& w, const FloatRows& x, int64_t m, OutRows out, int64_t block,
                        float* acc) {
#if defined(CPU_EXT_INT4_AVX2)
  const int64_t n0 = block * kChannels, count = std::min<int64_t>(kChannels, w.n - n0);
  alignas(32) float wq[4 * 4 * 2 * 16];
  std::fill(acc, acc + m * kChannels, 0.f);
  for (int64_t g = 0; g < w.groups; ++g) {
    widen_group(w.packed + (block * w.groups + g) * kGroupBytes, wq);
    alignas(32) at::Half s[kChannels] = {}, z[kChannels] = {};
    std::memcpy(s, w.scale(g, n0), count * sizeof(at::Half));
    std::memcpy(z, w.offset(g, n0), count * sizeof(at::Half));
    const __m256 sv[2] = {_mm256_cvtph_ps(_mm_load_si128((const __m128i*)s)),
                          _mm256_cvtph_ps(_mm_load_si128((const __m128i*)(s + 8)))};
    const __m256 zv[2] = {_mm256_cvtph_ps(_mm_load_si128((const __m128i*)z)),
                          _mm256_cvtph_ps(_mm_load_si128((const __m128i*)(z + 8)))};
    int64_t first = 0;
    for (; first + kWeightOnlyRows <= m; first += kWeightOnlyRows)
      widened_group_rows<kWeightOnlyRows>(wq, x, first, g, sv, zv, acc + first * kChannels);
    if (first < m) widened_group_rows<1>(wq, x, first, g, sv, zv, acc + first * kChannels);
  }
  for (int64_t r = 0; r < m; ++r)
    store<1>(*reinterpret_cast<const float(*)[1][kChannels]>(acc + r * kChannels), w, r, out, n0);
#else
  (void)acc;
  for (int64_t r = 0; r < m; ++r) int4_block<1>(w, x, r, out, block);
#endif
}

// x [M, K] (bf16 or fp32) as linear_int4's kernels read it: fp32 rows padded with zeros to G * 32, and each
// group's sum added in k order (the totals both kernels use, so that they agree to the bit).
struct FloatCopy {
  std::vector<float> x, t;
  FloatRows rows;
};

FloatCopy float_copy(const torch::Tensor& x, int64_t groups) {
  const int64_t m = x.size(0), k = x.size(1), kp = groups * kGroup;
  const torch::Tensor xc = x.contiguous();
  const bool fp32 = xc.scalar_type() == at::kFloat;
  const void* src = xc.data_ptr();
  FloatCopy copy{std::vector<float>(m * kp, 0.f), std::vector<float>(m * groups, 0.f), {}};
  for (int64_t r = 0; r < m; ++r) {
    float* dst = copy.x.data() + r * kp;
    if (fp32) std::memcpy(dst, static_cast<const float*>(src) + r * k, k * sizeof(float));
    else
      for (int64_t i = 0; i < k; ++i) dst[i] = static_cast<float>(static_cast<const at::BFloat16*>(src)[r * k + i]);
    for (int64_t g = 0; g < groups; ++g) {
      float total = 0.f;
      for (int64_t i = 0; i < kGroup; ++i) total += dst[g * kGroup + i];
      copy.t[r * groups + g] = total;
    }
  }
  copy.rows = FloatRows{copy.x.data(), copy.t.data(), kp, groups};
  return copy;
}

// ---- linear_int4_gemm: the weight-only product on AVX-512, a group widened once for up to 8 rows ---------------
//
// A 64-byte slice t of a group holds 4 k of 16 channels, one dword lane a channel: shifting each lane by 8 j (+4)
// leaves the code of k = 4 t + j (+16) in its low 4 bits, which vpermps reads as an index into the table of the
// floats 0..15: two ops a widened vector. Each row's two chains (low and high nibbles) run in linear_int4's order,
// so every sum is the same; at one or two rows, C blocks side by side give the FMA units independent chains.

#if defined(CPU_EXT_INT4_AVX512)
// Group g's scales and offsets of the 16 channels from n0, as fp32 (zero past channel N).
inline void group_scales(const Int4Weights& w, int64_t g, int64_t n0, __m512& s, __m512& z) {
  const __mmask16 mask = cpu_ext::lanes_below(w.n - n0);
  s = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, w.scale(g, n0)));
  z = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, w.offset(g, n0)));
}
#endif

constexpr int kGemmRows = 8;  // rows of x per pass: 2 chains and an accumulator a row stay in registers

template <int R, int C>
void gemm_blocks(const Int4Weights& w, const FloatRows& x, int64_t first, OutRows out, int64_t block) {
#if defined(CPU_EXT_INT4_AVX512)
  float sums[C][R][kChannels];
  const __m512 table = _mm512_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, 8.f, 9.f, 10.f, 11.f, 12.f, 13.f,
                                      14.f, 15.f);
  __m512 acc[C][R];
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) acc[c][r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < w.groups; ++g) {
    __m512 lo[C][R], hi[C][R];
    for (int c = 0; c < C; ++c)
      for (int r = 0; r < R; ++r) lo[c][r] = hi[c][r] = _mm512_setzero_ps();
    const float* xg = x.x + first * x.kp + g * kGroup;
    for (int64_t t = 0; t < 4; ++t) {
      __m512i v[C];
      for (int c = 0; c < C; ++c) v[c] = _mm512_loadu_si512(w.packed + ((block + c) * w.groups + g) * kGroupBytes + t * 64);
      for (int j = 0; j < 4; ++j) {
        for (int c = 0; c < C; ++c) {
          const __m512 wl = _mm512_permutexvar_ps(j == 0 ? v[c] : _mm512_srli_epi32(v[c], 8 * j), table);
          const __m512 wh = _mm512_permutexvar_ps(_mm512_srli_epi32(v[c], 8 * j + 4), table);
          for (int r = 0; r < R; ++r) {
            const float* xr = xg + r * x.kp + 4 * t + j;
            lo[c][r] = _mm512_fmadd_ps(wl, _mm512_set1_ps(xr[0]), lo[c][r]);
            hi[c][r] = _mm512_fmadd_ps(wh, _mm512_set1_ps(xr[16]), hi[c][r]);
          }
        }
      }
    }
    for (int c = 0; c < C; ++c) {
      __m512 s, z;
      group_scales(w, g, (block + c) * kChannels, s, z);
      for (int r = 0; r < R; ++r) {
        acc[c][r] = _mm512_fmadd_ps(s, _mm512_add_ps(lo[c][r], hi[c][r]), acc[c][r]);
        acc[c][r] = _mm512_fmadd_ps(z, _mm512_set1_ps(x.t[(first + r) * x.groups + g]), acc[c][r]);
      }
    }
  }
  for (int c = 0; c < C; ++c) {
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(sums[c][r], acc[c][r]);
    store<R>(sums[c], w, first, out, (block + c) * kChannels);
  }
#else
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) int4_block<1>(w, x, first + r, out, block + c);
#endif
}

template <int R>
void gemm_rows(const Int4Weights& w, const FloatRows& x, int64_t first, OutRows out, int64_t begin, int64_t end) {
  constexpr int C = R == 1 ? 4 : R == 2 ? 2 : 1;
  int64_t block = begin;
  for (; block + C <= end; block += C) gemm_blocks<R, C>(w, x, first, out, block);
  for (; block < end; ++block) gemm_blocks<R, 1>(w, x, first, out, block);
}

void gemm_pass(int64_t rows, const Int4Weights& w, const FloatRows& x, int64_t first, OutRows out, int64_t begin,
               int64_t end) {
  switch (rows) {
    case 1: gemm_rows<1>(w, x, first, out, begin, end); break;
    case 2: gemm_rows<2>(w, x, first, out, begin, end); break;
    case 3: gemm_rows<3>(w, x, first, out, begin, end); break;
    case 4: gemm_rows<4>(w, x, first, out, begin, end); break;
    case 5: gemm_rows<5>(w, x, first, out, begin, end); break;
    case 6: gemm_rows<6>(w, x, first, out, begin, end); break;
    case 7: gemm_rows<7>(w, x, first, out, begin, end); break;
    default: gemm_rows<8>(w, x, first, out, begin, end); break;
  }
}

// ---- linear_int4_bf16: the weight-only product on bf16 dot products (bf16_dots.h) --------------------------
//
// Widening: vpermw looks each 16-bit lane's low 5 bits up in a table of bf16(0..15) (twice over, so bit 4 is
// ignored). A slice's dword lane holds bytes b0..b3 of one channel (k = 4t + j low nibbles, 16 + 4t + j high), so
// the words of v >> {0, 8, 4, 12} hold the codes of k = (4t, 4t + 2), (4t + 1, 4t + 3), (16 + 4t, 16 + 4t + 2),
// (16 + 4t + 1, 16 + 4t + 3): four vectors of pairs for 3 shifts and 4 lookups. kPairOrder is that order.
#if defined(CPU_EXT_BF16_DOTS)
constexpr int kPairOrder[kGroup] = {0, 2, 1, 3, 16, 18, 17, 19, 4, 6, 5, 7, 20, 22, 21, 23,
                                    8, 10, 9, 11, 24, 26, 25, 27, 12, 14, 13, 15, 28, 30, 29, 31};

// Groups [g0, g0 + count) of block `block` -> codes [count, 16 pairs, 16 channels] and scales [count, 2, 16].
// bf16(0..15) at word i and i + 16: vpermw reads a lane's low 5 bits.
inline __m512i code_table() {
  return _mm512_set_epi16(0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40E0, 0x40C0, 0x40A0,
                          0x4080, 0x4040, 0x4000, 0x3F80, 0x0000, 0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120,
                          0x4110, 0x4100, 0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000);
}

void widen_int4(const Int4Weights& w, int64_t block, int64_t g0, int64_t count, uint32_t* codes, float* scales) {
  const __m512i table = code_table();
  const int64_t n0 = block * kChannels, blocks = (w.n + kChannels - 1) / kChannels;
  // The same groups of the next pair of blocks, into L2 under this pair's products (the bf16 kernel's order).
  const int64_t next = block + cpu_ext::dots::kBlocks < blocks ? block + cpu_ext::dots::kBlocks : -1;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t g = g0 + i;
    const uint8_t* bytes = w.packed + (block * w.groups + g) * kGroupBytes;
    if (next >= 0)
      for (int64_t line = 0; line < kGroupBytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(w.packed + (next * w.groups + g) * kGroupBytes + line), _MM_HINT_T1);
    for (int64_t t = 0; t < 4; ++t) {
      const __m512i v = _mm512_loadu_si512(bytes + t * 64);
      uint32_t* dst = codes + (i * kGroup / 2 + 4 * t) * kChannels;
      _mm512_storeu_si512(dst, _mm512_permutexvar_epi16(v, table));
      _mm512_storeu_si512(dst + kChannels, _mm512_permutexvar_epi16(_mm512_srli_epi32(v, 8), table));
      _mm512_storeu_si512(dst + 2 * kChannels, _mm512_permutexvar_epi16(_mm512_srli_epi32(v, 4), table));
      _mm512_storeu_si512(dst + 3 * kChannels, _mm512_permutexvar_epi16(_mm512_srli_epi32(v, 12), table));
    }
    __m512 s, z;
    group_scales(w, g, n0, s, z);
    _mm512_storeu_ps(scales + i * 32, s);
    _mm512_storeu_ps(scales + i * 32 + 16, z);
  }
}

// Up to kLanes rows (one pass of PairRows): the codes widened in registers and used at once, without the buffer:
// a 64-byte slice costs 3 shifts, 4 lookups and 4 R dot products (int4_gemm: 7 shifts, 8 lookups and 8 R FMAs).
// At one or two rows the products wait on memory, not on their arithmetic (in cache they run twice as fast), so
// each block's codes are fetched kAhead bytes ahead, non-temporal (the stream then leaves the activations' pairs in
// L1), and [2, G, N] scales kScalesAhead groups ahead (blocked ones follow the codes' stream): 4-5% more GB/s
// (docs/performance.md, "int8g: x kept in L1"). D chains a row and block hide the dot products' latency: two at
// one or two rows (a third faster than one chain at one row), which adds a group's pairs in another order, so a
// product of 1-2 rows may differ in its last bits from the same rows among 3 or more (one chain, the buffered
// passes' order: those agree to the bit).
template <int R, int C>
void direct_blocks(const Int4Weights& w, const cpu_ext::dots::PairRows& x, const float* bias, OutRows out,
                   int64_t block) {
  constexpr int D = R <= 2 ? 2 : 1;
  constexpr int64_t kLanes = cpu_ext::dots::kLanes;
  const __m512i table = code_table();
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t g = 0; g < w.groups; ++g) {
    if (R <= 2 && !w.blocked && g + kScalesAhead < w.groups) {  // [2, G, N]: each group's, a new line 2N bytes on
      for (int64_t half = 0; half < C * kChannels; half += 32) {  // 32 fp16 a line
        _mm_prefetch(reinterpret_cast<const char*>(w.scale(g + kScalesAhead, block * kChannels + half)), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(w.offset(g + kScalesAhead, block * kChannels + half)), _MM_HINT_T0);
      }
    }
    __m512 dot[R][C][D];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c)
        for (int d = 0; d < D; ++d) dot[r][c][d] = _mm512_setzero_ps();
    const uint32_t* xp = x.pass_pairs(0, g);
    for (int t = 0; t < 4; ++t)
      for (int c = 0; c < C; ++c) {
        const uint8_t* slice = w.packed + ((block + c) * w.groups + g) * kGroupBytes + t * 64;
        if (R <= 2) _mm_prefetch(reinterpret_cast<const char*>(slice) + kAhead, _MM_HINT_NTA);
        const __m512i v = _mm512_loadu_si512(slice);
        const __m512bh q[4] = {(__m512bh)_mm512_permutexvar_epi16(v, table),
                               (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi32(v, 8), table),
                               (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi32(v, 4), table),
                               (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi32(v, 12), table)};
        for (int j = 0; j < 4; ++j)
          for (int r = 0; r < R; ++r)
            dot[r][c][j % D] = _mm512_dpbf16_ps(dot[r][c][j % D],
                                                (__m512bh)_mm512_set1_epi32(xp[(4 * t + j) * kLanes + r]), q[j]);
      }
    const float* sums = x.pass_sums(0, g);
    for (int c = 0; c < C; ++c) {
      __m512 s, z;
      group_scales(w, g, (block + c) * kChannels, s, z);
      for (int r = 0; r < R; ++r) {
        const __m512 d = D == 2 ? _mm512_add_ps(dot[r][c][0], dot[r][c][D - 1]) : dot[r][c][0];
        acc[r][c] = _mm512_fmadd_ps(s, d, acc[r][c]);
        acc[r][c] = _mm512_fmadd_ps(z, _mm512_set1_ps(sums[r]), acc[r][c]);
      }
    }
  }
  alignas(64) float part[R * C * kChannels];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_store_ps(part + (r * C + c) * kChannels, acc[r][c]);
  cpu_ext::dots::store_rows<C>(part, R, w.n, bias, out, block);
}

// Blocks a thread claims side by side in direct_blocks' pass of R rows: one at 7-8 rows, whose 2 x 8 accumulators
// fill the registers.
constexpr int direct_blocks_for(int rows) { return rows <= 2 ? 4 : rows <= cpu_ext::dots::kRows ? 2 : 1; }

#endif

// Checks an int4 weight of K columns and gives its Int4Weights (bias: fp32 [N] or null).
Int4Weights int4_weights(const torch::Tensor& packed, const torch::Tensor& scales, int64_t k, const float* bias,
                         const char* name) {
  const bool blocked = scales.dim() == 4;
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
                  (blocked ? scales.size(2) == 2 && scales.size(3) == kChannels
                           : scales.dim() == 3 && scales.size(0) == 2),
              name, ": scales must be fp16 [2, G, N] or blocked [N / 16, G, 2, 16]");
  const int64_t n = int4_channels(scales), groups = (k + kGroup - 1) / kGroup;
  TORCH_CHECK(scales.size(1) == groups, name, ": scales have ", scales.size(1), " groups, K = ", k, " needs ", groups);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 5 &&
                  packed.size(0) == (n + kChannels - 1) / kChannels && packed.size(1) == groups &&
                  packed.size(2) == 4 && packed.size(3) == kChannels && packed.size(4) == 4,
              name, ": packed must be pack_int4's uint8 [ceil(N / 16), ceil(K / 32), 4, 16, 4] for N = ", n,
              ", K = ", k);
  return Int4Weights{packed.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(), blocked, bias, n, groups};
}

}  // namespace

// x [M, K] bf16, packed and scales as above, bias [N] (any float dtype) or None -> [M, N] bf16 (fp32 with
// fp32_out). x is quantised
// once, before the threads, which claim ranges of 16-channel blocks and run every pass of 8 rows of x over their
// range, so a range's weights come from memory once and from cache for the later passes.
torch::Tensor linear_w4a8(torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                          const std::optional<torch::Tensor>& bias, bool fp32_out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "linear_w4a8: x must be bf16 [M, K]");
  const int64_t m = x.size(0), k = x.size(1);
  Int4Weights w = int4_weights(packed, scales, k, nullptr, "linear_w4a8");
  const int64_t n = w.n;
  torch::Tensor out = output_rows(x, m, n, fp32_out);
  if (m == 0 || n == 0) return out;
  torch::Tensor xf = x.to(torch::kFloat32).contiguous();
  const QuantRows q = cpu_ext::quantize_activations(xf.data_ptr<float>(), m, k);
  const cpu_ext::FloatBias bf = cpu_ext::float_bias(bias, n, "linear_w4a8");
  w.bias = bf.data();
  const OutRows op = out_rows(out);
  cpu_ext::parallel_claim((n + kChannels - 1) / kChannels, 4, [&](int64_t begin, int64_t end) {
    for (int64_t first = 0; first < m; first += kMaxRows)
      w4a8_pass(std::min<int64_t>(kMaxRows, m - first), w, q, first, op, begin, end);
  });
  return out;
}

// x [M, K] bf16 (or fp32), packed and scales as above, bias [N] or None -> [M, N] bf16 or (fp32_out) fp32 (the
// weight-only product above). The threads claim ranges of 16-channel blocks and run every pass of rows over each
// block in turn, so a block's weights come from memory once.
torch::Tensor linear_int4(torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                          const std::optional<torch::Tensor>& bias, bool fp32_out) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "linear_int4: x must be bf16 or fp32 [M, K]");
  const int64_t m = x.size(0), k = x.size(1);
  Int4Weights w = int4_weights(packed, scales, k, nullptr, "linear_int4");
  const int64_t n = w.n, groups = w.groups;
  torch::Tensor out = output_rows(x, m, n, fp32_out);
  if (m == 0 || n == 0) return out;
  const FloatCopy copy = float_copy(x, groups);
  const cpu_ext::FloatBias bf = cpu_ext::float_bias(bias, n, "linear_int4");
  w.bias = bf.data();
  const FloatRows& rows = copy.rows;
  const OutRows op = out_rows(out);
  cpu_ext::parallel_claim((n + kChannels - 1) / kChannels, 4, [&](int64_t begin, int64_t end) {
    if (m > kWeightOnlyRows) {  // more than one pass: each group widened once for all of them
      std::vector<float> acc(m * kChannels);
      for (int64_t block = begin; block < end; ++block) int4_block_widened(w, rows, m, op, block, acc.data());
      return;
    }
    for (int64_t block = begin; block < end; ++block)
      for (int64_t first = 0; first < m; first += kWeightOnlyRows) {
        if (m - first >= 2) int4_block<2>(w, rows, first, op, block);
        else int4_block<1>(w, rows, first, op, block);
      }
  });
  return out;
}

// linear_int4's arguments and result, to the bit, on AVX-512 (elsewhere on linear_int4's loops: tests only). The
// threads claim ranges of 16-channel blocks; each range runs in slices of kGemmSlice blocks, every pass of rows
// over one slice before the next, so a slice's weights come from memory once and stay in L1 for the passes.
constexpr int64_t kGemmSlice = 4;

torch::Tensor linear_int4_gemm(torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                               const std::optional<torch::Tensor>& bias, bool fp32_out) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "linear_int4_gemm: x must be bf16 or fp32 [M, K]");
  const int64_t m = x.size(0), k = x.size(1);
  Int4Weights w = int4_weights(packed, scales, k, nullptr, "linear_int4_gemm");
  const int64_t n = w.n, groups = w.groups;
  torch::Tensor out = output_rows(x, m, n, fp32_out);
  if (m == 0 || n == 0) return out;
  const FloatCopy copy = float_copy(x, groups);
  const cpu_ext::FloatBias bf = cpu_ext::float_bias(bias, n, "linear_int4_gemm");
  w.bias = bf.data();
  const OutRows op = out_rows(out);
  cpu_ext::parallel_claim((n + kChannels - 1) / kChannels, kGemmSlice, [&](int64_t begin, int64_t end) {
    for (int64_t slice = begin; slice < end; slice += kGemmSlice) {
      const int64_t last = std::min(end, slice + kGemmSlice);
      for (int64_t first = 0; first < m; first += kGemmRows)
        gemm_pass(std::min<int64_t>(kGemmRows, m - first), w, copy.rows, first, op, slice, last);
    }
  });
  return out;
}

// x [M, K] bf16, packed and scales as above, bias [N] or None -> [M, N] bf16 or (fp32_out) fp32: the weight-only
// product on bf16 dot products (elsewhere linear_int4_gemm: tests only). The threads claim pairs of 16-channel
// blocks and run every row over a pair before the next, so each weight is widened once a call.
torch::Tensor linear_int4_bf16(torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                               const std::optional<torch::Tensor>& bias, bool fp32_out) {
#if defined(CPU_EXT_BF16_DOTS)
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "linear_int4_bf16: x must be bf16 [M, K]");
  const int64_t m = x.size(0), k = x.size(1);
  const Int4Weights w = int4_weights(packed, scales, k, nullptr, "linear_int4_bf16");
  const int64_t n = w.n, groups = w.groups;
  torch::Tensor out = output_rows(x, m, n, fp32_out);
  if (m == 0 || n == 0) return out;
  const cpu_ext::FloatBias bf = cpu_ext::float_bias(bias, n, "linear_int4_bf16");
  const bool direct = m <= cpu_ext::dots::kLanes;  // one pass, the codes widened in registers
  const cpu_ext::dots::PairRows rows =
      cpu_ext::dots::pair_rows(x, groups, kGroup, kPairOrder, direct ? cpu_ext::dots::kLanes : cpu_ext::dots::kRows);
  const auto widen = [&](int64_t block, int64_t g0, int64_t count, uint32_t* codes, float* group_scales) {
    widen_int4(w, block, g0, count, codes, group_scales);
  };
  const float* bp = bf.data();
  const OutRows into = out_rows(out);
  const int64_t blocks = (n + kChannels - 1) / kChannels;
  if (direct)
    cpu_ext::dots::direct_pass<direct_blocks_for>(m, blocks, [&](auto r, auto c, int64_t block) {
      direct_blocks<decltype(r)::value, decltype(c)::value>(w, rows, bp, into, block);
    });
  else cpu_ext::dots::run<kGroup / 2, true>(rows, n, bp, into, widen);
  return out;
#else
  return linear_int4_gemm(x, packed, scales, bias, fp32_out);
#endif
}

#if defined(CPU_EXT_INT4_AVX512)
// One whole group of a row: its 16 bytes (4 runs of 4, 64 bytes apart) -> 32 bf16 (or fp32), low nibbles first.
template <typename Out>
inline void dequantize_group(const uint8_t* bytes, float s, float z, Out* dst) {
  int32_t runs[4];
  for (int t = 0; t < 4; ++t) std::memcpy(&runs[t], bytes + t * 64, 4);
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(runs));
  const __m128i low = _mm_and_si128(packed, _mm_set1_epi8(0x0F));
  const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), _mm_set1_epi8(0x0F));
  const __m512 scale = _mm512_set1_ps(s), zero = _mm512_set1_ps(z);
  const __m512 lo = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(low)), zero);  // s * q exact
  const __m512 hi = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(high)), zero);
  if constexpr (std::is_same_v<Out, float>) {
    _mm512_storeu_ps(dst, lo);
    _mm512_storeu_ps(dst + 16, hi);
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), cpu_ext::bf16_round(lo));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16), cpu_ext::bf16_round(hi));
  }
}
#endif

// dequantize_int4's rows into `op` (Out: uint16_t for bf16 bits, or float): s * q + z rounded once in fp32, then
// for bf16 once more.
template <typename Out>
void dequantize_int4_rows(const Int4Weights& w, const uint8_t* pp, int64_t k, int64_t begin, int64_t end, Out* op) {
  const int64_t groups = w.groups;
  at::parallel_for(begin, end, 16, [&](int64_t first, int64_t last) {
    for (int64_t row = first; row < last; ++row) {
      const int64_t block = row / kChannels, c = row % kChannels;
      Out* dst = op + (row - begin) * k;
      for (int64_t g = 0; g < groups; ++g) {
        const float s = static_cast<float>(w.scale(g, block * kChannels)[c]);
        const float z = static_cast<float>(w.offset(g, block * kChannels)[c]);
        const uint8_t* bytes = pp + (block * groups + g) * kGroupBytes + c * 4;
#if defined(CPU_EXT_INT4_AVX512)
        if ((g + 1) * kGroup <= k) {
          dequantize_group(bytes, s, z, dst + g * kGroup);
          continue;
        }
#endif
        for (int64_t t = 0; t < 4; ++t)
          for (int64_t i = 0; i < 4; ++i) {
            const uint8_t byte = bytes[t * 64 + i];
            const int64_t lo = g * kGroup + 4 * t + i, hi = lo + 16;
            const float low = s * static_cast<float>(byte & 0x0F) + z, high = s * static_cast<float>(byte >> 4) + z;
            if constexpr (std::is_same_v<Out, float>) {
              if (lo < k) dst[lo] = low;
              if (hi < k) dst[hi] = high;
            } else {
              if (lo < k) dst[lo] = to_bf16(low);
              if (hi < k) dst[hi] = to_bf16(high);
            }
          }
      }
    }
  });
}

// Output channels [begin, end) of the int4 weight of K columns -> bf16 [end - begin, K]: bf16(s * q + z) (s * q
// is exact in fp32, so the one rounding of the sum and the one to bf16 are torch's quant.dequantize_int4's too), or
// with fp32_out the fp32 sum itself (quant.int4_rows' fp32 bits: the table's linear32). Whole groups run on AVX-512
// where built: every prefill step of more rows than the int4 kernels take dequantises each weight once (python -m
// bench.stall_free: a fifth of a 256-token step on the scalar loop).
torch::Tensor dequantize_int4(torch::Tensor packed, torch::Tensor scales, int64_t k, int64_t begin, int64_t end,
                              bool fp32_out) {
  const Int4Weights w = int4_weights(packed, scales, k, nullptr, "dequantize_int4");
  TORCH_CHECK(0 <= begin && begin <= end && end <= w.n, "dequantize_int4: rows [", begin, ", ", end, ") of ", w.n);
  torch::Tensor out = torch::empty({end - begin, k}, packed.options().dtype(fp32_out ? at::kFloat : at::kBFloat16));
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  if (fp32_out)
    dequantize_int4_rows(w, pp, k, begin, end, out.data_ptr<float>());
  else
    dequantize_int4_rows(w, pp, k, begin, end, reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
  return out;
}

// Whether linear_int4 runs on AVX2 vectors here (else on its scalar loop, which only tests should take).
bool int4_vectorized() {
#if defined(CPU_EXT_INT4_AVX2)
  return true;
#else
  return false;
#endif
}

// Whether linear_int4_gemm runs on AVX-512 here (else on linear_int4's loops, which only tests should take).
bool int4_gemm_vectorized() {
#if defined(CPU_EXT_INT4_AVX512)
  return true;
#else
  return false;
#endif
}

// Whether linear_int4_bf16 runs on AVX-512 BF16 here (else on linear_int4_gemm: tests only).
bool int4_bf16_vectorized() {
#if defined(CPU_EXT_BF16_DOTS)
  return true;
#else
  return false;
#endif
}

// Whether linear_w4a8 runs on VNNI here (else on its scalar loop, which only tests should take).
bool w4a8_vnni() {
#if defined(CPU_EXT_INT4_VNNI)
  return true;
#else
  return false;
#endif
}

TORCH_LIBRARY_FRAGMENT(phase_serve, m) {
  m.def("linear_w4a8(Tensor x, Tensor packed, Tensor scales, Tensor? bias, bool fp32_out=False) -> Tensor");
  m.def("linear_int4(Tensor x, Tensor packed, Tensor scales, Tensor? bias, bool fp32_out=False) -> Tensor");
  m.def("linear_int4_gemm(Tensor x, Tensor packed, Tensor scales, Tensor? bias, bool fp32_out=False) -> Tensor");
  m.def("int4_gemm_vectorized() -> bool", &int4_gemm_vectorized);
  m.def("linear_int4_bf16(Tensor x, Tensor packed, Tensor scales, Tensor? bias, bool fp32_out=False) -> Tensor");
  m.def("int4_bf16_vectorized() -> bool", &int4_bf16_vectorized);
  m.def("dequantize_int4(Tensor packed, Tensor scales, int k, int begin, int end, bool fp32_out=False) -> Tensor");
  m.def("w4a8_vnni() -> bool", &w4a8_vnni);
  m.def("int4_vectorized() -> bool", &int4_vectorized);
}

TORCH_LIBRARY_IMPL(phase_serve, CPU, m) {
  m.impl("linear_w4a8", &linear_w4a8);
  m.impl("linear_int4", &linear_int4);
  m.impl("linear_int4_gemm", &linear_int4_gemm);
  m.impl("linear_int4_bf16", &linear_int4_bf16);
  m.impl("dequantize_int4", &dequantize_int4);
}
