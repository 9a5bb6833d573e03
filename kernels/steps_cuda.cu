// CUDA chunk steps (SPEC 1.2 "Phase 2", SPEC 1.4): the same math and summation orders as steps_cpu.cc, laid
// out for the GPU. The host loops over the chunks and enqueues, per chunk, a few maximally parallel kernels on
// the caller's stream (SPEC 7: one program per slot group or per column slice):
//
//   forward   dense  (stream, column slice): gathers G and Q0, u, delta = Minv u, y = Q0 + QK delta
//             write  (stream, write group, one warp): snapshot, then cpe * S0 + sum_e w[e] delta[t_e], written once
//   backward  dense  (stream, column slice): ddelta = GWR gather + QK^T dy, du = Minv^T ddelta, dv, dG
//             dots   (stream, token row): dA, dQK rows and dbeta (full-width dots, fixed reduction trees)
//             phase A (stream, write group, one warp): dcpe, dw, dk_eff dots, the gradient row, the restore
//             read side (stream, read group, one warp): dS0 += q_w dy, dq_w on the restored rows
//
// One writer per bank row, gradient row and output cell; every reduction in a fixed order (warp shuffles in a
// fixed xor tree, sequential loops in sorted order): bitwise reproducible, no atomics.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/bf16.h"
#include "kernels/steps.h"

