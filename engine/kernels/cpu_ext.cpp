// CPU kernels for bf16 decoding, run on torch's own thread pool (at::parallel_for), so they never fight a
// second OpenMP runtime for the cores. Built on first use by engine/kernels/cpu_ext.py (torch's
// cpp_extension, -O3 -march=native); see that file for when each kernel is used. Figures: docs/performance.md
// (python -m bench.cpu_kernels).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

#include "parallel.h"
#include "vec.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define CPU_EXT_AVX512 1
#include <immintrin.h>
#endif

namespace {

using cpu_ext::bf16_to_float;

// Round to nearest even, as torch converts float to bfloat16; NaN stays NaN.
inline uint16_t float_to_bf16(float value) {
  if (std::isnan(value)) return 0x7FC0;
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

// value rounded to bf16 precision, kept in fp32: what a torch bf16 op stores, for the next op to read.
inline float round_bf16(float value) { return bf16_to_float(float_to_bf16(value)); }

#if defined(CPU_EXT_AVX512)
using cpu_ext::load_bf16x16;

// float_to_bf16 on 16 lanes.
inline __m256i pack_bf16x16(__m512 x) {
#if defined(__AVX512BF16__)
  return (__m256i)_mm512_cvtneps_pbh(x);  // one instruction; differs only on fp32 denormals (flushed to 0)
#else
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  return _mm512_cvtepi32_epi16(
      _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0)));
#endif
}

inline __m512 widen_bf16x16(__m256i packed) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(packed), 16));
}

inline __m512 round_bf16x16(__m512 x) { return widen_bf16x16(pack_bf16x16(x)); }

inline void store_bf16x16(uint16_t* p, __m512 x, __mmask16 mask = 0xFFFF) {
  _mm256_mask_storeu_epi16(p, mask, pack_bf16x16(x));
}

using cpu_ext::exp512;
using cpu_ext::lanes_below;

#endif

// dst[i] = bf16(src[i] * mul)
inline void store_bf16(const float* src, float mul, uint16_t* dst, int64_t n) {
  int64_t i = 0;
#if defined(CPU_EXT_AVX512)
  for (; i + 16 <= n; i += 16) store_bf16x16(dst + i, _mm512_mul_ps(_mm512_loadu_ps(src + i), _mm512_set1_ps(mul)));
#endif
  for (; i < n; ++i) dst[i] = float_to_bf16(src[i] * mul);
}

// Dot product of one bf16 row with one fp32 vector, accumulated in fp32.
inline float dot_bf16_f32(const uint16_t* w, const float* x, int64_t k) {
  int64_t i = 0;
  float total = 0.f;
#if defined(CPU_EXT_AVX512)
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  for (; i + 32 <= k; i += 32) {
    __m512i w0 = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(w + i))), 16);
    __m512i w1 = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(w + i + 16))), 16);
    acc0 = _mm512_fmadd_ps(_mm512_castsi512_ps(w0), _mm512_loadu_ps(x + i), acc0);
    acc1 = _mm512_fmadd_ps(_mm512_castsi512_ps(w1), _mm512_loadu_ps(x + i + 16), acc1);
  }
  total = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
#endif
  for (; i < k; ++i) total += bf16_to_float(w[i]) * x[i];
  return total;
}

}  // namespace

// out[r, row] = w[row] . x[r] for rows [begin, end) of w and all R rows of x, R a compile-time constant so the
// 2R accumulators stay in registers: each weight vector is loaded and widened once and used R times, which
// keeps the product bound by weight traffic up to R = 8 (a verification chunk of 1 + K tokens).
template <int R>
void gemv_rows(const uint16_t* w, const float* x, float* out, int64_t n, int64_t k, int64_t begin, int64_t end) {
  for (int64_t row = begin; row < end; ++row) {
    const uint16_t* wr = w + row * k;
    float total[R];
    int64_t i = 0;
#if defined(CPU_EXT_AVX512)
    __m512 acc0[R], acc1[R];
    for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
    for (; i + 32 <= k; i += 32) {
      __m512 w0 = _mm512_castsi512_ps(
          _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(wr + i))), 16));
      __m512 w1 = _mm512_castsi512_ps(
          _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(wr + i + 16))), 16));
      for (int r = 0; r < R; ++r) {
        acc0[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + r * k + i), acc0[r]);
        acc1[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + r * k + i + 16), acc1[r]);
      }
    }
    for (int r = 0; r < R; ++r) total[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[r], acc1[r]));
#else
    for (int r = 0; r < R; ++r) total[r] = 0.f;
#endif
    for (; i < k; ++i) {
      const float wv = bf16_to_float(wr[i]);
      for (int r = 0; r < R; ++r) total[r] += wv * x[r * k + i];
    }
    for (int r = 0; r < R; ++r) out[r * n + row] = total[r];
  }
}

// Rows [begin, end) of w against rows [first, first + min(8, m - first)) of x.
void gemv_pass(const uint16_t* w, const float* x, float* out, int64_t m, int64_t n, int64_t k, int64_t first,
               int64_t begin, int64_t end) {
  const float* xp = x + first * k;
  float* op = out + first * n;
  switch (std::min<int64_t>(8, m - first)) {
    case 1: gemv_rows<1>(w, xp, op, n, k, begin, end); break;
    case 2: gemv_rows<2>(w, xp, op, n, k, begin, end); break;
    case 3: gemv_rows<3>(w, xp, op, n, k, begin, end); break;
    case 4: gemv_rows<4>(w, xp, op, n, k, begin, end); break;
    case 5: gemv_rows<5>(w, xp, op, n, k, begin, end); break;
    case 6: gemv_rows<6>(w, xp, op, n, k, begin, end); break;
    case 7: gemv_rows<7>(w, xp, op, n, k, begin, end); break;
    default: gemv_rows<8>(w, xp, op, n, k, begin, end); break;
  }
}

constexpr int64_t kGemvSlice = 64;  // weight rows every pass of x runs over before the next: they stay in L2

// x [M, K] bf16, weight [N, K] bf16 (contiguous), bias [N] or empty -> [M, N] bf16 (fp32 with fp32_out: the
// sums kept whole), in passes of up to 8 rows. Each thread runs every pass over one slice of its weight rows before
// the next slice, so past 8 rows the weight still comes from memory once (a pass's sums do not depend on the order).
torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor weight, torch::Tensor bias, bool fp32_out) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "linear_bf16: shapes");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.is_contiguous(), "linear_bf16: weight");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  torch::Tensor xf = x.to(torch::kFloat32).contiguous();
  torch::Tensor out = torch::empty({m, n}, x.options().dtype(torch::kFloat32));
  const uint16_t* w = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  const float* xp = xf.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 32, [&](int64_t begin, int64_t end) {
    for (int64_t slice = begin; slice < end; slice += kGemvSlice)
      for (int64_t first = 0; first < m; first += 8)
        gemv_pass(w, xp, op, m, n, k, first, slice, std::min(end, slice + kGemvSlice));
  });
  if (bias.numel()) out.add_(bias.to(torch::kFloat32));
  return fp32_out ? out : out.to(torch::kBFloat16);
}

