// Batched (I + diag(beta) A)^{-1} on the GPU. See solve.h for the exact order.
//
// One block per unit, one thread per column k of Minv. Column k depends only on
// column k, so each thread walks its column row by row (i = 0..C-1) on its own:
// one writer per cell. The threads walk the rows in step and the sum over j runs
// from 0 for every thread (the entries Minv[j, k], j < k, are exact zeros written
// by the same thread), so at each step a warp reads one row of Minv (consecutive
// k) and one A[i, j] (the same for every thread). Multiplies and adds are rounded
// separately (__fmul_rn / __fadd_rn, never fused), matching solve_cpu bitwise.
//
// Where the lower triangle of the unit's Minv fits the block's shared memory (C <= 338 on sm_90: C (C + 1) / 2
// floats, the zeros above the diagonal are not kept), the block keeps it there, with a ring of the next rows of A
// beside it, on their way by asynchronous copies (solve_shared_kernel), and writes each row out once. Otherwise
// every product reads Minv back from global memory (solve_global_kernel): a chain of L1/L2 round trips per cell
// that took 230 us for 128 units at C = 128 on the H200, where the sum's serial chain of C^2 / 2 adds is about
// 20 us, and 1.42 ms for 64 units at C = 256 (when the whole square was kept in shared memory: C <= 240).
#include <cuda_pipeline.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/solve.h"

