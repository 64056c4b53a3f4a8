// CPU kernels for bf16 decoding, run on torch's own thread pool (at::parallel_for), so they never fight a
// second OpenMP runtime for the cores. Built on first use by engine/kernels/cpu_ext.py (torch's
// cpp_extension, -O3 -march=native); see that file for when each kernel is used.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

inline float bf16_to_float(uint16_t bits) {
  uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &widened, sizeof(out));
  return out;
}

// Dot product of one bf16 row with one fp32 vector, accumulated in fp32.
inline float dot_bf16_f32(const uint16_t* w, const float* x, int64_t k) {
  int64_t i = 0;
  float total = 0.f;
#if defined(__AVX512F__)
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
#if defined(__AVX512F__)
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

template <int R>
void gemv_parallel(const uint16_t* w, const float* x, float* out, int64_t n, int64_t k) {
  at::parallel_for(0, n, 32, [&](int64_t begin, int64_t end) { gemv_rows<R>(w, x, out, n, k, begin, end); });
}

// x [M, K] bf16, weight [N, K] bf16 (contiguous), bias [N] or empty -> [M, N] bf16, in passes of up to 8 rows.
torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor weight, torch::Tensor bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "linear_bf16: shapes");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.is_contiguous(), "linear_bf16: weight");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  torch::Tensor xf = x.to(torch::kFloat32).contiguous();
  torch::Tensor out = torch::empty({m, n}, x.options().dtype(torch::kFloat32));
  const uint16_t* w = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  for (int64_t first = 0; first < m; first += 8) {
    const float* xp = xf.data_ptr<float>() + first * k;
    float* op = out.data_ptr<float>() + first * n;
    switch (std::min<int64_t>(8, m - first)) {
      case 1: gemv_parallel<1>(w, xp, op, n, k); break;
      case 2: gemv_parallel<2>(w, xp, op, n, k); break;
      case 3: gemv_parallel<3>(w, xp, op, n, k); break;
      case 4: gemv_parallel<4>(w, xp, op, n, k); break;
      case 5: gemv_parallel<5>(w, xp, op, n, k); break;
      case 6: gemv_parallel<6>(w, xp, op, n, k); break;
      case 7: gemv_parallel<7>(w, xp, op, n, k); break;
      default: gemv_parallel<8>(w, xp, op, n, k); break;
    }
  }
  if (bias.numel()) out.add_(bias.to(torch::kFloat32));
  return out.to(torch::kBFloat16);
}

// q [B, Hq, D] bf16; k/v pages [N, bs, Hkv, D] bf16; block_tables [B, nb] int64; context_lens [B] int64
// -> [B, Hq, D] bf16. One task per (sequence, kv head): its query group shares every key/value read.
torch::Tensor decode_attention_bf16(torch::Tensor q, torch::Tensor k_pages, torch::Tensor v_pages,
                                   torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(k_pages.is_contiguous() && v_pages.is_contiguous(), "decode_attention_bf16: pages");
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_pages.size(1), num_kv_heads = k_pages.size(2);
  const int64_t group = num_heads / num_kv_heads, max_blocks = block_tables.size(1);
  torch::Tensor qf = q.to(torch::kFloat32).contiguous();
  torch::Tensor out = torch::empty({num_seqs, num_heads, head_dim}, q.options().dtype(torch::kFloat32));
  torch::Tensor tables = block_tables.contiguous(), lens = context_lens.contiguous();
  const float* qp = qf.data_ptr<float>();
  const uint16_t* kp = reinterpret_cast<const uint16_t*>(k_pages.data_ptr<at::BFloat16>());
  const uint16_t* vp = reinterpret_cast<const uint16_t*>(v_pages.data_ptr<at::BFloat16>());
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t slot_stride = num_kv_heads * head_dim, block_stride = block_size * slot_stride;
  for (int64_t b = 0; b < num_seqs; ++b)  // checked here: an exception inside parallel_for is worse to read
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= max_blocks * block_size, "decode_attention_bf16: context length ", lp[b]);
  for (int64_t i = 0; i < tables.numel(); ++i)
    TORCH_CHECK(tp[i] >= 0 && tp[i] < k_pages.size(0), "decode_attention_bf16: block id ", tp[i]);
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, vrow(head_dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / num_kv_heads, h = task % num_kv_heads, length = lp[b];
      scores.assign(group * length, 0.f);
      for (int64_t t = 0; t < length; ++t) {
        const uint16_t* key = kp + tp[b * max_blocks + t / block_size] * block_stride + (t % block_size) * slot_stride +
                              h * head_dim;
        for (int64_t g = 0; g < group; ++g)
          scores[g * length + t] = dot_bf16_f32(key, qp + (b * num_heads + h * group + g) * head_dim, head_dim) * scale;
      }
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * length;
        float peak = s[0];
        for (int64_t t = 1; t < length; ++t) peak = std::max(peak, s[t]);
        float total = 0.f;
        for (int64_t t = 0; t < length; ++t) total += (s[t] = std::exp(s[t] - peak));
        for (int64_t t = 0; t < length; ++t) s[t] /= total;
      }
      float* o = op + (b * num_heads + h * group) * head_dim;
      std::fill(o, o + group * head_dim, 0.f);
      for (int64_t t = 0; t < length; ++t) {
        const uint16_t* value = vp + tp[b * max_blocks + t / block_size] * block_stride +
                                (t % block_size) * slot_stride + h * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) vrow[d] = bf16_to_float(value[d]);
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * length + t];
          float* og = o + g * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) og[d] += p * vrow[d];
        }
      }
    }
  });
  return out.to(torch::kBFloat16);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_bf16", &linear_bf16, "x W^T + b for a few bf16 rows, streaming each weight row once");
  m.def("decode_attention_bf16", &decode_attention_bf16, "decode attention reading bf16 KV pages in place");
}
