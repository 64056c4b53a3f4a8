// Products on int8g weights (engine/backends/weight_ops.py): int8 codes q [N, Kp] (Kp = G * 16, zero past K) and
// fp32 scales [S, N, G], S = 1 (scales s) or 2 (scales s, offsets z), per group of 16 along K; the weight is
// w = s q, or s q + z rounded once in fp32: a GGUF file's values exactly (engine/model/gguf_int8g.py).
// - linear_int8g: decode-sized row counts, weight-only. Each group's 16 codes are widened to fp32 and scaled in
//   registers (one FMA with the offset: s q is exact, so it rounds where gguf's float32 s q + z does), then
//   multiplied into fp32 sums against the fp32 activations. The weights are the file's; only the sums round.
// - linear_int8g_bf16: the weight-only product for many rows on AVX-512 BF16 dot products (bf16_dots.h): the
//   codes, exact in bf16, widened once per call; s q + z is never rounded (the sums are s dot + z t).
// - dequantize_int8g: rows of the weight to bf16, for the larger row counts that take at::linear (prefill).
//
// out[m, n] = bf16(sum_k w[n, k] x[m, k] + bias[n]); each row's result depends on that row only.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>

#include "activation_quant.h"
#include "bf16_dots.h"
#include "parallel.h"
#include "vec.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define CPU_EXT_INT8G_AVX512 1
#include <immintrin.h>
#endif

namespace {

using cpu_ext::OutRows;
using cpu_ext::out_rows;
using cpu_ext::output_rows;

constexpr int64_t kGroup = 16;  // weights per scale (and offset)
constexpr int kRows = 4;        // rows of x per pass: R x 2 accumulators stay in registers
constexpr int64_t kAhead = 1024;  // bytes of codes fetched ahead of the product

struct GroupedWeights {
  const int8_t* codes;   // [N, kp]
  const float* scale;    // [N, groups]
  const float* offset;   // [N, groups], or null
  const float* bias;     // [N], or null
  int64_t n, kp, groups;
};

// x at p as fp32, one value or (x_vector) 16: bf16 widens exactly.
inline float x_value(const float* p) { return *p; }
inline float x_value(const uint16_t* p) { return cpu_ext::bf16_to_float(*p); }
#if defined(CPU_EXT_INT8G_AVX512)
inline __m512 x_vector(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 x_vector(const uint16_t* p) { return cpu_ext::load_bf16x16(p); }
#endif

// Output channels [begin, end) for R rows of x ([R, kp], zero past K; bf16 bits or fp32). Each group's weights
// are made once and used for all R rows; two accumulators per row alternate between groups to hide the FMA
// latency. x stays bf16 when it comes as bf16 (widened exactly in registers) and the codes are fetched kAhead
// bytes ahead as non-temporal, so that the stream does not push x out of L1: at K = 8192 a row of fp32 x alone
// fills Zen 4's 32 KB L1. Measured in the engine: docs/performance.md, "int8g: x kept in L1".
template <int R, bool Offsets, typename X>
void int8g_rows(const GroupedWeights& w, const X* x, OutRows out, int64_t begin, int64_t end) {
  for (int64_t row = begin; row < end; ++row) {
    const int8_t* q = w.codes + row * w.kp;
    const float* s = w.scale + row * w.groups;
    const float* z = Offsets ? w.offset + row * w.groups : nullptr;
    float total[R];
#if defined(CPU_EXT_INT8G_AVX512)
    __m512 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const auto group = [&](int64_t g, int h) {  // h = g & 1, a constant in each call: acc stays in registers
      const __m512 codes = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + g * kGroup))));
      const __m512 weights = Offsets ? _mm512_fmadd_ps(codes, _mm512_set1_ps(s[g]), _mm512_set1_ps(z[g]))
                                     : _mm512_mul_ps(codes, _mm512_set1_ps(s[g]));
      for (int r = 0; r < R; ++r)
        acc[r][h] = _mm512_fmadd_ps(weights, x_vector(x + r * w.kp + g * kGroup), acc[r][h]);
    };
    const char* ahead = reinterpret_cast<const char*>(q) + kAhead;  // rows are contiguous: past one is the next
    int64_t g = 0;
    for (; g + 2 <= w.groups; g += 2) {
      if ((g & 3) == 0) _mm_prefetch(ahead + g * kGroup, _MM_HINT_NTA);  // one 64-byte line per 4 groups
      group(g, 0);
      group(g + 1, 1);
    }
    if (g < w.groups) group(g, 0);
    for (int r = 0; r < R; ++r) total[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
#else
    for (int r = 0; r < R; ++r) total[r] = 0.f;
    for (int64_t g = 0; g < w.groups; ++g)
      for (int64_t i = 0; i < kGroup; ++i) {
        const float code = static_cast<float>(q[g * kGroup + i]);
        const float weight = Offsets ? std::fma(code, s[g], z[g]) : code * s[g];
        for (int r = 0; r < R; ++r) total[r] = std::fma(weight, x_value(x + r * w.kp + g * kGroup + i), total[r]);
      }
#endif
    const float b = w.bias ? w.bias[row] : 0.f;
    for (int r = 0; r < R; ++r) out.put(r * w.n + row, total[r] + b);
  }
}

