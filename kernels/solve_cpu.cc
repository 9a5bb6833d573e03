// Batched (I + diag(beta) A)^{-1} on the CPU. See solve.h for the exact order.
// Compiled with -ffp-contract=off so that no multiply-add is fused: the same
// rounding as the CUDA kernel (__fmul_rn / __fadd_rn).
#include "kernels/solve.h"

#include <algorithm>
#include <vector>

namespace sdm {

void solve_cpu(const float* A, const float* beta, int64_t N, int64_t C,
               float* Minv) {
  if (N <= 0 || C <= 0) return;
  std::vector<float> acc(static_cast<size_t>(C));
  for (int64_t u = 0; u < N; ++u) {
    const float* a = A + u * C * C;
    const float* b = beta + u * C;
    float* m = Minv + u * C * C;
    for (int64_t i = 0; i < C; ++i) {
      // acc[k] = sum_{j < i} A[i, j] Minv[j, k], j ascending. Minv[j, k] = 0 for
      // k > j, and adding +0 products to a +0 start changes nothing, so only
      // k <= j is visited: the same values as the full loop of the CUDA kernel.
      std::fill(acc.begin(), acc.begin() + i, 0.0f);
      for (int64_t j = 0; j < i; ++j) {
        const float aij = a[i * C + j];
        const float* mj = m + j * C;
        for (int64_t k = 0; k <= j; ++k) acc[k] += aij * mj[k];
      }
      float* mi = m + i * C;
      const float bi = b[i];
      for (int64_t k = 0; k < i; ++k) mi[k] = 0.0f - bi * acc[k];
      mi[i] = 1.0f;
      for (int64_t k = i + 1; k < C; ++k) mi[k] = 0.0f;
    }
  }
}

}  // namespace sdm