namespace sdm {
namespace {

// Cell (i, k) of Minv: 0 - b_i * sum_{k <= j < i} a_i[j] m(j)[k] (j ascending) for k < i, 1 for k == i, else 0;
// m(j) points at row j of Minv, already written. The terms j < k are the exact zeros above the diagonal, skipped as
// solve_cpu skips them (the same bits: adding +0 to a +0 sum), but each warp starts at its first column, so that at
// each step its threads read one row of Minv (consecutive k) and one a_i[j]; the threads with j < k read row j's
// diagonal (never past the row's end in the packed triangle, where other threads may be writing) and add +0 in
// place of their product. The one definition both kernels use, so they round alike.
template <class RowOf>
__device__ __forceinline__ float minv_cell(const float* a_i, float b_i, RowOf m, int i, int k) {
  if (k >= i) return k == i ? 1.0f : 0.0f;
  float s = 0.0f;
#pragma unroll 8
  for (int j = k & ~31; j < i; ++j) {
    const float p = __fmul_rn(a_i[j], m(j)[k <= j ? k : j]);
    s = __fadd_rn(s, j >= k ? p : 0.0f);
  }
  return __fsub_rn(0.0f, __fmul_rn(b_i, s));
}

// Offset of row j in a packed lower triangle (row j holds columns 0..j).
__device__ __forceinline__ int tri_row(int j) { return j * (j + 1) / 2; }

__global__ void solve_global_kernel(const float* __restrict__ A, const float* __restrict__ beta, int64_t N, int C,
                                    float* __restrict__ Minv) {
  for (int64_t u = blockIdx.x; u < N; u += gridDim.x) {
    const float* a = A + u * C * C;
    const float* b = beta + u * C;
    float* m = Minv + u * C * C;
    for (int k = threadIdx.x; k < C; k += blockDim.x) {
      // All threads walk the rows together; at row i the threads k < i compute.
      for (int i = 0; i < C; ++i) {
        const int64_t row = static_cast<int64_t>(i) * C;
        m[row + k] = minv_cell(a + row, b[i], [&](int j) { return m + static_cast<int64_t>(j) * C; }, i, k);
      }
    }
  }
}

// Rows of A in flight at most (solve_shared_kernel's ring); cp.async.wait_group counts up to 8 pending groups.
constexpr int kMaxAhead = 8;

// Dynamic shared memory: the lower triangle of the unit's Minv, packed by rows (row j at tri_row(j), columns
// 0..j), then a ring of `ahead` rows of A (row r in slot r % ahead), each copied asynchronously (thread j copies
// column j) ahead - 1 rows before it is used. A row's sums take a fraction of a global round trip at C = 128, so a
// row fetched only one row ahead still waited for most of it (156 us for 128 units on the H200). One barrier per
// row orders it all: row i of A has landed, row i - 1 of Minv is whole, and row i - 1's slot is free for row
// i + ahead - 1.
__global__ void solve_shared_kernel(const float* __restrict__ A, const float* __restrict__ beta, int64_t N, int C,
                                    int ahead, float* __restrict__ Minv) {
  extern __shared__ float sm[];
  float* ms = sm;
  float* a_rows = sm + tri_row(C);
  const int j = threadIdx.x;  // blockDim.x >= C: one column per thread
  // One commit group per row, empty past the last row or column, so that the count of groups is the same in
  // every thread and __pipeline_wait_prior(ahead - 2) means "row i has landed" at row i.
  const auto fetch = [&](const float* a, int r) {
    if (r < C && j < C) __pipeline_memcpy_async(a_rows + (r % ahead) * C + j, a + static_cast<int64_t>(r) * C + j, 4);
    __pipeline_commit();
  };
  for (int64_t u = blockIdx.x; u < N; u += gridDim.x) {
    const float* a = A + u * C * C;
    const float* b = beta + u * C;
    float* m = Minv + u * C * C;
    for (int r = 0; r < ahead - 1; ++r) fetch(a, r);
    float b_i = b[0];
    for (int i = 0; i < C; ++i) {  // the same trip count in every thread: the barrier is safe
      const float b_next = i + 1 < C ? b[i + 1] : 0.0f;
      __pipeline_wait_prior(ahead - 2);
      __syncthreads();
      fetch(a, i + ahead - 1);  // into row i - 1's slot
      if (j < C) {
        const float out = minv_cell(a_rows + (i % ahead) * C, b_i, [&](int r) { return ms + tri_row(r); }, i, j);
        if (j <= i) ms[tri_row(i) + j] = out;
        m[static_cast<int64_t>(i) * C + j] = out;
      }
      b_i = b_next;
    }
    __syncthreads();  // the last rows read before the next unit's copies land
  }
}

// Rows of A solve_shared_kernel keeps in flight at C on this device (2 to kMaxAhead: the ring and the lower
// triangle of the unit's Minv within what the device gives a block), or 0 when not even 2 fit.
int shared_ahead(int64_t C) {
  int device = 0, limit = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess)
    return 0;
  const int64_t rows = (static_cast<int64_t>(limit) / static_cast<int64_t>(sizeof(float)) - C * (C + 1) / 2) / C;
  return rows < 2 ? 0 : static_cast<int>(std::min<int64_t>(rows, kMaxAhead));
}

}  // namespace

int solve_cuda(const float* A, const float* beta, int64_t N, int64_t C,
               float* Minv, CUstream_st* stream) {
  if (N <= 0 || C <= 0) return static_cast<int>(cudaSuccess);
  if (C > kSolveCudaMaxC) return static_cast<int>(cudaErrorInvalidValue);
  // Launch configuration from the shapes (and the device's shared-memory limit) only.
  const int threads = static_cast<int>(std::min<int64_t>(((C + 31) / 32) * 32, kSolveCudaMaxC));
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(N, int64_t{1} << 30));
  const int ahead = shared_ahead(C);
  if (ahead > 0) {
    const size_t smem = static_cast<size_t>(C * (C + 1) / 2 + ahead * C) * sizeof(float);
    const int rc = static_cast<int>(
        cudaFuncSetAttribute(solve_shared_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    if (rc != 0) return rc;
    solve_shared_kernel<<<blocks, threads, smem, stream>>>(A, beta, N, static_cast<int>(C), ahead, Minv);
  } else {
    solve_global_kernel<<<blocks, threads, 0, stream>>>(A, beta, N, static_cast<int>(C), Minv);
  }
  return static_cast<int>(cudaGetLastError());
}

}  // namespace sdm