template <bool Offsets, typename X>
void int8g_pass(int64_t rows, const GroupedWeights& w, const X* x, OutRows out, int64_t begin, int64_t end) {
  switch (rows) {
    case 1: int8g_rows<1, Offsets>(w, x, out, begin, end); break;
    case 2: int8g_rows<2, Offsets>(w, x, out, begin, end); break;
    case 3: int8g_rows<3, Offsets>(w, x, out, begin, end); break;
    default: int8g_rows<4, Offsets>(w, x, out, begin, end); break;
  }
}

// Every pass of kRows rows of x ([m, kp]) over the output channels: the threads claim ranges of channels and run
// every pass over their range, so a range's weights come from memory once and from cache for the later passes.
template <typename X>
void int8g_product(const GroupedWeights& w, const X* x, int64_t m, OutRows out) {
  cpu_ext::parallel_claim(w.n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t first = 0; first < m; first += kRows) {
      const int64_t rows = std::min<int64_t>(kRows, m - first);
      if (w.offset) int8g_pass<true>(rows, w, x + first * w.kp, out.shifted(first * w.n), begin, end);
      else int8g_pass<false>(rows, w, x + first * w.kp, out.shifted(first * w.n), begin, end);
    }
  });
}

void check_int8g(const torch::Tensor& codes, const torch::Tensor& scales, int64_t k, const char* name) {
  const int64_t groups = (k + kGroup - 1) / kGroup;
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.dim() == 2 && codes.is_contiguous() &&
                  codes.size(1) == groups * kGroup,
              name, ": codes must be int8 [N, ceil(K / 16) * 16] for K = ", k);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 3 && scales.is_contiguous() &&
                  (scales.size(0) == 1 || scales.size(0) == 2) && scales.size(1) == codes.size(0) &&
                  scales.size(2) == groups,
              name, ": scales must be fp32 [1 or 2, N, ceil(K / 16)]");
}

#if defined(CPU_EXT_BF16_DOTS)
// 16 vectors of 16 dwords transposed: r[i] lane j <- r[j] lane i (dword unpacks, then 128-bit lane shuffles).
inline void transpose16(__m512i (&r)[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int a = 0; a < 16; a += 4) {  // u[a + q], lane L: column 4L + q of rows a..a + 3
    u[a] = _mm512_unpacklo_epi64(t[a], t[a + 2]);
    u[a + 1] = _mm512_unpackhi_epi64(t[a], t[a + 2]);
    u[a + 2] = _mm512_unpacklo_epi64(t[a + 1], t[a + 3]);
    u[a + 3] = _mm512_unpackhi_epi64(t[a + 1], t[a + 3]);
  }
  for (int q = 0; q < 4; ++q) {
    t[q] = _mm512_shuffle_i32x4(u[q], u[q + 4], 0x88);
    t[q + 4] = _mm512_shuffle_i32x4(u[q], u[q + 4], 0xDD);
    t[q + 8] = _mm512_shuffle_i32x4(u[q + 8], u[q + 12], 0x88);
    t[q + 12] = _mm512_shuffle_i32x4(u[q + 8], u[q + 12], 0xDD);
  }
  for (int q = 0; q < 4; ++q) {
    r[q] = _mm512_shuffle_i32x4(t[q], t[q + 8], 0x88);
    r[q + 4] = _mm512_shuffle_i32x4(t[q + 4], t[q + 12], 0x88);
    r[q + 8] = _mm512_shuffle_i32x4(t[q], t[q + 8], 0xDD);
    r[q + 12] = _mm512_shuffle_i32x4(t[q + 4], t[q + 12], 0xDD);
  }
}