// ---- Decode attention over paged KV -------------------------------------------------------------------------
// Work item: one (query row, kv head), its whole query group at once, so every key/value row is loaded once
// for all G grouped heads. Items are cut into tiles of kTile tokens; each thread takes an equal share of all
// tiles (balanced by context length), so an item may be split between two threads: those halves are merged
// afterwards from their softmax statistics (flash-decoding). Within a segment: scores for all its tokens,
// then softmax, then the weighted sum of values, all in fp32.
// Bound by the misses in flight on the scattered key/value rows, not by the arithmetic; the variants tried
// (AMX tiles, other prefetching, other page layouts) and their figures: docs/performance.md, "Decode attention"
// (python -m bench.cpu_kernels).

namespace {

constexpr int64_t kTile = 16;  // tokens scored together: one fp32 lane each

struct AttentionProblem {
  const uint16_t* q;  // [B, Hq, D]
  const uint16_t* k;  // bf16 pages [N, bs, Hkv, D]; null for fp8 pages
  const uint16_t* v;
  const uint8_t* k8;  // fp8 pages [N, page_bytes]: codes [bs, Hkv, D] e4m3 | scales [Hkv] fp32; null for bf16
  const uint8_t* v8;
  const int64_t* tables;  // [B, nb]
  const int64_t* lens;    // [B]
  uint16_t* out;          // [B, Hq, D]
  int64_t num_heads, num_kv_heads, group, head_dim, block_size, max_blocks;
  int64_t page_stride;   // from one block to the next: elements (bf16) or bytes (fp8)
  int64_t scale_offset;  // fp8: byte offset of a page's scales
  float scale;
};

// Softmax statistics and unnormalised output of part of an item, computed by one thread.
struct SegmentResult {
  int64_t item = -1;
  std::vector<float> max, sum, acc;  // [G], [G], [G, D]
};

#if defined(CPU_EXT_AVX512)
struct QueryChunk;
#endif

struct Scratch {
#if defined(CPU_EXT_AVX512)
  std::vector<QueryChunk> query;  // [G, chunks]: the query group as the scores read it
#endif
  std::vector<int64_t> rows;  // [n]: element offset of each token's row (this kv head) in the pages
  std::vector<int64_t> ahead;  // the next item's first rows, to prefetch
  std::vector<float> scores;  // [G, n rounded up to kTile]: scaled scores, then probabilities
  std::vector<float> pairs;   // [G, D rounded up to 32]: value sums in the vector path's pair layout (scalar: a row)
  // fp8 pages only
  std::vector<float> token_scales;     // [n]: each token's page scale (this kv head), for keys then values
  std::vector<uint16_t> decoded;       // [n, D]: the segment's keys, then its values, decoded to bf16
  std::vector<int64_t> decoded_rows;   // [n]: t * D
};

// Element (bf16) or byte (fp8) offsets of the rows of tokens [first, first + n) of row b, kv head h.
void token_rows(const AttentionProblem& p, int64_t b, int64_t h, int64_t first, int64_t n, int64_t* rows) {
  const int64_t slot_stride = p.num_kv_heads * p.head_dim, block_stride = p.page_stride;
  const int64_t* table = p.tables + b * p.max_blocks;
  int64_t block = first / p.block_size, slot = first % p.block_size;
  int64_t base = table[block] * block_stride + h * p.head_dim;
  for (int64_t t = 0; t < n; ++t) {
    rows[t] = base + slot * slot_stride;
    if (++slot == p.block_size && t + 1 < n) {
      slot = 0;
      base = table[++block] * block_stride + h * p.head_dim;
    }
  }
}

#if defined(CPU_EXT_AVX512)

// A key/value row is read 32 bf16 (one 64-byte chunk) at a time, as 16 pairs: the even element of a pair is
// the low half of a 32-bit lane, so a shift or a mask widens each half to fp32 with no shuffle.
inline __m512 even_half(__m512i pairs) { return _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)); }
inline __m512 odd_half(__m512i pairs) {
  return _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

struct Chunks {
  int64_t count;   // ceil(D / 32)
  __mmask32 tail;  // bf16 lanes of the last chunk inside the row
  explicit Chunks(int64_t head_dim)
      : count((head_dim + 31) / 32),
        tail(head_dim % 32 ? static_cast<__mmask32>((1u << (head_dim % 32)) - 1) : static_cast<__mmask32>(~0u)) {}
};

// Chunk c of NC of a row (NC = 0: `count` chunks), the last one loaded under `last_mask`.
template <int NC>
inline __m512i load_chunk(const uint16_t* row, int64_t c, int64_t count, __mmask32 last_mask) {
  return c + 1 < (NC ? NC : count) ? _mm512_loadu_si512(row + 32 * c)
                                   : _mm512_maskz_loadu_epi16(last_mask, row + 32 * c);
}

#if defined(__AVX512BF16__)
using QueryPairs = __m512i;  // products of bf16 pairs summed straight into fp32 lanes (exact products, fp32 sums)
inline QueryPairs query_pairs(__m512i raw) { return raw; }
inline __m512 dot_pairs(__m512 acc, QueryPairs q, __m512i k) {
  return _mm512_dpbf16_ps(acc, (__m512bh)q, (__m512bh)k);
}
#else
struct QueryPairs { __m512 even, odd; };
inline QueryPairs query_pairs(__m512i raw) { return {even_half(raw), odd_half(raw)}; }
inline __m512 dot_pairs(__m512 acc, QueryPairs q, __m512i k) {
  return _mm512_fmadd_ps(q.odd, odd_half(k), _mm512_fmadd_ps(q.even, even_half(k), acc));
}
#endif

struct alignas(64) QueryChunk { QueryPairs pairs; };  // in a struct, std::vector keeps the alignment

// out lane i = sum of the lanes of v[i]: a transposing tree of shuffles and adds (4 levels, 45 instructions
// for 16 sums instead of 16 separate horizontal reductions).
inline __m512 sum_lanes16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [v2i, v2i+1, v2i, v2i+1]
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: [v4i .. v4i+3]
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)  // 128-bit lanes: [b2i lanes 0+1, b2i lanes 2+3, b2i+1 lanes 0+1, b2i+1 lanes 2+3]
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// Rows scattered over pages defeat the hardware prefetcher: ask for every 64-byte line of `count` rows.
template <_mm_hint Hint>
inline void prefetch_rows(const uint16_t* pages, const int64_t* rows, int64_t count, int64_t head_dim) {
  for (int64_t t = 0; t < count; ++t)
    for (int64_t e = 0; e < head_dim; e += 32) _mm_prefetch(reinterpret_cast<const char*>(pages + rows[t] + e), Hint);
}

