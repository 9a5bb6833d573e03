// The product-key top-k's candidate table for the checks (tests/cuda_emu): what jax_sdm builds in Python.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <vector>

namespace emu_check {

// The rank tuples with prod(r_f + 1) <= k, r_f < min(k, n_f), in lexicographic order, factor-major [F, C].
inline std::vector<int32_t> candidate_table(const std::vector<int64_t>& factors, int64_t k, int64_t* C) {
  std::vector<std::vector<int32_t>> tuples;
  std::vector<int32_t> t;
  std::function<void(size_t, int64_t)> walk = [&](size_t f, int64_t budget) {
    if (f == factors.size()) {
      tuples.push_back(t);
      return;
    }
    for (int64_t r = 0; r < std::min(factors[f], k) && r + 1 <= budget; ++r) {
      t.push_back(static_cast<int32_t>(r));
      walk(f + 1, budget / (r + 1));
      t.pop_back();
    }
  };
  walk(0, k);
  *C = static_cast<int64_t>(tuples.size());
  std::vector<int32_t> table(factors.size() * tuples.size());
  for (size_t c = 0; c < tuples.size(); ++c)
    for (size_t f = 0; f < factors.size(); ++f) table[f * tuples.size() + c] = tuples[c][f];
  return table;
}

}  // namespace emu_check