namespace sdm {
namespace {

constexpr int kSlice = 32;         // columns per block of the dense kernels
constexpr int kDenseThreads = 256;
constexpr int kGroupWarps = 8;     // warps (= groups) per block of the group kernels

__device__ __forceinline__ float load(const float* p) { return *p; }
__device__ __forceinline__ float load(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ void store(float* p, float x) { *p = x; }
__device__ __forceinline__ void store(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }

__device__ __forceinline__ int64_t unit_of(const StepDims& dm, int64_t s, int64_t c) {
  return ((s / dm.P) * dm.NC + c) * dm.P + s % dm.P;
}

// Sum over the warp in a fixed xor tree: every lane gets the same, reproducible value.
__device__ __forceinline__ float warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

template <typename A, typename B>
__device__ __forceinline__ float warp_dot(const A* a, const B* b, int64_t D, int lane) {
  float s = 0.f;
  for (int64_t d = lane; d < D; d += 32) s += load(a + d) * load(b + d);
  return warp_sum(s);
}

// Where a chunk's write vectors live: the delta residual (per unit) or, in a no-grad call, the workspace
// (per stream).
struct DeltaAt {
  float* base;
  bool per_unit;
  __device__ __forceinline__ float* operator()(const StepDims& dm, int64_t u, int64_t s) const {
    return base + (per_unit ? u : s) * dm.C * dm.D;
  }
};

template <typename BankT>
__global__ void fwd_dense_kernel(StepDims dm, StepPhase1 p1, ForwardIO io, const BankT* __restrict__ bank,
                                 int64_t c, DeltaAt delta_at) {
  extern __shared__ float sh[];
  const int64_t C = dm.C, W = dm.W, R = dm.R, D = dm.D, K = dm.K;
  const int64_t s = blockIdx.x, d0 = static_cast<int64_t>(blockIdx.y) * kSlice;
  const int64_t u = unit_of(dm, s, c);
  float* su = sh;
  float* sq = sh + C * kSlice;
  float* sdelta = sh + 2 * C * kSlice;
  const BankT* S = bank + s * K * D;
  const int32_t* k_idx = p1.k_idx + u * C * W;
  const int32_t* q_idx = p1.q_idx + u * C * R;
  const float* k_eff = p1.k_eff + u * C * W;
  const float* q_w = p1.q_w + u * C * R;
  for (int idx = threadIdx.x; idx < C * kSlice; idx += blockDim.x) {
    const int64_t t = idx / kSlice, d = d0 + idx % kSlice;
    if (d >= D) {
      su[idx] = sq[idx] = 0.f;
      continue;
    }
    float G = 0.f, Q0 = 0.f;
    for (int64_t n = 0; n < W; ++n) {
      const int32_t slot = k_idx[t * W + n];
      if (slot >= 0 && slot < K) G += k_eff[t * W + n] * load(S + slot * D + d);
    }
    for (int64_t m = 0; m < R; ++m) {
      const int32_t slot = q_idx[t * R + m];
      if (slot >= 0 && slot < K) Q0 += q_w[t * R + m] * load(S + slot * D + d);
    }
    const int64_t k = (u * C + t) * D + d;
    su[idx] = io.beta[u * C + t] * (io.v[k] - G);
    sq[idx] = Q0;
    if (io.G) io.G[k] = G;
  }
  __syncthreads();
  const float* minv = p1.minv + u * C * C;
  float* delta = delta_at(dm, u, s);
  for (int idx = threadIdx.x; idx < C * kSlice; idx += blockDim.x) {
    const int64_t i = idx / kSlice, dd = idx % kSlice;
    float x = 0.f;
    for (int64_t j = 0; j <= i; ++j) x += minv[i * C + j] * su[j * kSlice + dd];
    sdelta[idx] = x;
    if (d0 + dd < D) delta[i * D + d0 + dd] = x;
  }
  __syncthreads();
  const float* QK = p1.QK + u * C * C;
  for (int idx = threadIdx.x; idx < C * kSlice; idx += blockDim.x) {
    const int64_t i = idx / kSlice, dd = idx % kSlice;
    if (d0 + dd >= D) continue;
    float y = 0.f;
    for (int64_t j = 0; j <= i; ++j) y += QK[i * C + j] * sdelta[j * kSlice + dd];
    io.y[(u * C + i) * D + d0 + dd] = y + sq[idx];
  }
}

// The write group g of unit u: sorted entries [lo, hi) and the slot, or -1.
__device__ __forceinline__ int32_t group_of(const int32_t* order, const int32_t* group, const int32_t* idx,
                                            int64_t g, int64_t K, int32_t* lo, int32_t* hi) {
  *lo = group[g];
  *hi = group[g + 1];
  if (*lo >= *hi || order[*lo] < 0) return -1;
  const int32_t s = idx[order[*lo]];
  return (s >= 0 && s < K) ? s : -1;
}

template <typename BankT>
__global__ void fwd_write_kernel(StepDims dm, StepPhase1 p1, ForwardIO io, BankT* __restrict__ bank, int64_t c,
                                 DeltaAt delta_at) {
  const int64_t C = dm.C, W = dm.W, D = dm.D, K = dm.K;
  const int64_t s = blockIdx.x;
  const int64_t g = static_cast<int64_t>(blockIdx.y) * kGroupWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (g >= C * W) return;
  const int64_t u = unit_of(dm, s, c);
  const int32_t* order = p1.w_order + u * C * W;
  int32_t lo, hi;
  const int32_t slot = group_of(order, p1.w_group + u * (C * W + 1), p1.k_idx + u * C * W, g, K, &lo, &hi);
  if (slot < 0) return;
  BankT* row = bank + (s * K + slot) * D;
  BankT* snap = io.snapshot ? static_cast<BankT*>(io.snapshot) + (u * C * W + g) * D : nullptr;
  const float* w = p1.w + u * C * W;
  const float cpe = p1.cpe[u * C * W + order[lo]];
  const float* delta = delta_at(dm, u, s);
  for (int64_t d = lane; d < D; d += 32) {
    const BankT old = row[d];
    if (snap) snap[d] = old;
    float acc = cpe * load(&old);
    for (int32_t i = lo; i < hi; ++i) {
      const int32_t e = order[i];
      acc += w[e] * delta[(e / W) * D + d];
    }
    store(row + d, acc);
  }
}

// Backward workspace: du and dG, [streams, C, D] each.
struct BackWs {
  float* du;
  float* dG;
};

__global__ void bwd_dense_kernel(StepDims dm, StepPhase1 p1, BackwardIO io, int64_t c, BackWs ws) {
  extern __shared__ float sh[];
  const int64_t C = dm.C, W = dm.W, D = dm.D, K = dm.K;
  const int64_t s = blockIdx.x, d0 = static_cast<int64_t>(blockIdx.y) * kSlice;
  const int64_t u = unit_of(dm, s, c);
  float* sdd = sh;
  const float* dS = io.dbank + s * K * D;
  const int32_t* k_idx = p1.k_idx + u * C * W;
  const float* w = p1.w + u * C * W;
  const float* QK = p1.QK + u * C * C;
  const float* dy = io.dy + u * C * D;
  for (int idx = threadIdx.x; idx < C * kSlice; idx += blockDim.x) {
    const int64_t t = idx / kSlice, d = d0 + idx % kSlice;
    if (d >= D) {
      sdd[idx] = 0.f;
      continue;
    }
    float x = 0.f;
    for (int64_t n = 0; n < W; ++n) {
      const int32_t slot = k_idx[t * W + n];
      if (slot >= 0 && slot < K) x += w[t * W + n] * dS[slot * D + d];
    }
    float r = 0.f;
    for (int64_t i = t; i < C; ++i) r += QK[i * C + t] * dy[i * D + d];
    sdd[idx] = x + r;
  }
  __syncthreads();
  const float* minv = p1.minv + u * C * C;
  for (int idx = threadIdx.x; idx < C * kSlice; idx += blockDim.x) {
    const int64_t j = idx / kSlice, d = d0 + idx % kSlice;
    if (d >= D) continue;
    float du = 0.f;
    for (int64_t i = j; i < C; ++i) du += minv[i * C + j] * sdd[i * kSlice + idx % kSlice];
    const float b = io.beta[u * C + j];
    ws.du[(s * C + j) * D + d] = du;
    ws.dG[(s * C + j) * D + d] = -b * du;
    io.dv[(u * C + j) * D + d] = b * du;
  }
}

__global__ void bwd_dots_kernel(StepDims dm, StepPhase1 p1, BackwardIO io, int64_t c, BackWs ws) {
  __shared__ float red[kDenseThreads];
  const int64_t C = dm.C, D = dm.D;
  const int64_t s = blockIdx.x, i = blockIdx.y;
  const int64_t u = unit_of(dm, s, c);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  const float* delta = io.delta + u * C * D;
  const float* du_i = ws.du + (s * C + i) * D;
  const float* dy_i = io.dy + (u * C + i) * D;
  const float beta_i = io.beta[u * C + i];
  for (int64_t j = warp; j < C; j += warps) {
    const float a = j < i ? -beta_i * warp_dot(du_i, delta + j * D, D, lane) : 0.f;
    const float q = j <= i ? warp_dot(dy_i, delta + j * D, D, lane) : 0.f;
    if (lane == 0) {
      io.dA[(u * C + i) * C + j] = a;
      io.dQK[(u * C + i) * C + j] = q;
    }
  }
  // dbeta_i = <du_i, v_i - G_i - (A delta)_i>
  const float* A = p1.A + (u * C + i) * C;
  float part = 0.f;
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
    float ad = 0.f;
    for (int64_t j = 0; j < i; ++j) ad += A[j] * delta[j * D + d];
    const int64_t k = (u * C + i) * D + d;
    part += du_i[d] * (io.v[k] - io.G[k] - ad);
  }
  red[threadIdx.x] = part;
  __syncthreads();
  for (int o = blockDim.x / 2; o > 0; o >>= 1) {
    if (threadIdx.x < o) red[threadIdx.x] += red[threadIdx.x + o];
    __syncthreads();
  }
  if (threadIdx.x == 0) io.dbeta[u * C + i] = red[0];
}

template <typename BankT>
__global__ void bwd_phase_a_kernel(StepDims dm, StepPhase1 p1, BackwardIO io, BankT* __restrict__ bank, int64_t c,
                                   BackWs ws) {
  const int64_t C = dm.C, W = dm.W, D = dm.D, K = dm.K;
  const int64_t s = blockIdx.x;
  const int64_t g = static_cast<int64_t>(blockIdx.y) * kGroupWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (g >= C * W) return;
  const int64_t u = unit_of(dm, s, c);
  const int32_t* order = p1.w_order + u * C * W;
  int32_t lo, hi;
  const int32_t slot = group_of(order, p1.w_group + u * (C * W + 1), p1.k_idx + u * C * W, g, K, &lo, &hi);
  if (slot < 0) return;
  float* drow = io.dbank + (s * K + slot) * D;
  const BankT* s0 = static_cast<const BankT*>(io.snapshot) + (u * C * W + g) * D;
  const int64_t e0 = u * C * W + order[lo];
  const float cpe = p1.cpe[e0];
  const float* delta = io.delta + u * C * D;
  const float* dG = ws.dG + s * C * D;
  const float dcpe = warp_dot(drow, s0, D, lane);
  if (lane == 0) io.dcpe[e0] = dcpe;
  for (int32_t i = lo; i < hi; ++i) {
    const int32_t e = order[i];
    const float dw = warp_dot(delta + (e / W) * D, drow, D, lane);
    const float dk = warp_dot(dG + (e / W) * D, s0, D, lane);
    if (lane == 0) {
      io.dw[u * C * W + e] = dw;
      io.dk_eff[u * C * W + e] = dk;
    }
  }
  const float* k_eff = p1.k_eff + u * C * W;
  BankT* row = bank + (s * K + slot) * D;
  for (int64_t d = lane; d < D; d += 32) {
    float acc = cpe * drow[d];
    for (int32_t i = lo; i < hi; ++i) {
      const int32_t e = order[i];
      acc += k_eff[e] * dG[(e / W) * D + d];
    }
    drow[d] = acc;
    row[d] = s0[d];
  }
}

template <typename BankT>
__global__ void bwd_read_side_kernel(StepDims dm, StepPhase1 p1, BackwardIO io, const BankT* __restrict__ bank,
                                     int64_t c) {
  const int64_t C = dm.C, R = dm.R, D = dm.D, K = dm.K;
  const int64_t s = blockIdx.x;
  const int64_t g = static_cast<int64_t>(blockIdx.y) * kGroupWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (g >= C * R) return;
  const int64_t u = unit_of(dm, s, c);
  const int32_t* order = p1.r_order + u * C * R;
  int32_t lo, hi;
  const int32_t slot = group_of(order, p1.r_group + u * (C * R + 1), p1.q_idx + u * C * R, g, K, &lo, &hi);
  if (slot < 0) return;
  float* drow = io.dbank + (s * K + slot) * D;
  const BankT* row = bank + (s * K + slot) * D;
  const float* dy = io.dy + u * C * D;
  const float* q_w = p1.q_w + u * C * R;
  for (int32_t i = lo; i < hi; ++i) {
    const int32_t r = order[i];
    const float dq = warp_dot(dy + (r / R) * D, row, D, lane);
    if (lane == 0) io.dq_w[u * C * R + r] = dq;
  }
  for (int64_t d = lane; d < D; d += 32) {
    float acc = drow[d];
    for (int32_t i = lo; i < hi; ++i) {
      const int32_t r = order[i];
      acc += q_w[r] * dy[(r / R) * D + d];
    }
    drow[d] = acc;
  }
}

template <typename Kernel>
int smem_attribute(Kernel kernel, size_t bytes) {
  if (bytes <= 48 * 1024) return 0;
  return static_cast<int>(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(bytes)));
}

// First error of the launches so far.
inline int launched(int rc) { return rc ? rc : static_cast<int>(cudaGetLastError()); }

template <typename T>
struct Device {
  using type = T;
};
template <>
struct Device<bf16> {
  using type = __nv_bfloat16;
};

}  // namespace

