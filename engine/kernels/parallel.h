// Work sharing for the kernels whose threads may run at different speeds.
//
// at::parallel_for hands each thread an equal range up front, so a step waits for the slowest thread, and on a
// shared VM one core can run markedly slower than the other for seconds at a time (docs/performance.md,
// "Work sharing"). Here threads claim ranges as they go instead, largest first
// (guided self-scheduling: each claim takes a share of what is left), so a slow thread simply takes less.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace cpu_ext {

// Calls body(begin, end) on disjoint ranges covering [0, n), on torch's threads; each claim takes
// max(min_chunk, remaining / (2 * threads)) units. Which thread runs which range depends on timing, so
// body must compute each unit the same way whoever runs it.
template <typename Body>
void parallel_claim(int64_t n, int64_t min_chunk, const Body& body) {
  if (n <= 0) return;
  min_chunk = std::max<int64_t>(1, min_chunk);
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (n + min_chunk - 1) / min_chunk);
  if (threads <= 1 || at::in_parallel_region()) {
    body(0, n);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    int64_t begin = next.load(std::memory_order_relaxed);
    while (begin < n) {
      const int64_t size = std::max(min_chunk, (n - begin) / (2 * threads));
      if (next.compare_exchange_weak(begin, begin + size, std::memory_order_relaxed)) {
        body(begin, std::min(n, begin + size));
        begin = next.load(std::memory_order_relaxed);
      }
    }
  });
}

}  // namespace cpu_ext
