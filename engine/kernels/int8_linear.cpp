// Products on int8 weights with one fp32 scale per output channel (engine/model/quant.py), for decode-sized row
// counts, two kernels:
// - linear_int8: each weight row is read once as int8 (half the bytes of bf16) and widened to fp32 in registers,
//   the sum runs in fp32 against the fp32 activations, and the channel's scale (then the bias) is applied to the
//   sum at the end, with one rounding to bf16. Bound by its widening ops, not by memory, on AVX-512 hosts.
// - linear_w8a8 (below): the activations quantised to int8 in groups of 32, int32 sums by AVX-512 VNNI on a
//   packed copy of the weight; 1.3-3x faster than linear_int8 at 1-64 rows, so the backend takes it wherever
//   VNNI was built in and keeps linear_int8 as the fallback.
// Larger row counts (prefill) dequantise the weight to bf16 and take F.linear (engine/backends/cpu_kernels.py).
// Figures: docs/performance.md, "int8 weights" (python -m bench.weight_quant).
//
// out[m, n] = bf16(scale[n] * sum_k x[m, k] * w[n, k] + bias[n]); each row's result depends on that row only.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "activation_quant.h"
#include "parallel.h"
#include "vec.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define CPU_EXT_INT8_AVX512 1
#include <immintrin.h>
#if defined(__AVX512VNNI__)
#define CPU_EXT_INT8_VNNI 1
#endif
#endif

namespace {

using cpu_ext::QuantRows;
using cpu_ext::OutRows;
using cpu_ext::out_rows;
using cpu_ext::output_rows;

constexpr int kMaxRows = 8;  // rows of x per pass: R accumulator sets stay in registers

// Output channels [begin, end) for R rows of x (fp32 [R, k]). Each weight vector of 16 int8 is widened once and
// used for all R rows; A independent accumulators per row hide the FMA latency at small R.
template <int R>
void int8_rows(const int8_t* w, const float* x, const float* scale, const float* bias, OutRows out, int64_t n,
               int64_t k, int64_t begin, int64_t end) {
  for (int64_t row = begin; row < end; ++row) {
    const int8_t* wr = w + row * k;
    float total[R];
    int64_t i = 0;
#if defined(CPU_EXT_INT8_AVX512)
    constexpr int A = R <= 4 ? 4 : 2;
    __m512 acc[R][A];
    for (int r = 0; r < R; ++r)
      for (int a = 0; a < A; ++a) acc[r][a] = _mm512_setzero_ps();
    for (; i + 16 * A <= k; i += 16 * A) {
      for (int a = 0; a < A; ++a) {
        const __m512 wv =
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(wr + i + 16 * a))));
        for (int r = 0; r < R; ++r) acc[r][a] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + r * k + i + 16 * a), acc[r][a]);
      }
    }
    for (; i < k; i += 16) {
      const __mmask16 mask = cpu_ext::lanes_below(k - i);
      const __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, wr + i)));
      for (int r = 0; r < R; ++r) acc[r][0] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(mask, x + r * k + i), acc[r][0]);
    }
    for (int r = 0; r < R; ++r) {
      __m512 sum = acc[r][0];
      for (int a = 1; a < A; ++a) sum = _mm512_add_ps(sum, acc[r][a]);
      total[r] = _mm512_reduce_add_ps(sum);
    }
#else
    for (int r = 0; r < R; ++r) total[r] = 0.f;
    for (; i < k; ++i) {
      const float wv = static_cast<float>(wr[i]);
      for (int r = 0; r < R; ++r) total[r] += wv * x[r * k + i];
    }
#endif
    const float b = bias ? bias[row] : 0.f;
    for (int r = 0; r < R; ++r) out.put(r * n + row, total[r] * scale[row] + b);
  }
}

void int8_pass(int64_t rows, const int8_t* w, const float* x, const float* scale, const float* bias, OutRows out,
               int64_t n, int64_t k, int64_t begin, int64_t end) {
  switch (rows) {
    case 1: int8_rows<1>(w, x, scale, bias, out, n, k, begin, end); break;
    case 2: int8_rows<2>(w, x, scale, bias, out, n, k, begin, end); break;
    case 3: int8_rows<3>(w, x, scale, bias, out, n, k, begin, end); break;
    case 4: int8_rows<4>(w, x, scale, bias, out, n, k, begin, end); break;
    case 5: int8_rows<5>(w, x, scale, bias, out, n, k, begin, end); break;
    case 6: int8_rows<6>(w, x, scale, bias, out, n, k, begin, end); break;
    case 7: int8_rows<7>(w, x, scale, bias, out, n, k, begin, end); break;
    default: int8_rows<8>(w, x, scale, bias, out, n, k, begin, end); break;
  }
}