template <typename BankT>
int forward_cuda(const StepDims& dm, const StepPhase1& p1, const ForwardIO& io, BankT* bank_in, float* workspace,
                 CUstream_st* stream) {
  using T = typename Device<BankT>::type;
  T* bank = reinterpret_cast<T*>(bank_in);
  if (dm.streams() == 0 || dm.NC == 0 || dm.C == 0 || dm.D == 0) return 0;
  const DeltaAt delta_at{io.delta ? io.delta : workspace, io.delta != nullptr};
  const size_t smem = 3 * dm.C * kSlice * sizeof(float);
  int rc = smem_attribute(fwd_dense_kernel<T>, smem);
  const dim3 dense_grid(dm.streams(), (dm.D + kSlice - 1) / kSlice);
  const dim3 group_grid(dm.streams(), (dm.C * dm.W + kGroupWarps - 1) / kGroupWarps);
  for (int64_t c = 0; c < dm.NC && !rc; ++c) {
    fwd_dense_kernel<T><<<dense_grid, kDenseThreads, smem, stream>>>(dm, p1, io, bank, c, delta_at);
    rc = launched(rc);
    fwd_write_kernel<T><<<group_grid, kGroupWarps * 32, 0, stream>>>(dm, p1, io, bank, c, delta_at);
    rc = launched(rc);
  }
  return rc;
}

