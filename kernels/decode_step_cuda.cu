// The fused decode step on the GPU (kernels/decode_step.h), one launch. A block owns one stream and a tile of
// columns, a thread one column: it runs the stream's whole token on its column in lane order, so every bank cell
// has one writer and every sum a fixed order, with no barrier but the one after the block computes the stream's
// lane maps (first write lane of each write and read slot) into shared memory. Only the W written rows are
// touched; each thread loads its column of several rows before using the first. Built with -fmad=false: multiplies
// and adds are rounded separately, as on the CPU.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/bf16_cuda.cuh"
#include "kernels/decode_step.h"

namespace sdm {
namespace {

constexpr int kMaxThreads = 128;               // columns per block
constexpr int kMinThreads = 32;                // one warp
constexpr int64_t kSharedBytes = 48 * 1024;    // the default dynamic shared memory limit (no opt-in needed)

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float from_f(float x, float*) { return x; }
__device__ __forceinline__ __nv_bfloat16 from_f(float x, __nv_bfloat16*) { return __float2bfloat16_rn(x); }

// Shared memory of a block: the working rows cur [W][threads] (float), then first [W], read_lane [R], the token's
// slot ids k_idx [W], q_idx [R] (int32) and weights k_val [W], q_val [R] (float): loaded once by the block, in
// parallel, instead of once per lane in each thread's serial loops.
int64_t shared_bytes(const DecodeDims& dm, int threads) { return 4 * (dm.W * threads + 3 * (dm.W + dm.R)); }

// Bank rows a thread loads before using the first (one per lane): the step is a short chain of dependent loads,
// and a loop that waits for each row in turn costs one memory latency per lane. 16 covers the written rows, then
// the read rows, of W, R <= 16 in one round each.
constexpr int kInFlight = 16;

template <typename T>
__global__ void decode_step_kernel(DecodeDims dm, DecodeToken<T> tok, T* __restrict__ bank, int64_t tiles) {
  extern __shared__ float shared[];
  const int64_t W = dm.W, R = dm.R, K = dm.K, D = dm.D;
  const int64_t s = blockIdx.x / tiles;
  const int64_t j = (blockIdx.x % tiles) * blockDim.x + threadIdx.x;
  float* cur = shared + threadIdx.x;  // this column's working row of lane n at cur[n * blockDim.x]
  int32_t* first = reinterpret_cast<int32_t*>(shared + W * blockDim.x);
  int32_t* read_lane = first + W;
  int32_t* k_idx = read_lane + R;  // the token's slot ids, in shared memory: the row loads depend on them
  int32_t* q_idx = k_idx + W;
  float* k_val = reinterpret_cast<float*>(q_idx + R);
  float* q_val = k_val + W;
  const int32_t* k_idx_in = tok.k_idx + s * W;
  for (int64_t n = threadIdx.x; n < W; n += blockDim.x) {
    k_idx[n] = k_idx_in[n];
    k_val[n] = to_f(tok.k_val[s * W + n]);
    first[n] = first_write_lane(k_idx_in, W, K, k_idx_in[n]);
  }
  for (int64_t m = threadIdx.x; m < R; m += blockDim.x) {
    q_idx[m] = tok.q_idx[s * R + m];
    q_val[m] = to_f(tok.q_val[s * R + m]);
    read_lane[m] = first_write_lane(k_idx_in, W, K, q_idx[m]);
  }
  __syncthreads();
  if (j >= D) return;

  const float* x = tok.x + (dm.per_write_gates ? s * W : s);
  T* col = bank + s * K * D + j;  // column j of the stream's rows: row r at col[r * D]
  // The first kInFlight read lanes' rows that this token does not write are loaded now, in the same round as the
  // written rows (the write does not touch them): one memory latency less per step.
  float early[kInFlight];
#pragma unroll
  for (int i = 0; i < kInFlight; ++i) {
    const int32_t r = i < R ? q_idx[i] : -1;
    if (r >= 0 && r < K && read_lane[i] < 0) early[i] = to_f(col[r * D]);
  }
  for (int64_t n0 = 0; n0 < W; n0 += kInFlight) {  // each distinct written row decays once
    float row[kInFlight];
#pragma unroll
    for (int i = 0; i < kInFlight; ++i) {
      const int64_t n = n0 + i;
      if (n < W && first[n] == n) row[i] = to_f(col[k_idx[n] * D]);
    }
#pragma unroll
    for (int i = 0; i < kInFlight; ++i) {
      const int64_t n = n0 + i;
      if (n < W && first[n] == n) cur[n * blockDim.x] = expf(x[dm.per_write_gates ? n : 0]) * row[i];
    }
  }
  float d = 0.0f;  // pred, then the delta-rule correction
  for (int64_t n = 0; n < W; ++n) {
    if (first[n] >= 0) d += k_val[n] * cur[first[n] * blockDim.x];
  }
  d = tok.beta[s] * (to_f(tok.v[s * D + j]) - d);
  for (int64_t n = 0; n < W; ++n) {
    if (first[n] >= 0) cur[first[n] * blockDim.x] += k_val[n] * d;
  }
  for (int64_t n = 0; n < W; ++n) {
    if (first[n] == n) col[k_idx[n] * D] = from_f(cur[n * blockDim.x], col);
  }
  // Reads after the write: a written row from its float32 working row, any other from the bank (kInFlight at a
  // time, the first of them loaded early; summed in lane order).
  float y = 0.0f;
  for (int64_t m0 = 0; m0 < R; m0 += kInFlight) {
    float row[kInFlight];
    bool ok[kInFlight];  // lane m0 + i exists and its slot is in range (an out-of-range id reads nothing)
#pragma unroll
    for (int i = 0; i < kInFlight; ++i) {
      const int64_t m = m0 + i;
      const int32_t r = m < R ? q_idx[m] : -1;
      ok[i] = r >= 0 && r < K;
      if (ok[i]) row[i] = read_lane[m] >= 0 ? cur[read_lane[m] * blockDim.x] : m0 == 0 ? early[i] : to_f(col[r * D]);
    }
#pragma unroll
    for (int i = 0; i < kInFlight; ++i)
      if (ok[i]) y += q_val[m0 + i] * row[i];
  }
  tok.y[s * D + j] = from_f(y, tok.y);
}

template <typename T>
int launch(const DecodeDims& dm, const DecodeToken<T>& tok, T* bank, cudaStream_t stream) {
  if (dm.S <= 0 || dm.D <= 0) return static_cast<int>(cudaSuccess);
  // Launch configuration from the shapes only: the widest tile (up to one column per thread) whose working rows
  // fit the default shared memory. W, R <= 256 keep one warp's tile within it.
  int threads = static_cast<int>(std::min<int64_t>(kMaxThreads, (dm.D + 31) / 32 * 32));
  while (threads > kMinThreads && shared_bytes(dm, threads) > kSharedBytes) threads /= 2;
  if (shared_bytes(dm, threads) > kSharedBytes) return static_cast<int>(cudaErrorInvalidValue);
  const int64_t tiles = (dm.D + threads - 1) / threads;
  const int64_t blocks = dm.S * tiles;
  if (blocks > 0x7fffffff) return static_cast<int>(cudaErrorInvalidValue);
  decode_step_kernel<T><<<static_cast<unsigned>(blocks), threads, shared_bytes(dm, threads), stream>>>(
      dm, tok, bank, tiles);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

template <typename BankT>
int decode_step_cuda(const DecodeDims& dm, const DecodeToken<BankT>& tok, BankT* bank, CUstream_st* stream) {
  using T = typename Device<BankT>::type;
  const DecodeToken<T> t{tok.k_idx, reinterpret_cast<const T*>(tok.k_val), tok.x, reinterpret_cast<const T*>(tok.v),
                         tok.beta, tok.q_idx, reinterpret_cast<const T*>(tok.q_val), reinterpret_cast<T*>(tok.y)};
  return launch(dm, t, reinterpret_cast<T*>(bank), stream);
}

template int decode_step_cuda<float>(const DecodeDims&, const DecodeToken<float>&, float*, CUstream_st*);
template int decode_step_cuda<bf16>(const DecodeDims&, const DecodeToken<bf16>&, bf16*, CUstream_st*);

}  // namespace sdm
