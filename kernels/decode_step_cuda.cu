// The fused decode step on the GPU (kernels/decode_step.h), one launch. A block owns one stream and a tile of
// columns, a thread one column: it runs the stream's whole token on its column in lane order, so every bank cell
// has one writer and every sum a fixed order, with no barrier but the one after the block computes the stream's
// lanes (slots, weights, decay factors, and the first write lane of each write and read slot) into shared memory.
// Only the W written rows are touched. A thread loads its column of kBatch rows at once, so that the loads wait
// for memory together. Built with -fmad=false: multiplies and adds are rounded separately, as on the CPU.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/bf16.h"
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

// Lanes whose bank rows a thread loads at once: independent loads in flight together, so that a token waits for
// about ceil(W / kBatch) + ceil(R / kBatch) memory latencies, not W + R.
constexpr int kBatch = 16;

// Shared memory of a block: the working rows cur [W][threads], then per write lane its slot, weight, decay factor
// exp(x) and first lane, and per read lane its slot, weight and the write lane of its slot (all 4 bytes).
int64_t shared_bytes(const DecodeDims& dm, int threads) { return 4 * (dm.W * threads + 4 * dm.W + 3 * dm.R); }

template <typename T>
__global__ void decode_step_kernel(DecodeDims dm, DecodeToken<T> tok, T* __restrict__ bank, int64_t tiles) {
  extern __shared__ float shared[];
  const int W = static_cast<int>(dm.W), R = static_cast<int>(dm.R), threads = blockDim.x;
  const int64_t K = dm.K, D = dm.D;
  const int64_t s = blockIdx.x / tiles;
  const int64_t j = (blockIdx.x % tiles) * threads + threadIdx.x;
  float* cur = shared + threadIdx.x;  // this column's working row of lane n at cur[n * threads]
  float* k_val = shared + W * threads;
  float* decay = k_val + W;
  float* q_val = decay + W;
  int32_t* k_slot = reinterpret_cast<int32_t*>(q_val + R);
  int32_t* first = k_slot + W;
  int32_t* q_slot = first + W;
  int32_t* read_lane = q_slot + R;

  // The stream's lanes, once per block.
  const int32_t* k_idx = tok.k_idx + s * W;
  const int32_t* q_idx = tok.q_idx + s * R;
  for (int n = threadIdx.x; n < W; n += threads) {
    k_slot[n] = k_idx[n];
    first[n] = first_write_lane(k_idx, W, K, k_idx[n]);
    k_val[n] = to_f(tok.k_val[s * W + n]);
    decay[n] = expf(tok.x[dm.per_write_gates ? s * W + n : s]);
  }
  for (int m = threadIdx.x; m < R; m += threads) {
    q_slot[m] = q_idx[m];
    read_lane[m] = first_write_lane(k_idx, W, K, q_idx[m]);
    q_val[m] = to_f(tok.q_val[s * R + m]);
  }
  __syncthreads();
  if (j >= D) return;

  T* col = bank + s * K * D + j;  // column j of the stream's rows: row r at col[r * D]
  for (int n0 = 0; n0 < W; n0 += kBatch) {  // each distinct written row decays once
    float row[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int n = n0 + i;
      row[i] = n < W && first[n] == n ? to_f(col[k_slot[n] * D]) : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int n = n0 + i;
      if (n < W && first[n] == n) cur[n * threads] = decay[n] * row[i];
    }
  }
  float d = 0.0f;  // pred, then the delta-rule correction
  for (int n = 0; n < W; ++n) {
    if (first[n] >= 0) d += k_val[n] * cur[first[n] * threads];
  }
  d = tok.beta[s] * (to_f(tok.v[s * D + j]) - d);
  for (int n = 0; n < W; ++n) {
    if (first[n] >= 0) cur[first[n] * threads] += k_val[n] * d;
  }
  for (int n = 0; n < W; ++n) {
    if (first[n] == n) col[k_slot[n] * D] = from_f(cur[n * threads], col);
  }
  // Reads after the write: a written row from its float32 working row, any other from the bank.
  float y = 0.0f;
  for (int m0 = 0; m0 < R; m0 += kBatch) {
    float row[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int m = m0 + i;
      const bool stored = m < R && q_slot[m] >= 0 && q_slot[m] < K && read_lane[m] < 0;
      row[i] = stored ? to_f(col[q_slot[m] * D]) : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int m = m0 + i;
      if (m < R && q_slot[m] >= 0 && q_slot[m] < K)
        y += q_val[m] * (read_lane[m] >= 0 ? cur[read_lane[m] * threads] : row[i]);
    }
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

// The device type of a bank type: sdm::bf16 (the host's name) is __nv_bfloat16 here, with the same layout.
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
int decode_step_cuda(const DecodeDims& dm, const DecodeToken<BankT>& tok, BankT* bank, CUstream_st* stream) {
  using T = typename Device<BankT>::type;
  const DecodeToken<T> t{tok.k_idx, reinterpret_cast<const T*>(tok.k_val), tok.x, reinterpret_cast<const T*>(tok.v),
                         tok.beta, tok.q_idx, reinterpret_cast<const T*>(tok.q_val), reinterpret_cast<T*>(tok.y)};
  return launch(dm, t, reinterpret_cast<T*>(bank), stream);
}

template int decode_step_cuda<float>(const DecodeDims&, const DecodeToken<float>&, float*, CUstream_st*);
template int decode_step_cuda<bf16>(const DecodeDims&, const DecodeToken<bf16>&, bf16*, CUstream_st*);

}  // namespace sdm
