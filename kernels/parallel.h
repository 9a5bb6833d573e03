// Split independent work items over a few CPU threads in contiguous blocks.
//
// Each item is computed by exactly one thread in a fixed order, so results never depend on the
// split (determinism, docs/MATH.md "Determinism and numerics"); threads only shorten the wall time.
#ifndef JAX_SDM_KERNELS_PARALLEL_H_
#define JAX_SDM_KERNELS_PARALLEL_H_

#include <algorithm>
#include <cstdint>
#include <exception>
#include <thread>
#include <vector>

namespace sdm {

// Calls body(begin, end) on disjoint blocks covering [0, n). `min_per_thread` items at least per thread.
// An exception thrown by a block (e.g. std::bad_alloc for its scratch) is rethrown in the calling thread
// after every block has finished (the first block's in block order).
template <typename Body>
void parallel_blocks(int64_t n, int64_t min_per_thread, Body body) {
  const int64_t hw = std::max<int64_t>(1, std::thread::hardware_concurrency());
  const int64_t nt = std::max<int64_t>(1, std::min(hw, n / std::max<int64_t>(1, min_per_thread)));
  if (nt <= 1) {
    if (n > 0) body(int64_t{0}, n);
    return;
  }
  const int64_t per = (n + nt - 1) / nt;
  std::vector<std::exception_ptr> errors(static_cast<size_t>(nt));
  auto block = [&body, &errors, per, n](int64_t b) {
    try {
      body(b * per, std::min(n, (b + 1) * per));
    } catch (...) {
      errors[static_cast<size_t>(b)] = std::current_exception();
    }
  };
  std::vector<std::thread> workers;
  workers.reserve(static_cast<size_t>(nt - 1));
  for (int64_t b = 1; b < nt && b * per < n; ++b) {
    try {
      workers.emplace_back(block, b);
    } catch (...) {
      block(b);  // could not start a thread: do the block here
    }
  }
  block(0);
  for (std::thread& th : workers) th.join();
  for (const std::exception_ptr& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

}  // namespace sdm

#endif  // JAX_SDM_KERNELS_PARALLEL_H_