template <typename BankT>
int backward_cuda(const StepDims& dm, const StepPhase1& p1, const BackwardIO& io, BankT* bank_in, float* workspace,
                  CUstream_st* stream) {
  using T = typename Device<BankT>::type;
  T* bank = reinterpret_cast<T*>(bank_in);
  const int64_t units = dm.units();
  int rc = 0;
  // Entries in no group (out-of-range ids, padding) get zero gradients.
  for (auto [p, n] : {std::pair{io.dk_eff, dm.W}, std::pair{io.dw, dm.W}, std::pair{io.dcpe, dm.W},
                      std::pair{io.dq_w, dm.R}}) {
    if (!rc) rc = static_cast<int>(cudaMemsetAsync(p, 0, units * dm.C * n * sizeof(float), stream));
  }
  if (dm.streams() == 0 || dm.NC == 0 || dm.C == 0 || dm.D == 0 || rc) return rc;
  const BackWs ws{workspace, workspace + dm.streams() * dm.C * dm.D};
  const size_t smem = dm.C * kSlice * sizeof(float);
  rc = smem_attribute(bwd_dense_kernel, smem);
  const dim3 dense_grid(dm.streams(), (dm.D + kSlice - 1) / kSlice);
  const dim3 dots_grid(dm.streams(), dm.C);
  const dim3 write_grid(dm.streams(), (dm.C * dm.W + kGroupWarps - 1) / kGroupWarps);
  const dim3 read_grid(dm.streams(), (dm.C * dm.R + kGroupWarps - 1) / kGroupWarps);
  for (int64_t c = dm.NC - 1; c >= 0 && !rc; --c) {
    bwd_dense_kernel<<<dense_grid, kDenseThreads, smem, stream>>>(dm, p1, io, c, ws);
    rc = launched(rc);
    bwd_dots_kernel<<<dots_grid, kDenseThreads, 0, stream>>>(dm, p1, io, c, ws);
    rc = launched(rc);
    bwd_phase_a_kernel<T><<<write_grid, kGroupWarps * 32, 0, stream>>>(dm, p1, io, bank, c, ws);
    rc = launched(rc);
    bwd_read_side_kernel<T><<<read_grid, kGroupWarps * 32, 0, stream>>>(dm, p1, io, bank, c);
    rc = launched(rc);
  }
  return rc;
}

template int forward_cuda<float>(const StepDims&, const StepPhase1&, const ForwardIO&, float*, float*, CUstream_st*);
template int forward_cuda<bf16>(const StepDims&, const StepPhase1&, const ForwardIO&, bf16*, float*, CUstream_st*);
template int backward_cuda<float>(const StepDims&, const StepPhase1&, const BackwardIO&, float*, float*,
                                  CUstream_st*);
template int backward_cuda<bf16>(const StepDims&, const StepPhase1&, const BackwardIO&, bf16*, float*,
                                 CUstream_st*);

}  // namespace sdm