// Lane t = q . k_t for the tile's keys (count valid, the rest 0); D in NC chunks (NC = 0: chunks.count).
template <int NC>
inline __m512 tile_scores(const Chunks& chunks, const QueryChunk* q, const uint16_t* keys, const int64_t* rows,
                          int64_t count) {
  __m512 partial[kTile];
#pragma GCC unroll 16
  for (int t = 0; t < kTile; ++t) {
    partial[t] = _mm512_setzero_ps();
    if (t < count)
#pragma GCC unroll 4
      for (int64_t c = 0; c < (NC ? NC : chunks.count); ++c)
        partial[t] = dot_pairs(partial[t], q[c].pairs, load_chunk<NC>(keys + rows[t], c, chunks.count, chunks.tail));
  }
  return sum_lanes16(partial);
}

// S[g, t] = scale * q_g . k_t for the segment's n tokens; lanes past n in the last tile = -inf.
template <int NC>
void scores_by_chunks(const AttentionProblem& p, const Chunks& chunks, const uint16_t* q, const int64_t* rows,
                      int64_t n, float* scores, int64_t stride, Scratch& scratch) {
  std::vector<QueryChunk>& qp = scratch.query;
  qp.resize(p.group * chunks.count);
  for (int64_t g = 0; g < p.group; ++g)
    for (int64_t c = 0; c < chunks.count; ++c)
      qp[g * chunks.count + c].pairs = query_pairs(load_chunk<0>(q + g * p.head_dim, c, chunks.count, chunks.tail));
  const __m512 scale = _mm512_set1_ps(p.scale), minus_inf = _mm512_set1_ps(-INFINITY);
  for (int64_t first = 0; first < n; first += kTile) {
    const int64_t count = std::min(kTile, n - first), ahead = first + 2 * kTile;
    if (ahead < n) prefetch_rows<_MM_HINT_T0>(p.k, rows + ahead, std::min(kTile, n - ahead), p.head_dim);
    prefetch_rows<_MM_HINT_T1>(p.v, rows + first, count, p.head_dim);  // for the value pass, into L2
    for (int64_t g = 0; g < p.group; ++g) {  // the tile's key rows stay in L1 across the group
      const __m512 dots = tile_scores<NC>(chunks, qp.data() + g * chunks.count, p.k, rows + first, count);
      _mm512_storeu_ps(scores + g * stride + first, _mm512_mask_mul_ps(minus_inf, lanes_below(count), dots, scale));
    }
  }
}

void segment_scores(const AttentionProblem& p, const uint16_t* q, const int64_t* rows, int64_t n, float* scores,
                    int64_t stride, Scratch& scratch) {
  const Chunks chunks(p.head_dim);
  switch (chunks.count) {
    case 1: scores_by_chunks<1>(p, chunks, q, rows, n, scores, stride, scratch); break;
    case 2: scores_by_chunks<2>(p, chunks, q, rows, n, scores, stride, scratch); break;
    case 4: scores_by_chunks<4>(p, chunks, q, rows, n, scores, stride, scratch); break;
    default: scores_by_chunks<0>(p, chunks, q, rows, n, scores, stride, scratch); break;
  }
}

// Each row of S (n scores padded with -inf to a multiple of kTile) becomes exp(S - max); returns the max and sum.
void segment_softmax(float* scores, int64_t stride, int64_t n, int64_t group, float* max, float* sum) {
  const int64_t padded = (n + kTile - 1) / kTile * kTile;
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * stride;
    __m512 peak = _mm512_set1_ps(-INFINITY);
    for (int64_t i = 0; i < padded; i += kTile) peak = _mm512_max_ps(peak, _mm512_loadu_ps(s + i));
    max[g] = _mm512_reduce_max_ps(peak);
    const __m512 shift = _mm512_set1_ps(max[g]);
    __m512 total = _mm512_setzero_ps();
    for (int64_t i = 0; i < padded; i += kTile) {
      const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + i), shift));
      _mm512_storeu_ps(s + i, e);
      total = _mm512_add_ps(total, e);
    }
    sum[g] = _mm512_reduce_add_ps(total);
  }
}

struct ValueSlice {
  const uint16_t* v;     // the pages, offset to the slice's first chunk
  const int64_t* rows;   // [n]
  int64_t n;
  const float* probs;    // [GT, stride]: the slice's first head
  int64_t stride;
  float* pairs;          // [GT, pair_stride], offset to the slice's first head and chunk
  int64_t pair_stride;
  __mmask32 last_mask;   // bf16 lanes of the slice's last chunk inside the row
};

// pairs[g, 32c + (0..15 | 16..31)] = sum_t P[g, t] * (even | odd elements of chunk c of v_t) for GT heads and
// NC chunks, all accumulators in registers: each value row is loaded and widened once for the GT heads.
template <int GT, int NC>
void values_tile(const ValueSlice& s) {
  __m512 even[GT][NC], odd[GT][NC];
  for (int g = 0; g < GT; ++g)
    for (int c = 0; c < NC; ++c) even[g][c] = odd[g][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < s.n; ++t) {
    __m512 lo[NC], hi[NC];
    for (int c = 0; c < NC; ++c) {
      const __m512i raw = load_chunk<NC>(s.v + s.rows[t], c, NC, s.last_mask);
      lo[c] = even_half(raw);
      hi[c] = odd_half(raw);
    }
    for (int g = 0; g < GT; ++g) {
      const __m512 w = _mm512_set1_ps(s.probs[g * s.stride + t]);
      for (int c = 0; c < NC; ++c) {
        even[g][c] = _mm512_fmadd_ps(w, lo[c], even[g][c]);
        odd[g][c] = _mm512_fmadd_ps(w, hi[c], odd[g][c]);
      }
    }
  }
  for (int g = 0; g < GT; ++g)
    for (int c = 0; c < NC; ++c) {
      _mm512_storeu_ps(s.pairs + g * s.pair_stride + 32 * c, even[g][c]);
      _mm512_storeu_ps(s.pairs + g * s.pair_stride + 32 * c + 16, odd[g][c]);
    }
}

constexpr int64_t max_heads(int64_t nc) { return nc <= 2 ? 4 : 2; }  // 2 * heads * chunks <= 16 accumulators

template <int NC>
void values_heads(int64_t heads, const ValueSlice& s) {
  if constexpr (max_heads(NC) == 4) {
    switch (heads) {
      case 1: values_tile<1, NC>(s); break;
      case 2: values_tile<2, NC>(s); break;
      case 3: values_tile<3, NC>(s); break;
      default: values_tile<4, NC>(s); break;
    }
  } else {
    heads == 1 ? values_tile<1, NC>(s) : values_tile<2, NC>(s);
  }
}

