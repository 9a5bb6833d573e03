// Batched inverse of the unit lower triangular M = I + diag(beta) A
// (docs/DESIGN.md "Solve"), by forward substitution in a fixed order:
//
//   Minv[i, :] = e_i - beta_i * sum_{j < i} A[i, j] Minv[j, :],   j ascending.
//
// Only the strictly lower part of A is read. Shapes (row-major): A [N, C, C],
// beta [N, C], Minv [N, C, C], all float32. Per cell the sum starts at 0 and adds
// the products A[i, j] * Minv[j, k] for j = 0, 1, ..., i-1 with separately rounded
// multiplies and adds (no fused multiply-add), then Minv[i, k] = 0 - beta_i * sum
// for k < i, 1 on the diagonal and 0 above it. The CPU and the CUDA kernels
// follow the same order and rounding, so they agree bitwise on finite input.
#ifndef JAX_SDM_KERNELS_SOLVE_H_
#define JAX_SDM_KERNELS_SOLVE_H_

#include <cstdint>

// The CUDA runtime's stream handle type is `CUstream_st*` (cudaStream_t); it is
// declared here so that this header needs no CUDA include.
struct CUstream_st;

namespace sdm {

void solve_cpu(const float* A, const float* beta, int64_t N, int64_t C,
               float* Minv);

// Largest C the CUDA kernel accepts (one thread per column, one block per unit).
constexpr int64_t kSolveCudaMaxC = 1024;

// Enqueues the solve on `stream`; no allocation, no synchronisation. Returns the
// cudaError_t of the launch (cudaGetLastError() after it), 0 on success. N == 0
// or C == 0 launches nothing and returns 0. Requires 0 <= C <= kSolveCudaMaxC.
int solve_cuda(const float* A, const float* beta, int64_t N, int64_t C,
               float* Minv, CUstream_st* stream);

}  // namespace sdm

#endif  // JAX_SDM_KERNELS_SOLVE_H_
