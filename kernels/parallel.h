// Split independent work items over a few CPU threads in contiguous blocks.
//
// Each item is computed by exactly one thread in a fixed order, so results never depend on the
// split (determinism, SPEC 4); threads only shorten the wall time.
#ifndef JAX_SDM_KERNELS_PARALLEL_H_
#define JAX_SDM_KERNELS_PARALLEL_H_

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

namespace sdm {

// Calls body(begin, end) on disjoint blocks covering [0, n). `min_per_thread` items at least per thread.
template <typename Body>
void parallel_blocks(int64_t n, int64_t min_per_thread, Body body) {
  const int64_t hw = std::max<int64_t>(1, std::thread::hardware_concurrency());
  const int64_t nt = std::max<int64_t>(1, std::min(hw, n / std::max<int64_t>(1, min_per_thread)));
  if (nt <= 1) {
    if (n > 0) body(int64_t{0}, n);
    return;
  }
  const int64_t per = (n + nt - 1) / nt;
  std::vector<std::thread> workers;
  for (int64_t b = 1; b < nt; ++b) {
    const int64_t lo = b * per, hi = std::min(n, lo + per);
    if (lo >= hi) break;
    try {
      workers.emplace_back([=] { body(lo, hi); });
    } catch (...) {
      body(lo, hi);  // could not start a thread: do the block here
    }
  }
  body(int64_t{0}, std::min(n, per));
  for (std::thread& th : workers) th.join();
}

}  // namespace sdm

#endif  // JAX_SDM_KERNELS_PARALLEL_H_