// acc[g, d] = sum_t P[g, t] v_t[d], in natural layout; up to 4 chunks (128 dims) of a few heads per pass.
void segment_values(const AttentionProblem& p, const int64_t* rows, int64_t n, const float* probs, int64_t stride,
                    Scratch& scratch, float* acc) {
  const Chunks chunks(p.head_dim);
  const int64_t pair_stride = 32 * chunks.count;
  scratch.pairs.resize(p.group * pair_stride);
  for (int64_t c = 0; c < chunks.count; c += 4) {
    const int64_t nc = std::min<int64_t>(4, chunks.count - c);
    const __mmask32 last_mask = c + nc == chunks.count ? chunks.tail : static_cast<__mmask32>(~0u);
    for (int64_t g = 0; g < p.group; g += max_heads(nc)) {
      const int64_t heads = std::min(max_heads(nc), p.group - g);
      const ValueSlice s{p.v + 32 * c, rows, n, probs + g * stride, stride,
                         scratch.pairs.data() + g * pair_stride + 32 * c, pair_stride, last_mask};
      switch (nc) {
        case 1: values_heads<1>(heads, s); break;
        case 2: values_heads<2>(heads, s); break;
        case 3: values_heads<3>(heads, s); break;
        default: values_heads<4>(heads, s); break;
      }
    }
  }
  const float* pairs = scratch.pairs.data();
  for (int64_t g = 0; g < p.group; ++g)
    for (int64_t d = 0; d < p.head_dim; ++d)
      acc[g * p.head_dim + d] = pairs[g * pair_stride + d / 32 * 32 + (d % 2) * 16 + (d % 32) / 2];
}

#else  // scalar fallback: same steps, one token at a time; `load(i)` reads element i of the pages as fp32

template <typename Load>
void scalar_scores(const AttentionProblem& p, const uint16_t* q, const int64_t* rows, int64_t n, float* scores,
                   int64_t stride, Load load) {
  const int64_t padded = (n + kTile - 1) / kTile * kTile;
  for (int64_t g = 0; g < p.group; ++g) {
    const uint16_t* qg = q + g * p.head_dim;
    for (int64_t t = 0; t < n; ++t) {
      float dot = 0.f;
      for (int64_t d = 0; d < p.head_dim; ++d) dot += bf16_to_float(qg[d]) * load(rows[t] + d);
      scores[g * stride + t] = dot * p.scale;
    }
    std::fill(scores + g * stride + n, scores + g * stride + padded, -INFINITY);
  }
}

template <typename Load>
void scalar_values(const AttentionProblem& p, const int64_t* rows, int64_t n, const float* probs, int64_t stride,
                   Scratch& scratch, float* acc, Load load) {
  std::vector<float>& value = scratch.pairs;
  value.resize(p.head_dim);
  std::fill(acc, acc + p.group * p.head_dim, 0.f);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t d = 0; d < p.head_dim; ++d) value[d] = load(rows[t] + d);
    for (int64_t g = 0; g < p.group; ++g)
      for (int64_t d = 0; d < p.head_dim; ++d) acc[g * p.head_dim + d] += probs[g * stride + t] * value[d];
  }
}

void segment_softmax(float* scores, int64_t stride, int64_t n, int64_t group, float* max, float* sum) {
  const int64_t padded = (n + kTile - 1) / kTile * kTile;
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * stride;
    max[g] = *std::max_element(s, s + padded);
    sum[g] = 0.f;
    for (int64_t t = 0; t < padded; ++t) sum[g] += (s[t] = std::exp(s[t] - max[g]));
  }
}

void segment_scores(const AttentionProblem& p, const uint16_t* q, const int64_t* rows, int64_t n, float* scores,
                    int64_t stride, Scratch&) {
  scalar_scores(p, q, rows, n, scores, stride, [&](int64_t i) { return bf16_to_float(p.k[i]); });
}

void segment_values(const AttentionProblem& p, const int64_t* rows, int64_t n, const float* probs, int64_t stride,
                    Scratch& scratch, float* acc) {
  scalar_values(p, rows, n, probs, stride, scratch, acc, [&](int64_t i) { return bf16_to_float(p.v[i]); });
}

#endif

// ---- fp8 (E4M3 "fn") pages: a segment's key (then value) rows are decoded to bf16 (exact: e4m3 has 3
// mantissa bits and exponents 2^-9..2^8, no bf16 denormal) and fed to the bf16 steps above. A page's
// per-kv-head scale is a power of two, so e4m3 * scale is exact: it multiplies each score (keys) and each
// probability weight (values) instead of every element.

// Scales [n] of tokens [first, first + n) of row b, kv head h: scale[h] of each token's page.
void fp8_token_scales(const AttentionProblem& p, const uint8_t* pages, int64_t b, int64_t h, int64_t first,
                      int64_t n, float* scales) {
  const int64_t* table = p.tables + b * p.max_blocks;
  for (int64_t t = 0; t < n;) {
    const int64_t block = (first + t) / p.block_size, end = std::min(n, (block + 1) * p.block_size - first);
    float value;
    std::memcpy(&value, pages + table[block] * p.page_stride + p.scale_offset + h * sizeof(float), sizeof(value));
    std::fill(scales + t, scales + end, value);
    t = end;
  }
}

// x[g, t] *= scales[t] for the n tokens of each of `group` rows of x [group, stride].
void scale_tokens(float* x, int64_t stride, int64_t n, int64_t group, const float* scales) {
  for (int64_t g = 0; g < group; ++g)
    for (int64_t t = 0; t < n; ++t) x[g * stride + t] *= scales[t];
}

inline float e4m3_to_float(uint8_t code) {
  if ((code & 0x7F) == 0x7F) return NAN;
  const uint32_t bits = static_cast<uint32_t>(code & 0x7F) << 20;  // an fp32 of value e4m3 * 2^-120
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  value *= 0x1p120f;
  return code & 0x80 ? -value : value;
}

#if defined(CPU_EXT_AVX512)

// bf16 bit patterns of the 128 e4m3 magnitudes, 32 to a register (0x7F: NaN).
struct E4m3Table {
  alignas(64) uint16_t bits[128];
  E4m3Table() {
    for (int code = 0; code < 128; ++code) bits[code] = float_to_bf16(e4m3_to_float(static_cast<uint8_t>(code)));
  }
};
const E4m3Table kE4m3Table;

// 32 e4m3 codes (the lanes of `mask`; the rest 0) -> bf16: the magnitude looked up (2 two-table word
// permutes, picked by bit 6), the sign bit moved to bit 15.
inline __m512i e4m3x32_bf16(const uint8_t* p, __mmask32 mask, const __m512i* table) {
  const __m512i codes = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(mask, p));
  const __m512i low = _mm512_permutex2var_epi16(table[0], codes, table[1]);  // index bits 0..5
  const __m512i high = _mm512_permutex2var_epi16(table[2], codes, table[3]);
  const __m512i magnitude = _mm512_mask_mov_epi16(low, _mm512_test_epi16_mask(codes, _mm512_set1_epi16(0x40)), high);
  return _mm512_ternarylogic_epi32(magnitude, _mm512_slli_epi16(codes, 8),  // magnitude | (codes << 8 & 0x8000)
                                   _mm512_set1_epi16(static_cast<short>(0x8000)), 0xF8);
}

inline __mmask32 lanes32_below(int64_t n) { return n >= 32 ? ~0u : static_cast<__mmask32>((1u << n) - 1); }

// Every cache line of the D-byte row at `row`: pages are not a multiple of 64 bytes, so rows straddle lines.
template <_mm_hint Hint>
inline void prefetch_fp8_row(const uint8_t* row, int64_t head_dim) {
  for (int64_t e = 0; e < head_dim; e += 64) _mm_prefetch(reinterpret_cast<const char*>(row + e), Hint);
  _mm_prefetch(reinterpret_cast<const char*>(row + head_dim - 1), Hint);
}

