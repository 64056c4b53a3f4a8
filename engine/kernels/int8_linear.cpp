// Products on int8 weights with one fp32 scale per output channel (engine/model/quant.py), for decode-sized row
// counts: each weight row is read once as int8 (half the bytes of bf16) and widened to fp32 in registers, the sum
// runs in fp32 against the fp32 activations, and the channel's scale (then the bias) is applied to the sum at the
// end, with one rounding to bf16. Larger row counts (prefill) dequantise the weight to bf16 and take F.linear
// (engine/backends/cpu_kernels.py). Figures: docs/performance.md, "int8 weights" (python -m bench.weight_quant).
//
// out[m, n] = bf16(scale[n] * sum_k x[m, k] * w[n, k] + bias[n]); each row's result depends on that row only.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>

#include "parallel.h"
#include "vec.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define CPU_EXT_INT8_AVX512 1
#include <immintrin.h>
#endif

namespace {

// Round to nearest even, as torch converts float to bfloat16; NaN stays NaN.
inline uint16_t to_bf16(float value) {
  if (std::isnan(value)) return 0x7FC0;
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

constexpr int kMaxRows = 8;  // rows of x per pass: R accumulator sets stay in registers

// Output channels [begin, end) for R rows of x (fp32 [R, k]). Each weight vector of 16 int8 is widened once and
// used for all R rows; A independent accumulators per row hide the FMA latency at small R.
template <int R>
void int8_rows(const int8_t* w, const float* x, const float* scale, const float* bias, uint16_t* out, int64_t n,
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
    for (int r = 0; r < R; ++r) out[r * n + row] = to_bf16(total[r] * scale[row] + b);
  }
}

void int8_pass(int64_t rows, const int8_t* w, const float* x, const float* scale, const float* bias, uint16_t* out,
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

}  // namespace

// x [M, K] bf16, weight [N, K] int8 (contiguous), scale [N] fp32, bias [N] (any float dtype) or None
// -> [M, N] bf16. Threads claim ranges of output channels (parallel.h); within its range a thread runs every
// pass of 8 rows of x, so a range's weights come from memory once and from cache for the later passes.
torch::Tensor linear_int8(torch::Tensor x, torch::Tensor weight, torch::Tensor scale,
                          const std::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "linear_int8: shapes");
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.is_contiguous(), "linear_int8: weight must be int8");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 1 && scale.size(0) == weight.size(0) &&
                  scale.is_contiguous(), "linear_int8: scale must be fp32 [N]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "linear_int8: x must be bf16");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  torch::Tensor out = torch::empty({m, n}, x.options());
  if (m == 0 || n == 0) return out;
  torch::Tensor xf = x.to(torch::kFloat32).contiguous();
  torch::Tensor bf;
  if (bias && bias->numel()) {
    TORCH_CHECK(bias->numel() == n, "linear_int8: bias must be [N]");
    bf = bias->to(torch::kFloat32).contiguous();
  }
  const int8_t* w = weight.data_ptr<int8_t>();
  const float* xp = xf.data_ptr<float>();
  const float* sp = scale.data_ptr<float>();
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  cpu_ext::parallel_claim(n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t first = 0; first < m; first += kMaxRows)
      int8_pass(std::min<int64_t>(kMaxRows, m - first), w, xp + first * k, sp, bp, op + first * n, n, k, begin, end);
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(phase_serve, m) {
  m.def("linear_int8(Tensor x, Tensor weight, Tensor scale, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(phase_serve, CPU, m) { m.impl("linear_int8", &linear_int8); }