// Groups [g0, g0 + count) of block `block` (channels 16 block ..) -> codes [count, 8 pairs, 16 channels] and scales
// [count, 2, 16], two groups at a time: each channel's 32 codes widened to fp32 (exact) and packed to 16 bf16 pairs
// (exact too), then the 16 channels' vectors transposed so that each holds one pair of all 16; zero past channel N.
void widen_int8g(const GroupedWeights& w, int64_t block, int64_t g0, int64_t count, uint32_t* codes, float* scales) {
  const int64_t n0 = block * 16, live_rows = std::min<int64_t>(16, w.n - n0);
  const __mmask16 live = cpu_ext::lanes_below(live_rows);
  const __m512i row_groups = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                _mm512_set1_epi32(static_cast<int32_t>(w.groups)));
  // The next pair of blocks' codes, into L2 under this pair's products, a line a row at a time: 16 rows read side
  // by side stall on memory (a 49152-row head widened at 5.9 G codes/s without, 8.2 with, 12 from cache).
  const int64_t next = n0 + cpu_ext::dots::kBlocks * 16, ahead = std::clamp<int64_t>(w.n - next, 0, 16);
  for (int64_t i = 0; i < count; i += 2) {
    const bool second = i + 1 < count;
    if (i % 4 == 0)
      for (int64_t r = 0; r < ahead; ++r) _mm_prefetch(w.codes + (next + r) * w.kp + (g0 + i) * kGroup, _MM_HINT_T1);
    __m512i pairs[16];
    for (int64_t r = 0; r < 16; ++r) {
      if (r >= live_rows) {
        pairs[r] = _mm512_setzero_si512();
        continue;
      }
      const int8_t* q = w.codes + (n0 + r) * w.kp + (g0 + i) * kGroup;
      const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
      const __m512 b = second ? _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                    _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + kGroup))))
                              : _mm512_setzero_ps();
      pairs[r] = (__m512i)_mm512_cvtne2ps_pbh(b, a);  // dword p: the codes of k = 2p, 2p + 1
    }
    transpose16(pairs);
    for (int64_t p = 0; p < (second ? 16 : 8); ++p)
      _mm512_storeu_si512(codes + (i * kGroup / 2 + p) * 16, pairs[p]);
    for (int64_t h = 0; h < (second ? 2 : 1); ++h) {
      const int64_t g = g0 + i + h;
      float* dst = scales + (i + h) * 32;
      _mm512_storeu_ps(dst, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, row_groups,
                                                     w.scale + n0 * w.groups + g, 4));
      _mm512_storeu_ps(dst + 16, w.offset ? _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, row_groups,
                                                                     w.offset + n0 * w.groups + g, 4)
                                          : _mm512_setzero_ps());
    }
  }
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
  check_int8g(codes, scales, k, "linear_int8g");
  const int64_t n = codes.size(0), kp = codes.size(1), groups = scales.size(2);
  torch::Tensor out = output_rows(x, m, n, fp32_out);
  if (m == 0 || n == 0) return out;
  torch::Tensor xp = torch::zeros({m, kp}, x.options());  // padded past K with zeros, in x's own dtype
  xp.narrow(1, 0, k).copy_(x);
  const cpu_ext::FloatBias bf = cpu_ext::float_bias(bias, n, "linear_int8g");
  const float* sp = scales.data_ptr<float>();
  const GroupedWeights w{codes.data_ptr<int8_t>(), sp, scales.size(0) == 2 ? sp + n * groups : nullptr,
                         bf.data(), n, kp, groups};
  if (x.scalar_type() == at::kBFloat16)
    int8g_product(w, reinterpret_cast<const uint16_t*>(xp.data_ptr<at::BFloat16>()), m, out_rows(out));
  else
    int8g_product(w, xp.data_ptr<float>(), m, out_rows(out));
  return out;
}