constexpr int64_t kPrefetchRows = 32;  // rows scattered over pages defeat the hardware prefetcher

// out [n, D] bf16 = e4m3 values (unscaled) of the n rows at byte offsets `rows`; `later` (or null): pages read
// at the same offsets next (the values, while decoding the keys), asked for into L2.
void decode_rows(const uint8_t* pages, const uint8_t* later, const int64_t* rows, int64_t n, int64_t head_dim,
                 uint16_t* out) {
  __m512i table[4];
  for (int i = 0; i < 4; ++i) table[i] = _mm512_load_si512(kE4m3Table.bits + 32 * i);
  for (int64_t t = 0; t < std::min(n, kPrefetchRows); ++t) prefetch_fp8_row<_MM_HINT_T0>(pages + rows[t], head_dim);
  for (int64_t t = 0; t < n; ++t) {
    if (t + kPrefetchRows < n) prefetch_fp8_row<_MM_HINT_T0>(pages + rows[t + kPrefetchRows], head_dim);
    if (later) prefetch_fp8_row<_MM_HINT_T1>(later + rows[t], head_dim);
    for (int64_t c = 0; c < head_dim; c += 32) {
      const __mmask32 mask = lanes32_below(head_dim - c);
      _mm512_mask_storeu_epi16(out + t * head_dim + c, mask, e4m3x32_bf16(pages + rows[t] + c, mask, table));
    }
  }
}

// The bf16 problem reading the decoded rows: scratch.decoded [n, D], row t at element t * D.
AttentionProblem decoded_problem(const AttentionProblem& p, const uint8_t* pages, const uint8_t* later,
                                 const int64_t* rows, int64_t n, Scratch& scratch) {
  scratch.decoded.resize(n * p.head_dim);
  scratch.decoded_rows.resize(n);
  for (int64_t t = 0; t < n; ++t) scratch.decoded_rows[t] = t * p.head_dim;
  decode_rows(pages, later, rows, n, p.head_dim, scratch.decoded.data());
  AttentionProblem decoded = p;
  decoded.k = decoded.v = scratch.decoded.data();
  return decoded;
}

// S[g, t] = scale * q_g . e4m3(k_t) (unscaled keys); lanes past n in the last tile = -inf.
void fp8_segment_scores(const AttentionProblem& p, const uint16_t* q, const int64_t* rows, int64_t n, float* scores,
                        int64_t stride, Scratch& scratch) {
  const AttentionProblem decoded = decoded_problem(p, p.k8, p.v8, rows, n, scratch);
  segment_scores(decoded, q, scratch.decoded_rows.data(), n, scores, stride, scratch);
}

// acc[g, d] = sum_t P[g, t] e4m3(v_t)[d] (unscaled values).
void fp8_segment_values(const AttentionProblem& p, const int64_t* rows, int64_t n, const float* probs, int64_t stride,
                        Scratch& scratch, float* acc) {
  const AttentionProblem decoded = decoded_problem(p, p.v8, nullptr, rows, n, scratch);
  segment_values(decoded, scratch.decoded_rows.data(), n, probs, stride, scratch, acc);
}

#else  // scalar fallback

void fp8_segment_scores(const AttentionProblem& p, const uint16_t* q, const int64_t* rows, int64_t n, float* scores,
                        int64_t stride, Scratch&) {
  scalar_scores(p, q, rows, n, scores, stride, [&](int64_t i) { return e4m3_to_float(p.k8[i]); });
}

void fp8_segment_values(const AttentionProblem& p, const int64_t* rows, int64_t n, const float* probs, int64_t stride,
                        Scratch& scratch, float* acc) {
  scalar_values(p, rows, n, probs, stride, scratch, acc, [&](int64_t i) { return e4m3_to_float(p.v8[i]); });
}

#endif

// Tiles [first_tile, end_tile) of one item -> its softmax statistics and unnormalised output.
void attend_segment(const AttentionProblem& p, int64_t item, int64_t first_tile, int64_t end_tile, Scratch& scratch,
                    SegmentResult& result) {
  const int64_t b = item / p.num_kv_heads, h = item % p.num_kv_heads;
  const int64_t first = first_tile * kTile, n = std::min(end_tile * kTile, p.lens[b]) - first;
  const int64_t stride = (end_tile - first_tile) * kTile;
  scratch.rows.resize(n);
  scratch.scores.resize(p.group * stride);
  result.item = item;
  result.max.resize(p.group);
  result.sum.resize(p.group);
  result.acc.resize(p.group * p.head_dim);
  token_rows(p, b, h, first, n, scratch.rows.data());
  const uint16_t* q = p.q + (b * p.num_heads + h * p.group) * p.head_dim;
  if (!p.k8) {
    segment_scores(p, q, scratch.rows.data(), n, scratch.scores.data(), stride, scratch);
    segment_softmax(scratch.scores.data(), stride, n, p.group, result.max.data(), result.sum.data());
    segment_values(p, scratch.rows.data(), n, scratch.scores.data(), stride, scratch, result.acc.data());
    return;
  }
  scratch.token_scales.resize(n);
  fp8_segment_scores(p, q, scratch.rows.data(), n, scratch.scores.data(), stride, scratch);
  fp8_token_scales(p, p.k8, b, h, first, n, scratch.token_scales.data());
  scale_tokens(scratch.scores.data(), stride, n, p.group, scratch.token_scales.data());
  segment_softmax(scratch.scores.data(), stride, n, p.group, result.max.data(), result.sum.data());
  fp8_token_scales(p, p.v8, b, h, first, n, scratch.token_scales.data());
  scale_tokens(scratch.scores.data(), stride, n, p.group, scratch.token_scales.data());  // after the sums
  fp8_segment_values(p, scratch.rows.data(), n, scratch.scores.data(), stride, scratch, result.acc.data());
}

void write_output(const AttentionProblem& p, const SegmentResult& r) {
  const int64_t b = r.item / p.num_kv_heads, h = r.item % p.num_kv_heads;
  uint16_t* out = p.out + (b * p.num_heads + h * p.group) * p.head_dim;
  for (int64_t g = 0; g < p.group; ++g)
    store_bf16(r.acc.data() + g * p.head_dim, 1.f / r.sum[g], out + g * p.head_dim, p.head_dim);
}

// Folds `part` (the same item, a later span of its tokens) into `into`: both rescaled to the larger max.
void merge_into(SegmentResult& into, const SegmentResult& part, int64_t head_dim) {
  for (size_t g = 0; g < into.max.size(); ++g) {
    const float peak = std::max(into.max[g], part.max[g]);
    const float a = std::exp(into.max[g] - peak), b = std::exp(part.max[g] - peak);
    into.max[g] = peak;
    into.sum[g] = into.sum[g] * a + part.sum[g] * b;
    for (int64_t d = 0; d < head_dim; ++d)
      into.acc[g * head_dim + d] = into.acc[g * head_dim + d] * a + part.acc[g * head_dim + d] * b;
  }
}