// ---- W8A8: int8 activations against the int8 weights, int32 sums (AVX-512 VNNI) -------------------------------
//
// Each row of x is quantised as it comes in, in groups of 32 along K (activation_quant.h: scales a[m, g],
// codes q[m, k]). Then
//   out[m, n] = bf16(s[n] * sum_g a[m, g] * float(sum_{k in g} q[m, k] w[n, k]) + bias[n]),
// each group's sum exact in int32, the sum over groups in fp32 (fused multiply-adds, in group order).
// The weights come packed once (engine/model/quant.py pack_w8a8): 16 output channels x 4 consecutive k per
// 64-byte vector, stored as w + 128 (unsigned), so one vpdpbusd adds 4 products into each channel's lane against
// a broadcast dword of 4 activation codes, and no horizontal sums are needed. vpdpbusd multiplies unsigned by
// signed bytes: sum (w + 128) q = sum w q + 128 sum q, so each group's 128 * sum q is subtracted before scaling.

constexpr int64_t kGroup = cpu_ext::kActGroup;  // activation codes per scale
constexpr int64_t kChannels = 16;  // output channels per packed block (one int32 lane each)

// Stores channels [n0, n0 + 16) of R rows from their fp32 sums (before s and bias); channels past n are padding.
template <int R>
void w8a8_store(const float (&sums)[R][kChannels], const QuantRows& q, int64_t first, const float* scale,
                const float* bias, OutRows out, int64_t n, int64_t n0) {
  const int64_t count = std::min<int64_t>(kChannels, n - n0);
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < count; ++j)
      out.put((first + r) * n + n0 + j, sums[r][j] * scale[n0 + j] + (bias ? bias[n0 + j] : 0.f));
}

// Blocks [begin, end) of 16 channels for rows [first, first + R), C blocks at a time: R * C int32 and fp32
// accumulators, so that at one row C independent vpdpbusd chains hide its latency; each weight vector is read
// once for the R rows.
template <int R, int C>
void w8a8_blocks(const uint8_t* packed, const QuantRows& q, int64_t first, const float* scale, const float* bias,
                 OutRows out, int64_t n, int64_t block) {
  const int64_t block_bytes = q.kp * kChannels;
  float sums[C][R][kChannels];
#if defined(CPU_EXT_INT8_VNNI)
  __m512 accf[C][R];
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) accf[c][r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < q.groups; ++g) {
    __m512i acc[C][R];
    for (int c = 0; c < C; ++c)
      for (int r = 0; r < R; ++r) acc[c][r] = _mm512_setzero_si512();
    for (int64_t t = 0; t < kGroup / 4; ++t) {
      const int64_t k4 = g * kGroup / 4 + t;
      for (int c = 0; c < C; ++c) {
        const __m512i wv = _mm512_loadu_si512(packed + (block + c) * block_bytes + k4 * 64);
        for (int r = 0; r < R; ++r) {
          int32_t quad;
          std::memcpy(&quad, q.codes.data() + (first + r) * q.kp + k4 * 4, 4);
          acc[c][r] = _mm512_dpbusd_epi32(acc[c][r], wv, _mm512_set1_epi32(quad));
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512i corr = _mm512_set1_epi32(128 * q.sums[(first + r) * q.groups + g]);
      const __m512 a = _mm512_set1_ps(q.scale[(first + r) * q.groups + g]);
      for (int c = 0; c < C; ++c)
        accf[c][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[c][r], corr)), a, accf[c][r]);
    }
  }
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(sums[c][r], accf[c][r]);
#else
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r)
      for (int64_t j = 0; j < kChannels; ++j) {
        float total = 0.f;
        for (int64_t g = 0; g < q.groups; ++g) {
          int32_t sum = 0;
          for (int64_t i = g * kGroup; i < (g + 1) * kGroup; ++i)
            sum += static_cast<int32_t>(packed[(block + c) * block_bytes + (i / 4) * 64 + j * 4 + i % 4]) *
                   q.codes[(first + r) * q.kp + i];
          total = std::fma(static_cast<float>(sum - 128 * q.sums[(first + r) * q.groups + g]),
                           q.scale[(first + r) * q.groups + g], total);
        }
        sums[c][r][j] = total;
      }
#endif
  for (int c = 0; c < C; ++c) w8a8_store<R>(sums[c], q, first, scale, bias, out, n, (block + c) * kChannels);
}

template <int R>
void w8a8_rows(const uint8_t* packed, const QuantRows& q, int64_t first, const float* scale, const float* bias,
               OutRows out, int64_t n, int64_t begin, int64_t end) {
  constexpr int C = R == 1 ? 4 : R == 2 ? 2 : 1;
  int64_t block = begin;
  for (; block + C <= end; block += C) w8a8_blocks<R, C>(packed, q, first, scale, bias, out, n, block);
  for (; block < end; ++block) w8a8_blocks<R, 1>(packed, q, first, scale, bias, out, n, block);
}

void w8a8_pass(int64_t rows, const uint8_t* packed, const QuantRows& q, int64_t first, const float* scale,
               const float* bias, OutRows out, int64_t n, int64_t begin, int64_t end) {
  switch (rows) {
    case 1: w8a8_rows<1>(packed, q, first, scale, bias, out, n, begin, end); break;
    case 2: w8a8_rows<2>(packed, q, first, scale, bias, out, n, begin, end); break;
    case 3: w8a8_rows<3>(packed, q, first, scale, bias, out, n, begin, end); break;
    case 4: w8a8_rows<4>(packed, q, first, scale, bias, out, n, begin, end); break;
    case 5: w8a8_rows<5>(packed, q, first, scale, bias, out, n, begin, end); break;
    case 6: w8a8_rows<6>(packed, q, first, scale, bias, out, n, begin, end); break;
    case 7: w8a8_rows<7>(packed, q, first, scale, bias, out, n, begin, end); break;
    default: w8a8_rows<8>(packed, q, first, scale, bias, out, n, begin, end); break;
  }
}

}  // namespace

