// Math shared by the kernels' translation units: bf16 widening, and AVX-512 helpers.
#pragma once

#include <cstdint>
#include <cstring>

namespace cpu_ext {

// A bf16's bits as the fp32 they are the upper half of (exact).
inline float bf16_to_float(uint16_t bits) {
  const uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &widened, sizeof(out));
  return out;
}

}  // namespace cpu_ext

#if defined(__AVX512F__)
#include <immintrin.h>

namespace cpu_ext {

#if defined(__AVX512BW__) && defined(__AVX512VL__)
// 16 bf16 (the lanes of `mask`; the rest 0) widened to fp32.
inline __m512 load_bf16x16(const uint16_t* p, __mmask16 mask = 0xFFFF) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}
#endif

// Lanes [0, n) of 16 (none for n <= 0).
inline __mmask16 lanes_below(int64_t n) {
  return n >= 16 ? 0xFFFF : n <= 0 ? 0 : static_cast<__mmask16>((1u << n) - 1);
}

// 16 fp32 -> 16 bf16, to_bf16's rounding (nearest even; NaN to 0x7FC0), on AVX-512F integer lanes.
inline __m256i bf16_round(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(rounded);
}

// exp(x) to about 1 ulp (degree-7 Taylor on |r| <= ln2/2, then 2^n by scalef); exactly 0 below -103
// (where the true value is under fp32's smallest denormal) and for -inf.
inline __m512 exp512(__m512 x) {
  const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-103.f), _CMP_GE_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-103.f)), _mm512_set1_ps(89.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln2 in two parts (Cephes): n * hi is exact
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 poly = _mm512_set1_ps(1.f / 5040);
  for (float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f})
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(c));
  return _mm512_maskz_scalef_ps(keep, poly, n);
}

}  // namespace cpu_ext

#endif  // __AVX512F__