// Thread `share` of `shares` computes global tiles [total * share / shares, total * (share + 1) / shares):
// whole items are written out; an item cut by the share's edges leaves its part in `edges` (0: the first
// segment, when it starts mid-item; 1: the last, when it ends mid-item).
void attend_share(const AttentionProblem& p, const std::vector<int64_t>& item_start, int64_t lo, int64_t hi,
                  Scratch& scratch, SegmentResult* edges) {
  const int64_t items = static_cast<int64_t>(item_start.size()) - 1;
  int64_t item = std::upper_bound(item_start.begin(), item_start.end(), lo) - item_start.begin() - 1;
  SegmentResult whole;
  for (; item < items && item_start[item] < hi; ++item) {
    const int64_t first = std::max(lo, item_start[item]) - item_start[item];
    const int64_t end = std::min(hi, item_start[item + 1]) - item_start[item];
    const bool complete = first == 0 && end == item_start[item + 1] - item_start[item];
    SegmentResult& result = complete ? whole : edges[first == 0 ? 1 : 0];
    attend_segment(p, item, first, end, scratch, result);
    if (complete) write_output(p, result);
  }
}

void check_decode_inputs(const torch::Tensor& q, const torch::Tensor& block_tables, const torch::Tensor& context_lens,
                         const char* name) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kBFloat16, name, ": q must be bf16 [B, Hq, D]");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong &&
              block_tables.dim() == 2 && block_tables.size(0) == q.size(0) && context_lens.numel() == q.size(0),
              name, ": block tables / context lengths");
}

// The keys of the first tiles of `item` into L2, asked for while the item before it runs: scores_by_chunks
// prefetches only 2 tiles ahead within an item, so each item would begin on cold misses. The tile count is
// measured (docs/performance.md, "Decode attention").
constexpr int64_t kNextItemPrefetchTiles = 8;

void prefetch_item_start(const AttentionProblem& p, int64_t item, Scratch& scratch) {
#if defined(CPU_EXT_AVX512)
  if (!p.k) return;  // bf16 pages only
  const int64_t b = item / p.num_kv_heads, h = item % p.num_kv_heads;
  const int64_t n = std::min(kNextItemPrefetchTiles * kTile, p.lens[b]);
  scratch.ahead.resize(n);
  token_rows(p, b, h, 0, n, scratch.ahead.data());
  prefetch_rows<_MM_HINT_T1>(p.k, scratch.ahead.data(), n, p.head_dim);
#endif
}

// With this many items a thread or more, threads claim whole items as they go (cpu_ext::parallel_claim): no
// thread waits long for a slower one, and no item is cut, so the output does not depend on which thread ran
// what. Fewer items (small batches) are split into equal token shares, cut items merged after.
constexpr int64_t kClaimItemsPerThread = 8;

// Fills p's query, table and output fields from the tensors (kept alive by the caller) and runs it.
void run_decode_attention(AttentionProblem& p, const torch::Tensor& q, const torch::Tensor& tables,
                          const torch::Tensor& lens, torch::Tensor& out, int64_t num_blocks, const char* name) {
  const int64_t num_seqs = q.size(0), block_size = p.block_size, num_kv_heads = p.num_kv_heads;
  TORCH_CHECK(p.num_heads % num_kv_heads == 0, name, ": heads");
  p.q = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  p.tables = tables.data_ptr<int64_t>();
  p.lens = lens.data_ptr<int64_t>();
  p.out = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  p.group = p.num_heads / num_kv_heads;
  p.max_blocks = tables.size(1);
  const int64_t max_blocks = p.max_blocks;
  std::vector<int64_t> item_start(num_seqs * num_kv_heads + 1, 0);  // first global tile of each item
  for (int64_t b = 0; b < num_seqs; ++b) {  // checked here: an exception inside parallel_for is worse to read
    const int64_t length = p.lens[b];
    TORCH_CHECK(length >= 1 && length <= max_blocks * block_size, name, ": context length ", length);
    for (int64_t j = 0; j < (length + block_size - 1) / block_size; ++j)
      TORCH_CHECK(p.tables[b * max_blocks + j] >= 0 && p.tables[b * max_blocks + j] < num_blocks,
                  name, ": block id ", p.tables[b * max_blocks + j]);
    for (int64_t h = 0; h < num_kv_heads; ++h)
      item_start[b * num_kv_heads + h + 1] = item_start[b * num_kv_heads + h] + (length + kTile - 1) / kTile;
  }
  const int64_t total = item_start.back(), items = num_seqs * num_kv_heads;
  if (items >= kClaimItemsPerThread * at::get_num_threads()) {  // whole items, claimed as threads free up
    cpu_ext::parallel_claim(items, 1, [&](int64_t begin, int64_t end) {
      Scratch scratch;
      SegmentResult whole;
      for (int64_t item = begin; item < end; ++item) {
        if (item + 1 < end) prefetch_item_start(p, item + 1, scratch);
        attend_segment(p, item, 0, item_start[item + 1] - item_start[item], scratch, whole);
        write_output(p, whole);
      }
    });
    return;
  }
  const int64_t shares = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), total));
  std::vector<SegmentResult> edges(2 * shares);
  at::parallel_for(0, shares, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t s = begin; s < end; ++s)
      attend_share(p, item_start, total * s / shares, total * (s + 1) / shares, scratch, &edges[2 * s]);
  });
  // Edge segments appear in token order: merge each run of the same item, then write it.
  for (size_t i = 0; i < edges.size();) {
    if (edges[i].item < 0) { ++i; continue; }
    SegmentResult& merged = edges[i];
    size_t j = i + 1;
    for (; j < edges.size() && (edges[j].item < 0 || edges[j].item == merged.item); ++j)
      if (edges[j].item == merged.item) merge_into(merged, edges[j], p.head_dim);
    write_output(p, merged);
    i = j;
  }
}

}  // namespace

// q [B, Hq, D] bf16; k/v pages [N, bs, Hkv, D] bf16; block_tables [B, nb] int64; context_lens [B] int64
// -> [B, Hq, D] bf16. Blocks and slots past a row's context are never read.
torch::Tensor decode_attention_bf16(torch::Tensor q, torch::Tensor k_pages, torch::Tensor v_pages,
                                   torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  const char* name = "decode_attention_bf16";
  check_decode_inputs(q, block_tables, context_lens, name);
  TORCH_CHECK(k_pages.dim() == 4 && k_pages.sizes() == v_pages.sizes(), name, ": shapes");
  TORCH_CHECK(k_pages.scalar_type() == at::kBFloat16 && v_pages.scalar_type() == at::kBFloat16, name,
              ": pages must be bf16");
  TORCH_CHECK(k_pages.is_contiguous() && v_pages.is_contiguous(), name, ": pages");
  TORCH_CHECK(k_pages.size(3) == q.size(2), name, ": head_dim");
  torch::Tensor qc = q.contiguous(), tables = block_tables.contiguous(), lens = context_lens.contiguous();
  torch::Tensor out = torch::empty_like(qc);
  AttentionProblem p{};
  p.k = reinterpret_cast<const uint16_t*>(k_pages.data_ptr<at::BFloat16>());
  p.v = reinterpret_cast<const uint16_t*>(v_pages.data_ptr<at::BFloat16>());
  p.num_heads = q.size(1);
  p.num_kv_heads = k_pages.size(2);
  p.head_dim = q.size(2);
  p.block_size = k_pages.size(1);
  p.page_stride = p.block_size * p.num_kv_heads * p.head_dim;
  p.scale = static_cast<float>(scale);
  run_decode_attention(p, qc, tables, lens, out, k_pages.size(0), name);
  return out;
}