// x [M, K] bf16, codes and scales as above, bias [N] or None -> [M, N] bf16 or (fp32_out) fp32: the weight-only
// product on bf16 dot products (elsewhere linear_int8g: tests only).
torch::Tensor linear_int8g_bf16(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                                const std::optional<torch::Tensor>& bias, bool fp32_out) {
#if defined(CPU_EXT_BF16_DOTS)
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "linear_int8g_bf16: x must be bf16 [M, K]");
  const int64_t m = x.size(0), k = x.size(1);
  check_int8g(codes, scales, k, "linear_int8g_bf16");
  const int64_t n = codes.size(0), kp = codes.size(1), groups = scales.size(2);
  torch::Tensor out = output_rows(x, m, n, fp32_out);
  if (m == 0 || n == 0) return out;
  const cpu_ext::FloatBias bf = cpu_ext::float_bias(bias, n, "linear_int8g_bf16");
  const float* sp = scales.data_ptr<float>();
  const GroupedWeights w{codes.data_ptr<int8_t>(), sp, scales.size(0) == 2 ? sp + n * groups : nullptr, nullptr, n,
                         kp, groups};
  const cpu_ext::dots::PairRows rows = cpu_ext::dots::pair_rows(x, groups, kGroup, nullptr);
  const auto widen = [&](int64_t block, int64_t g0, int64_t count, uint32_t* dst, float* group_scales) {
    widen_int8g(w, block, g0, count, dst, group_scales);
  };
  const float* bp = bf.data();
  if (w.offset) cpu_ext::dots::run<kGroup / 2, true>(rows, n, bp, out_rows(out), widen);
  else cpu_ext::dots::run<kGroup / 2, false>(rows, n, bp, out_rows(out), widen);
  return out;
#else
  return linear_int8g(x, codes, scales, bias, fp32_out);
#endif
}

// Whether linear_int8g_bf16 runs on AVX-512 BF16 here (else on linear_int8g: tests only).
bool int8g_bf16_vectorized() {
#if defined(CPU_EXT_BF16_DOTS)
  return true;
#else
  return false;
#endif
}

// Output channels [begin, end) of the int8g weight of K columns -> bf16 [end - begin, K]: bf16(s q (+ z)), the fp32
// value rounded once, as weight_ops.int8g_rows computes it.
torch::Tensor dequantize_int8g(torch::Tensor codes, torch::Tensor scales, int64_t k, int64_t begin, int64_t end) {
  check_int8g(codes, scales, k, "dequantize_int8g");
  const int64_t n = codes.size(0), groups = scales.size(2);
  TORCH_CHECK(0 <= begin && begin <= end && end <= n, "dequantize_int8g: rows [", begin, ", ", end, ") of ", n);
  torch::Tensor values = codes.narrow(0, begin, end - begin).to(at::kFloat).view({end - begin, groups, kGroup});
  values.mul_(scales[0].narrow(0, begin, end - begin).unsqueeze(2));
  if (scales.size(0) == 2) values.add_(scales[1].narrow(0, begin, end - begin).unsqueeze(2));
  return values.view({end - begin, groups * kGroup}).narrow(1, 0, k).to(at::kBFloat16);
}

TORCH_LIBRARY_FRAGMENT(phase_serve, m) {
  m.def("linear_int8g(Tensor x, Tensor codes, Tensor scales, Tensor? bias, bool fp32_out=False) -> Tensor");
  m.def("dequantize_int8g(Tensor codes, Tensor scales, int k, int begin, int end) -> Tensor");
  m.def("linear_int8g_bf16(Tensor x, Tensor codes, Tensor scales, Tensor? bias, bool fp32_out=False) -> Tensor");
  m.def("int8g_bf16_vectorized() -> bool", &int8g_bf16_vectorized);
}

TORCH_LIBRARY_IMPL(phase_serve, CPU, m) {
  m.impl("linear_int8g", &linear_int8g);
  m.impl("dequantize_int8g", &dequantize_int8g);
  m.impl("linear_int8g_bf16", &linear_int8g_bf16);
}
