// Batched (I + diag(beta) A)^{-1} on the GPU. See solve.h for the exact order.
//
// One block per unit, one thread per column k of Minv. Column k depends only on column k and on A, so the threads
// never wait for each other's sums: one writer per cell. Multiplies and adds are rounded separately (__fmul_rn /
// __fadd_rn, never fused), and every cell's sum adds its products in solve.h's order (j ascending from k; the terms
// j < k are the exact zeros above the diagonal, which solve_cpu skips too), so both kernels match solve_cpu bitwise.
//
// Where it fits the block's shared memory (C <= 282 on sm_90), solve_panel_kernel keeps each column's running sums
// in shared memory and walks j once: at step j it finishes row j of Minv from the sums of row j, then adds row j's
// term A[i, j] Minv[j, k] to the sums of every later row i (a right-looking forward substitution: each sum still
// gets its terms in j order). The updates of one step are independent of each other, so the serial chain per
// column is C steps, not the C^2 / 2 adds of a row-by-row walk (solve_global_kernel's order of work). A comes into shared memory 32 columns at a time, the next panel's copy in flight while
// this one is used. Otherwise every product reads Minv back from global memory (solve_global_kernel).
#include <cuda_pipeline.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/solve.h"

namespace sdm {
namespace {

// Cell (i, k) of Minv: 0 - b_i * sum_{k <= j < i} a_i[j] m(j)[k] (j ascending) for k < i, 1 for k == i, else 0;
// m(j) points at row j of Minv, already written. Each warp starts at its first column, so that at each step its
// threads read one row of Minv (consecutive k) and one a_i[j]; the threads with j < k read row j's diagonal and add
// +0 in place of their product.
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

// Columns of A per panel, and steps j fused into one pass over the later rows (one load and one store of a sum per
// kGroup terms; a row's kGroup entries of the panel are one 16-byte load).
constexpr int kPanel = 32;
constexpr int kGroup = 4;
static_assert(kPanel % kGroup == 0 && kPanel == 32, "a panel is one warp's columns");

// Offset of row i in the packed strictly lower triangle (row i holds columns 0..i-1).
__device__ __forceinline__ int tri_strict(int i) { return i * (i - 1) / 2; }

// Floats of solve_panel_kernel's dynamic shared memory: two panels [C, kPanel], the running sums (strictly lower
// triangle), beta.
__host__ __device__ constexpr int64_t panel_smem_floats(int64_t C) { return 2 * C * kPanel + C * (C - 1) / 2 + C; }

// Rows of the later-rows pass whose loads are all issued before the first store: a row's sum is stored back to
// shared memory, and the compiler cannot tell that the next row's cell is another one, so row by row each load
// would wait for the store before it (a shared-memory round trip, then 4 dependent adds, per row).
constexpr int kRowsInFlight = 4;

// The later rows' sums of column k after the steps j0..j0+kGroup-1 of one group (m[t] = Minv[j0 + t, k]). kAll:
// k <= j0, every step's term counts; otherwise the terms of steps j0 + t < k are left out (+0 added in their place:
// the same bits as skipping them).
template <bool kAll>
__device__ __forceinline__ void add_group_terms(const float* P, float* sums, const float (&m)[kGroup], int j0, int c0,
                                                int k, int C) {
  bool on[kGroup];
#pragma unroll
  for (int t = 0; t < kGroup; ++t) on[t] = kAll || j0 + t >= k;
  // Row i's sum plus the group's terms, in step order.
  const auto add_terms = [&](int i, float sum) {
    const float4 a = *reinterpret_cast<const float4*>(P + static_cast<int64_t>(i) * kPanel + (j0 - c0));
    const float a_t[kGroup] = {a.x, a.y, a.z, a.w};
#pragma unroll
    for (int t = 0; t < kGroup; ++t) {
      const float term = __fmul_rn(a_t[t], m[t]);
      sum = __fadd_rn(sum, on[t] ? term : 0.0f);
    }
    return sum;
  };
  int i = j0 + kGroup, off = tri_strict(i);
  for (; i + kRowsInFlight <= C; i += kRowsInFlight) {
    int at[kRowsInFlight];
    float sum[kRowsInFlight];
#pragma unroll
    for (int r = 0; r < kRowsInFlight; ++r) {
      at[r] = off + k;
      off += i + r;  // tri_strict(i + r + 1)
      sum[r] = sums[at[r]];
    }
#pragma unroll
    for (int r = 0; r < kRowsInFlight; ++r) sum[r] = add_terms(i + r, sum[r]);
#pragma unroll
    for (int r = 0; r < kRowsInFlight; ++r) sums[at[r]] = sum[r];
  }
  for (; i < C; ++i) {
    sums[off + k] = add_terms(i, sums[off + k]);
    off += i;
  }
}

__global__ void solve_panel_kernel(const float* __restrict__ A, const float* __restrict__ beta, int64_t N, int C,
                                   float* __restrict__ Minv) {
  static_assert(kGroup == 4, "add_group_terms loads a row's kGroup entries as one float4");
  extern __shared__ __align__(16) float sm[];
  float* panels = sm;                                  // panel p in panels + (p & 1) * C * kPanel
  float* sums = sm + 2 * static_cast<int64_t>(C) * kPanel;  // sums[tri_strict(i) + k]: column k's sum of row i
  float* b = sums + static_cast<int64_t>(C) * (C - 1) / 2;
  const int k = threadIdx.x;  // blockDim.x >= C: one column per thread
  const int warp_first = k & ~31;
  const int n_panels = (C + kPanel - 1) / kPanel;
  // Panel p: rows c0 + 1 .. C - 1 of A's columns c0 .. c0 + kPanel - 1 (the rows a later step reads), by
  // asynchronous copies; columns past C are zeros. One commit group per call in every thread.
  const auto fetch = [&](const float* a, int p) {
    if (p < n_panels) {
      float* dst = panels + static_cast<int64_t>(p & 1) * C * kPanel;
      const int c0 = p * kPanel;
      for (int e = (c0 + 1) * kPanel + threadIdx.x; e < C * kPanel; e += blockDim.x) {
        const int i = e / kPanel, col = c0 + e % kPanel;
        if (col < C)
          __pipeline_memcpy_async(dst + e, a + static_cast<int64_t>(i) * C + col, 4);
        else
          dst[e] = 0.0f;
      }
    }
    __pipeline_commit();
  };
  for (int64_t u = blockIdx.x; u < N; u += gridDim.x) {
    const float* a = A + u * C * C;
    float* m_out = Minv + u * C * C;
    fetch(a, 0);
    for (int e = threadIdx.x; e < C * (C - 1) / 2; e += blockDim.x) sums[e] = 0.0f;
    for (int e = threadIdx.x; e < C; e += blockDim.x) b[e] = beta[u * C + e];
    for (int p = 0; p < n_panels; ++p) {
      fetch(a, p + 1);  // into the buffer panel p - 1 used: free since the barrier that ended it
      __pipeline_wait_prior(1);
      __syncthreads();  // panel p (and at p = 0 the zeroed sums and beta) visible to every thread
      const int c0 = p * kPanel;
      const float* P = panels + static_cast<int64_t>(p & 1) * C * kPanel;
      for (int j0 = c0; j0 < c0 + kPanel && j0 < C; j0 += kGroup) {
        if (k >= C) continue;
        if (warp_first > j0 + kGroup - 1) {  // the whole warp right of these rows: zeros above the diagonal
#pragma unroll
          for (int t = 0; t < kGroup; ++t)
            if (j0 + t < C) m_out[static_cast<int64_t>(j0 + t) * C + k] = 0.0f;
          continue;
        }
        // Rows j0 .. j0 + kGroup - 1 of Minv: each row's sum still lacks the terms of the group's earlier steps.
        float m[kGroup];
#pragma unroll
        for (int t = 0; t < kGroup; ++t) {
          const int j = j0 + t;
          float out = 0.0f;
          if (j < C) {
            if (k < j) {
              float sum = sums[tri_strict(j) + k];
              for (int r = 0; r < t; ++r) {
                const float term = __fmul_rn(P[static_cast<int64_t>(j) * kPanel + (j0 - c0) + r], m[r]);
                sum = __fadd_rn(sum, j0 + r >= k ? term : 0.0f);
              }
              out = __fsub_rn(0.0f, __fmul_rn(b[j], sum));
            } else if (k == j) {
              out = 1.0f;
            }
            m_out[static_cast<int64_t>(j) * C + k] = out;
          }
          m[t] = out;
        }
        if (warp_first + 31 <= j0)
          add_group_terms<true>(P, sums, m, j0, c0, k, C);
        else if (k <= j0 + kGroup - 1)  // a column right of the group has no term in it
          add_group_terms<false>(P, sums, m, j0, c0, k, C);
      }
      __syncthreads();  // panel p read by all before the next fetch overwrites its buffer
    }
  }
}

// Whether solve_panel_kernel's shared memory fits what this device gives a block.
bool panel_fits(int64_t C) {
  int device = 0, limit = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess)
    return false;
  return panel_smem_floats(C) * static_cast<int64_t>(sizeof(float)) <= limit;
}

}  // namespace

int solve_cuda(const float* A, const float* beta, int64_t N, int64_t C,
               float* Minv, CUstream_st* stream) {
  if (N <= 0 || C <= 0) return static_cast<int>(cudaSuccess);
  if (C > kSolveCudaMaxC) return static_cast<int>(cudaErrorInvalidValue);
  // Launch configuration from the shapes (and the device's shared-memory limit) only.
  const int threads = static_cast<int>(std::min<int64_t>(((C + 31) / 32) * 32, kSolveCudaMaxC));
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(N, int64_t{1} << 30));
  if (panel_fits(C)) {
    const size_t smem = static_cast<size_t>(panel_smem_floats(C)) * sizeof(float);
    const int rc = static_cast<int>(
        cudaFuncSetAttribute(solve_panel_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    if (rc != 0) return rc;
    solve_panel_kernel<<<blocks, threads, smem, stream>>>(A, beta, N, static_cast<int>(C), Minv);
  } else {
    solve_global_kernel<<<blocks, threads, 0, stream>>>(A, beta, N, static_cast<int>(C), Minv);
  }
  return static_cast<int>(cudaGetLastError());
}

}  // namespace sdm