// q [B, Hq, D] bf16; k_raw/v_raw [N, page_bytes] uint8 fp8 pages: codes [block_size, kv_heads, head_dim] e4m3 at
// byte 0, scales [kv_heads] fp32 at byte scale_offset (value = e4m3(code) * scale[h]); block_tables [B, nb]
// int64; context_lens [B] int64 -> [B, Hq, D] bf16. Blocks and slots past a row's context are never read.
torch::Tensor decode_attention_fp8(torch::Tensor q, torch::Tensor k_raw, torch::Tensor v_raw, int64_t scale_offset,
                                  int64_t block_size, int64_t kv_heads, int64_t head_dim, torch::Tensor block_tables,
                                  torch::Tensor context_lens, double scale) {
  const char* name = "decode_attention_fp8";
  check_decode_inputs(q, block_tables, context_lens, name);
  TORCH_CHECK(k_raw.dim() == 2 && k_raw.sizes() == v_raw.sizes(), name, ": shapes");
  TORCH_CHECK(k_raw.scalar_type() == at::kByte && v_raw.scalar_type() == at::kByte, name, ": pages must be uint8");
  TORCH_CHECK(k_raw.is_contiguous() && v_raw.is_contiguous(), name, ": pages");
  TORCH_CHECK(q.size(2) == head_dim && block_size >= 1 && kv_heads >= 1, name, ": head_dim");
  TORCH_CHECK(scale_offset >= block_size * kv_heads * head_dim &&
              scale_offset + kv_heads * static_cast<int64_t>(sizeof(float)) <= k_raw.size(1), name, ": page layout");
  torch::Tensor qc = q.contiguous(), tables = block_tables.contiguous(), lens = context_lens.contiguous();
  torch::Tensor out = torch::empty_like(qc);
  AttentionProblem p{};
  p.k8 = k_raw.data_ptr<uint8_t>();
  p.v8 = v_raw.data_ptr<uint8_t>();
  p.num_heads = q.size(1);
  p.num_kv_heads = kv_heads;
  p.head_dim = head_dim;
  p.block_size = block_size;
  p.page_stride = k_raw.size(1);
  p.scale_offset = scale_offset;
  p.scale = static_cast<float>(scale);
  run_decode_attention(p, qc, tables, lens, out, k_raw.size(0), name);
  return out;
}

// ---- Fused elementwise ops of a decoder layer ----------------------------------------------------------------
// Each reproduces a chain of torch bf16 ops: every intermediate a torch op would store is rounded to bf16
// here too, so the results match torch's to the bit except where an fp32 sum order (RMSNorm's mean) or exp
// (SiLU) differs in the last fp32 bit and that flips a rounding.

namespace {

constexpr int64_t kElementsPerTask = 1 << 15;  // smaller inputs run on the calling thread: a fork costs more

// Runs fn(row_begin, row_end) over `rows` rows of `width` elements.
template <typename Fn>
void for_rows(int64_t rows, int64_t width, const Fn& fn) {
  at::parallel_for(0, rows, std::max<int64_t>(1, kElementsPerTask / std::max<int64_t>(1, width)), fn);
}

const uint16_t* bf16_data(const torch::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
}
uint16_t* bf16_data_mut(torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

void check_rows(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == at::kBFloat16 && t.stride(1) == 1, what,
              ": a bf16 [rows, width] tensor with unit stride");
}

// One row: sum = bf16(x + residual) when a residual is given (else sum = x), then
// out = bf16(w * bf16(sum * rsqrt(mean(sum^2) + eps))).
void rms_norm_row(const uint16_t* x, const uint16_t* residual, const uint16_t* weight, uint16_t* sum, uint16_t* out,
                  int64_t n, float eps) {
  int64_t i = 0;
  float squares = 0.f;
#if defined(CPU_EXT_AVX512)
  __m512 acc = _mm512_setzero_ps();
  for (; i < n; i += 16) {
    const __mmask16 m = lanes_below(n - i);
    __m512 r = load_bf16x16(x + i, m);
    if (residual) {
      r = round_bf16x16(_mm512_add_ps(r, load_bf16x16(residual + i, m)));
      store_bf16x16(sum + i, r, m);
    }
    acc = _mm512_fmadd_ps(r, r, acc);
  }
  squares = _mm512_reduce_add_ps(acc);
#else
  for (; i < n; ++i) {
    float r = bf16_to_float(x[i]);
    if (residual) sum[i] = float_to_bf16(r = round_bf16(r + bf16_to_float(residual[i])));
    squares += r * r;
  }
#endif
  const float inv = 1.f / std::sqrt(squares / static_cast<float>(n) + eps);
  const uint16_t* r = residual ? sum : x;
  i = 0;
#if defined(CPU_EXT_AVX512)
  for (; i < n; i += 16) {
    const __mmask16 m = lanes_below(n - i);
    const __m512 normed = round_bf16x16(_mm512_mul_ps(load_bf16x16(r + i, m), _mm512_set1_ps(inv)));
    store_bf16x16(out + i, _mm512_mul_ps(load_bf16x16(weight + i, m), normed), m);
  }
#endif
  for (; i < n; ++i) out[i] = float_to_bf16(bf16_to_float(weight[i]) * round_bf16(bf16_to_float(r[i]) * inv));
}

}  // namespace

// x [T, H] bf16, residual [T, H] bf16 or empty, weight [H] bf16 -> (normed [T, H], x + residual [T, H]; x itself
// when residual is empty). RMSNorm as engine/model/llama.py computes it, with the residual add before it fused.
std::vector<torch::Tensor> rms_norm_bf16(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check_rows(x, "rms_norm_bf16: x");
  const bool add = residual.numel() > 0;
  if (add) {
    check_rows(residual, "rms_norm_bf16: residual");
    TORCH_CHECK(residual.sizes() == x.sizes(), "rms_norm_bf16: residual shape");
  }
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() && weight.numel() == x.size(1),
              "rms_norm_bf16: weight");
  const int64_t rows = x.size(0), n = x.size(1);
  torch::Tensor out = torch::empty({rows, n}, x.options());
  torch::Tensor sum = add ? torch::empty({rows, n}, x.options()) : x;
  const uint16_t *xp = bf16_data(x), *rp = add ? bf16_data(residual) : nullptr, *wp = bf16_data(weight);
  uint16_t *sp = add ? bf16_data_mut(sum) : nullptr, *op = bf16_data_mut(out);
  const int64_t xs = x.stride(0), rs = add ? residual.stride(0) : 0;
  for_rows(rows, n, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      rms_norm_row(xp + t * xs, add ? rp + t * rs : nullptr, wp, add ? sp + t * n : nullptr, op + t * n, n,
                   static_cast<float>(eps));
  });
  return {out, sum};
}

