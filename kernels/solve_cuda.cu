// Batched (I + diag(beta) A)^{-1} on the GPU. See solve.h for the exact order.
//
// One block per unit, one thread per column k of Minv. Column k depends only on
// column k, so each thread walks its column row by row (i = 0..C-1) on its own:
// no synchronisation, no shared state, one writer per cell. The threads walk the
// rows in step and the sum over j runs from 0 for every thread (the entries
// Minv[j, k], j < k, are exact zeros written by the same thread), so at each step
// a warp loads one row of Minv (coalesced) and one A[i, j] (broadcast). Multiplies and adds are rounded
// separately (__fmul_rn / __fadd_rn, never fused), matching solve_cpu bitwise.
#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/solve.h"

namespace sdm {
namespace {

__global__ void solve_kernel(const float* __restrict__ A,
                             const float* __restrict__ beta, int64_t N, int C,
                             float* __restrict__ Minv) {
  for (int64_t u = blockIdx.x; u < N; u += gridDim.x) {
    const float* a = A + u * C * C;
    const float* b = beta + u * C;
    float* m = Minv + u * C * C;
    for (int k = threadIdx.x; k < C; k += blockDim.x) {
      // All threads walk the rows together; at row i the threads k < i compute.
      for (int i = 0; i < C; ++i) {
        float out;
        if (k < i) {
          const float* ai = a + static_cast<int64_t>(i) * C;
          float s = 0.0f;
          for (int j = 0; j < i; ++j) {
            s = __fadd_rn(s, __fmul_rn(ai[j], m[static_cast<int64_t>(j) * C + k]));
          }
          out = __fsub_rn(0.0f, __fmul_rn(b[i], s));
        } else {
          out = (k == i) ? 1.0f : 0.0f;
        }
        m[static_cast<int64_t>(i) * C + k] = out;
      }
    }
  }
}

}  // namespace

int solve_cuda(const float* A, const float* beta, int64_t N, int64_t C,
               float* Minv, CUstream_st* stream) {
  if (N <= 0 || C <= 0) return static_cast<int>(cudaSuccess);
  if (C > kSolveCudaMaxC) return static_cast<int>(cudaErrorInvalidValue);
  // Launch configuration from the shapes only.
  const int threads = static_cast<int>(std::min<int64_t>(((C + 31) / 32) * 32, kSolveCudaMaxC));
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(N, int64_t{1} << 30));
  solve_kernel<<<blocks, threads, 0, stream>>>(A, beta, N, static_cast<int>(C), Minv);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace sdm
