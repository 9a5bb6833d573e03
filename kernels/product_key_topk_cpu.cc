// The product-key top-k on the CPU (kernels/product_key_topk.h): rows split over a few threads, each row by
// selection (std::nth_element) and a sort of the selected composites, which order the elements totally: the
// result does not depend on the algorithm, only on the keys.
#include <algorithm>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/bf16.h"
#include "kernels/parallel.h"
#include "kernels/product_key_topk.h"

namespace sdm {
namespace {

// The first m of comp[0, n), best first (descending composites).
void top_sorted(std::vector<uint64_t>& comp, int64_t n, int64_t m) {
  auto first = comp.begin(), last = comp.begin() + n;
  if (m < n) std::nth_element(first, first + m, last, std::greater<uint64_t>());
  std::sort(first, first + m, std::greater<uint64_t>());
}

struct Top {
  float score;
  int32_t index;
};

void check_table(const ProductKeyDims& d, const int32_t* table) {
  for (int f = 0; f < d.F; ++f) {
    for (int64_t c = 0; c < d.C; ++c) {
      const int32_t r = table[f * int64_t{d.C} + c];
      if (r < 0 || r >= d.m[f]) {
        throw std::invalid_argument("the candidate table holds rank " + std::to_string(r) + " for factor " +
                                    std::to_string(f) + ", outside [0, " + std::to_string(d.m[f]) + ")");
      }
    }
  }
}

}  // namespace

template <typename T>
void product_key_topk_cpu(const ProductKeyDims& d, const T* x, const int32_t* table, float* scores, int32_t* ids) {
  if (d.F > 1) check_table(d, table);
  int32_t longest = d.F > 1 ? d.C : 0;
  for (int f = 0; f < d.F; ++f) longest = std::max(longest, d.n[f]);
  parallel_blocks(d.rows, 64, [&](int64_t begin, int64_t end) {
    std::vector<uint64_t> comp(static_cast<size_t>(longest));
    std::vector<Top> tops(static_cast<size_t>(d.tops));
    for (int64_t row = begin; row < end; ++row) {
      const T* xr = x + row * d.width;
      for (int f = 0; f < d.F; ++f) {
        const T* xf = xr + d.x_offset[f];
        for (int32_t e = 0; e < d.n[f]; ++e) comp[e] = composite(order_key(to_float(xf[e])), e);
        top_sorted(comp, d.n[f], d.m[f]);
        for (int32_t r = 0; r < d.m[f]; ++r) {
          const uint32_t e = composite_pos(comp[r]);
          tops[d.top_offset[f] + r] = Top{to_float(xf[e]), static_cast<int32_t>(e)};
        }
      }
      float* sr = scores + row * d.k;
      int32_t* ir = ids + row * d.k;
      if (d.F == 1) {
        for (int32_t r = 0; r < d.k; ++r) {
          sr[r] = canonical_score(tops[r].score);
          ir[r] = tops[r].index;
        }
        continue;
      }
      // The candidates' scores, summed in factor order (the forward's one definition of a slot's score).
      auto candidate = [&](int64_t c, int32_t* id) {
        const Top& t0 = tops[d.top_offset[0] + table[c]];
        float s = t0.score;
        int32_t i = t0.index;
        for (int f = 1; f < d.F; ++f) {
          const Top& t = tops[d.top_offset[f] + table[f * int64_t{d.C} + c]];
          s = s + t.score;
          i = i * d.n[f] + t.index;
        }
        if (id) *id = i;
        return s;
      };
      for (int32_t c = 0; c < d.C; ++c) comp[c] = composite(order_key(candidate(c, nullptr)), c);
      top_sorted(comp, d.C, d.k);
      for (int32_t r = 0; r < d.k; ++r) sr[r] = canonical_score(candidate(composite_pos(comp[r]), &ir[r]));
    }
  });
}

template <typename T>
void product_key_topk_bwd_cpu(const ProductKeyDims& d, const float* dscores, const int32_t* ids, T* dx) {
  parallel_blocks(d.rows, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(static_cast<size_t>(d.width));
    for (int64_t row = begin; row < end; ++row) {
      const float* ds = dscores + row * d.k;
      const int32_t* ir = ids + row * d.k;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int f = 0; f < d.F; ++f) {
        for (int32_t j = 0; j < d.k; ++j) {
          if (ir[j] < 0 || ir[j] >= d.slots) continue;
          const uint32_t i = static_cast<uint32_t>(ir[j]) / d.weight[f] % static_cast<uint32_t>(d.n[f]);
          acc[d.x_offset[f] + i] += ds[j];
        }
      }
      T* out = dx + row * d.width;
      for (int32_t c = 0; c < d.width; ++c) out[c] = from_float<T>(acc[c]);
    }
  });
}

template void product_key_topk_cpu<float>(const ProductKeyDims&, const float*, const int32_t*, float*, int32_t*);
template void product_key_topk_cpu<bf16>(const ProductKeyDims&, const bf16*, const int32_t*, float*, int32_t*);
template void product_key_topk_bwd_cpu<float>(const ProductKeyDims&, const float*, const int32_t*, float*);
template void product_key_topk_bwd_cpu<bf16>(const ProductKeyDims&, const float*, const int32_t*, bf16*);

}  // namespace sdm