// gate_up [T, 2I] bf16 (gate | up) -> bf16(bf16(silu(gate)) * up) [T, I], as F.silu(gate) * up.
torch::Tensor silu_mul_bf16(torch::Tensor gate_up) {
  check_rows(gate_up, "silu_mul_bf16: gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_mul_bf16: odd width");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2, stride = gate_up.stride(0);
  torch::Tensor out = torch::empty({rows, n}, gate_up.options());
  const uint16_t* in = bf16_data(gate_up);
  uint16_t* op = bf16_data_mut(out);
  for_rows(rows, 2 * n, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint16_t *gate = in + t * stride, *up = gate + n;
      uint16_t* o = op + t * n;
      int64_t i = 0;
#if defined(CPU_EXT_AVX512)
      for (; i < n; i += 16) {
        const __mmask16 m = lanes_below(n - i);
        const __m512 g = load_bf16x16(gate + i, m);  // silu(g) = g / (1 + exp(-g)), as torch computes it
        const __m512 exp_minus_g = exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
        const __m512 silu = round_bf16x16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp_minus_g)));
        store_bf16x16(o + i, _mm512_mul_ps(silu, load_bf16x16(up + i, m)), m);
      }
#endif
      for (; i < n; ++i) {
        const float g = bf16_to_float(gate[i]);
        o[i] = float_to_bf16(round_bf16(g / (1.f + std::exp(-g))) * bf16_to_float(up[i]));
      }
    }
  });
  return out;
}

// In place on the first `heads` heads of every row of x [T, >= heads * D] bf16 (q then k of a fused qkv
// output): rotary embedding in the half-split layout with cos, sin [T, D/2] bf16, rounding as apply_rotary's
// torch ops do: x1' = bf16(bf16(x1 cos) - bf16(x2 sin)), x2' = bf16(bf16(x2 cos) + bf16(x1 sin)).
void rotary_bf16_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t heads, int64_t head_dim) {
  check_rows(x, "rotary_bf16_: x");
  check_rows(cos, "rotary_bf16_: cos");
  check_rows(sin, "rotary_bf16_: sin");
  const int64_t rows = x.size(0), half = head_dim / 2;
  TORCH_CHECK(head_dim % 2 == 0 && heads * head_dim <= x.size(1), "rotary_bf16_: heads");
  TORCH_CHECK(cos.size(0) == rows && sin.size(0) == rows && cos.size(1) == half && sin.size(1) == half,
              "rotary_bf16_: cos/sin shape");
  uint16_t* xp = bf16_data_mut(x);
  const uint16_t *cp = bf16_data(cos), *sp = bf16_data(sin);
  const int64_t xs = x.stride(0), cs = cos.stride(0), ss = sin.stride(0);
  for_rows(rows, heads * head_dim, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint16_t *c = cp + t * cs, *s = sp + t * ss;
      for (int64_t h = 0; h < heads; ++h) {
        uint16_t* x1 = xp + t * xs + h * head_dim;
        uint16_t* x2 = x1 + half;
        int64_t i = 0;
#if defined(CPU_EXT_AVX512)
        for (; i < half; i += 16) {
          const __mmask16 m = lanes_below(half - i);
          const __m512 a = load_bf16x16(x1 + i, m), b = load_bf16x16(x2 + i, m);
          const __m512 cv = load_bf16x16(c + i, m), sv = load_bf16x16(s + i, m);
          const __m512 first = _mm512_sub_ps(round_bf16x16(_mm512_mul_ps(a, cv)), round_bf16x16(_mm512_mul_ps(b, sv)));
          const __m512 second = _mm512_add_ps(round_bf16x16(_mm512_mul_ps(b, cv)), round_bf16x16(_mm512_mul_ps(a, sv)));
          store_bf16x16(x1 + i, first, m);
          store_bf16x16(x2 + i, second, m);
        }
#endif
        for (; i < half; ++i) {
          const float a = bf16_to_float(x1[i]), b = bf16_to_float(x2[i]);
          const float cv = bf16_to_float(c[i]), sv = bf16_to_float(s[i]);
          x1[i] = float_to_bf16(round_bf16(a * cv) - round_bf16(b * sv));
          x2[i] = float_to_bf16(round_bf16(b * cv) + round_bf16(a * sv));
        }
      }
    }
  });
}

void bind_decode_stack(pybind11::module& m);  // decode_stack.cpp

// The pybind module holds the decode stack only (a class whose forward takes the step's list of page pairs); the
// kernels are torch operators, torch.ops.phase_serve.*, declared below with their schemas.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { bind_decode_stack(m); }

namespace {

torch::Tensor or_empty(const std::optional<torch::Tensor>& t) { return t ? *t : torch::empty({0}); }

torch::Tensor linear_op(torch::Tensor x, torch::Tensor weight, const std::optional<torch::Tensor>& bias,
                        bool fp32_out) {
  return linear_bf16(std::move(x), std::move(weight), or_empty(bias), fp32_out);
}

std::tuple<torch::Tensor, torch::Tensor> rms_norm_op(torch::Tensor x, const std::optional<torch::Tensor>& residual,
                                                     torch::Tensor weight, double eps) {
  std::vector<torch::Tensor> out = rms_norm_bf16(std::move(x), or_empty(residual), std::move(weight), eps);
  return {out[0], out[1]};
}

bool vectorized() {
#if defined(CPU_EXT_AVX512)
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY(phase_serve, m) {
  m.def("linear_bf16(Tensor x, Tensor weight, Tensor? bias, bool fp32_out=False) -> Tensor");
  m.def("decode_attention_bf16(Tensor q, Tensor k_pages, Tensor v_pages, Tensor block_tables, Tensor context_lens, "
        "float scale) -> Tensor");
  m.def("decode_attention_fp8(Tensor q, Tensor k_raw, Tensor v_raw, int scale_offset, int block_size, int kv_heads, "
        "int head_dim, Tensor block_tables, Tensor context_lens, float scale) -> Tensor");
  m.def("rms_norm_bf16(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_mul_bf16(Tensor gate_up) -> Tensor");
  m.def("rotary_bf16_(Tensor(a!) x, Tensor cos, Tensor sin, int heads, int head_dim) -> ()");
  m.def("vectorized() -> bool", &vectorized);
}

TORCH_LIBRARY_IMPL(phase_serve, CPU, m) {
  m.impl("linear_bf16", &linear_op);
  m.impl("decode_attention_bf16", &decode_attention_bf16);
  m.impl("decode_attention_fp8", &decode_attention_fp8);
  m.impl("rms_norm_bf16", &rms_norm_op);
  m.impl("silu_mul_bf16", &silu_mul_bf16);
  m.impl("rotary_bf16_", &rotary_bf16_);
}
