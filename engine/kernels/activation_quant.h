// Activations quantised to int8 in groups of 32 along K, shared by the W8A8 (int8_linear.cpp) and W4A8
// (int4_linear.cpp) kernels; and what every quantised product shares: its bias as fp32, the output rows (bf16 or
// fp32) it stores its results in.
//
// Each row of x is quantised in groups of 32: a[m, g] = max |x[m, g's 32]| / 127, q[m, k] = round(x[m, k] /
// a[m, g]) (nearest even, codes -127..127; a = 1 for a group of zeros), codes past K zero.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include <torch/extension.h>

namespace cpu_ext {

// Round to nearest even, as torch converts float to bfloat16; NaN stays NaN.
inline uint16_t to_bf16(float value) {
  if (std::isnan(value)) return 0x7FC0;
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

// A product's bias as the kernels read it: fp32 [N] (from any float dtype), or none (absent or empty).
struct FloatBias {
  torch::Tensor values;
  const float* data() const { return values.defined() ? values.data_ptr<float>() : nullptr; }
};

inline FloatBias float_bias(const std::optional<torch::Tensor>& bias, int64_t n, const char* name) {
  if (!bias || !bias->numel()) return {};
  TORCH_CHECK(bias->numel() == n, name, ": bias must be [N]");
  return {bias->to(torch::kFloat32).contiguous()};
}

// A product's output rows: bf16 (to_bf16's rounding), or fp32 where the caller keeps the sums whole (the LM
// head's logits: a bf16 rounding there ties close candidates, and the argmax then picks the lower id).
struct OutRows {
  void* data;
  bool fp32;

  void put(int64_t i, float value) const {
    if (fp32) static_cast<float*>(data)[i] = value;
    else static_cast<uint16_t*>(data)[i] = to_bf16(value);
  }
  OutRows shifted(int64_t i) const {
    return fp32 ? OutRows{static_cast<float*>(data) + i, true} : OutRows{static_cast<uint16_t*>(data) + i, false};
  }
};

// An empty [m, n] output for OutRows: fp32, or x's options (bf16).
inline torch::Tensor output_rows(const torch::Tensor& x, int64_t m, int64_t n, bool fp32) {
  return torch::empty({m, n}, fp32 ? x.options().dtype(at::kFloat) : x.options().dtype(at::kBFloat16));
}

inline OutRows out_rows(torch::Tensor& out) { return OutRows{out.data_ptr(), out.scalar_type() == at::kFloat}; }

constexpr int64_t kActGroup = 32;  // activation codes per scale

struct QuantRows {
  std::vector<int8_t> codes;  // [M, kp], zero past k
  std::vector<int32_t> sums;  // [M, groups]: the sum of the group's codes
  std::vector<float> scale;   // [M, groups]: a
  std::vector<float> totals;  // [M, groups]: the sum of the group's values themselves (fp32, in k order)
  int64_t kp, groups;
};

// x fp32 [M, K] -> its int8 groups (the definition above; IEEE division, so torch's x / a rounds the same).
inline QuantRows quantize_activations(const float* x, int64_t m, int64_t k) {
  QuantRows q;
  q.groups = (k + kActGroup - 1) / kActGroup;
  q.kp = q.groups * kActGroup;
  q.codes.assign(m * q.kp, 0);
  q.sums.resize(m * q.groups);
  q.scale.resize(m * q.groups);
  q.totals.resize(m * q.groups);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < q.groups; ++g) {
      const float* xg = x + r * k + g * kActGroup;
      const int64_t len = std::min(kActGroup, k - g * kActGroup);
      float amax = 0.f, total = 0.f;
      for (int64_t i = 0; i < len; ++i) {
        amax = std::max(amax, std::fabs(xg[i]));
        total += xg[i];
      }
      const float a = amax > 0.f ? amax / 127.f : 1.f;
      int32_t sum = 0;
      for (int64_t i = 0; i < len; ++i) {
        const float v = std::min(127.f, std::max(-127.f, std::nearbyint(xg[i] / a)));
        q.codes[r * q.kp + g * kActGroup + i] = static_cast<int8_t>(v);
        sum += static_cast<int32_t>(v);
      }
      q.sums[r * q.groups + g] = sum;
      q.scale[r * q.groups + g] = a;
      q.totals[r * q.groups + g] = total;
    }
  return q;
}

}  // namespace cpu_ext