// x [M, K] bf16, weight [N, K] int8 (contiguous), scale [N] fp32, bias [N] (any float dtype) or None
// -> [M, N] bf16 (fp32 with fp32_out). Threads claim ranges of output channels (parallel.h); within its range a thread runs every
// pass of 8 rows of x, so a range's weights come from memory once and from cache for the later passes.
torch::Tensor linear_int8(torch::Tensor x, torch::Tensor weight, torch::Tensor scale,
                          const std::optional<torch::Tensor>& bias, bool fp32_out) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "linear_int8: shapes");
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.is_contiguous(), "linear_int8: weight must be int8");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 1 && scale.size(0) == weight.size(0) &&
                  scale.is_contiguous(), "linear_int8: scale must be fp32 [N]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "linear_int8: x must be bf16");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  torch::Tensor out = output_rows(x, m, n, fp32_out);
  if (m == 0 || n == 0) return out;
  torch::Tensor xf = x.to(torch::kFloat32).contiguous();
  const cpu_ext::FloatBias bf = cpu_ext::float_bias(bias, n, "linear_int8");
  const int8_t* w = weight.data_ptr<int8_t>();
  const float* xp = xf.data_ptr<float>();
  const float* sp = scale.data_ptr<float>();
  const float* bp = bf.data();
  const OutRows op = out_rows(out);
  cpu_ext::parallel_claim(n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t first = 0; first < m; first += kMaxRows)
      int8_pass(std::min<int64_t>(kMaxRows, m - first), w, xp + first * k, sp, bp, op.shifted(first * n), n, k, begin, end);
  });
  return out;
}

// x [M, K] bf16, packed [ceil(N / 16), ceil(K / 32) * 8, 16, 4] uint8 (pack_w8a8 of the int8 weight [N, K]),
// scale [N] fp32, bias [N] or None -> [M, N] bf16 or (fp32_out) fp32 (W8A8 above). x is quantised once, before the threads, which
// claim ranges of 16-channel blocks and run every pass of 8 rows of x over their range, as linear_int8's do.
torch::Tensor linear_w8a8(torch::Tensor x, torch::Tensor packed, torch::Tensor scale,
                          const std::optional<torch::Tensor>& bias, bool fp32_out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "linear_w8a8: x must be bf16 [M, K]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 1 && scale.is_contiguous(),
              "linear_w8a8: scale must be fp32 [N]");
  const int64_t m = x.size(0), k = x.size(1), n = scale.size(0);
  const int64_t blocks = (n + kChannels - 1) / kChannels, groups = (k + kGroup - 1) / kGroup;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 4 &&
                  packed.size(0) == blocks && packed.size(1) == groups * kGroup / 4 && packed.size(2) == kChannels &&
                  packed.size(3) == 4,
              "linear_w8a8: packed must be pack_w8a8's uint8 [ceil(N / 16), ceil(K / 32) * 8, 16, 4] for K = ", k);
  torch::Tensor out = output_rows(x, m, n, fp32_out);
  if (m == 0 || n == 0) return out;
  torch::Tensor xf = x.to(torch::kFloat32).contiguous();
  const QuantRows q = cpu_ext::quantize_activations(xf.data_ptr<float>(), m, k);
  const cpu_ext::FloatBias bf = cpu_ext::float_bias(bias, n, "linear_w8a8");
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* bp = bf.data();
  const OutRows op = out_rows(out);
  cpu_ext::parallel_claim(blocks, 4, [&](int64_t begin, int64_t end) {
    for (int64_t first = 0; first < m; first += kMaxRows)
      w8a8_pass(std::min<int64_t>(kMaxRows, m - first), pp, q, first, sp, bp, op, n, begin, end);
  });
  return out;
}

// Whether linear_w8a8 runs on VNNI here (else on its scalar loop, which only tests should take).
bool w8a8_vnni() {
#if defined(CPU_EXT_INT8_VNNI)
  return true;
#else
  return false;
#endif
}

TORCH_LIBRARY_FRAGMENT(phase_serve, m) {
  m.def("linear_int8(Tensor x, Tensor weight, Tensor scale, Tensor? bias, bool fp32_out=False) -> Tensor");
  m.def("linear_w8a8(Tensor x, Tensor packed, Tensor scale, Tensor? bias, bool fp32_out=False) -> Tensor");
  m.def("w8a8_vnni() -> bool", &w8a8_vnni);
}

TORCH_LIBRARY_IMPL(phase_serve, CPU, m) {
  m.impl("linear_int8", &linear_int8);
  m.impl("linear_w8a8", &linear_w8a8);
}
