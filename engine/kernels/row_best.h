// Each row's argmax as a product's results come out (tiled_linear.cpp, int8_grouped.cpp): the greedy pick off the
// LM head without writing the [M, N] logits and reading them back.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

namespace cpu_ext {

// Each row's best column so far, by torch's max(dim) rule: NaN first, then the larger value, then the lower
// column (so the result does not depend on which thread saw which columns, nor in which order).
struct RowBest {
  std::vector<float> value;
  std::vector<int64_t> column;  // -1: none yet

  explicit RowBest(int64_t rows) : value(rows, 0.f), column(rows, -1) {}

  void offer(int64_t row, float v, int64_t col) {
    const int64_t best = column[row];
    const bool v_nan = std::isnan(v), best_nan = best >= 0 && std::isnan(value[row]);
    const bool wins = best < 0 || (v_nan != best_nan ? v_nan
                                                     : !v_nan && v != value[row] ? v > value[row] : col < best);
    if (wins) {
      value[row] = v;
      column[row] = col;
    }
  }

  // Every row's best of `other` offered here (row r of other is row first + r here).
  void fold(const RowBest& other, int64_t first = 0) {
    for (int64_t r = 0; r < static_cast<int64_t>(other.column.size()); ++r)
      if (other.column[r] >= 0) offer(first + r, other.value[r], other.column[r]);
  }
};

}  // namespace cpu_ext

#if defined(__AVX512F__)
#include <immintrin.h>

namespace cpu_ext {

// Lanes `live` of v, the values of columns col0 + lane, offered to row `row`: the first NaN, else the first lane
// of the largest value.
inline void offer_lanes(RowBest& best, int64_t row, __m512 v, int64_t col0, __mmask16 live = 0xFFFF) {
  if (!live) return;
  const __mmask16 nan = _mm512_mask_cmp_ps_mask(live, v, v, _CMP_UNORD_Q);
  if (nan) {
    best.offer(row, v[__builtin_ctz(nan)], col0 + __builtin_ctz(nan));
    return;
  }
  const float top = _mm512_mask_reduce_max_ps(live, v);
  best.offer(row, top, col0 + __builtin_ctz(_mm512_mask_cmp_ps_mask(live, v, _mm512_set1_ps(top), _CMP_EQ_OQ)));
}

}  // namespace cpu_ext
#endif
