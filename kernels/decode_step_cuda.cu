// The fused decode step on the GPU (kernels/decode_step.h), one launch. A block owns one stream and a tile of
// columns, a thread one column: it runs the stream's whole token on its column in lane order, so every bank cell
// has one writer and every sum a fixed order, with no barrier but the one after the block computes the stream's
// lane maps (first write lane of each write and read slot) into shared memory. Only the W written rows are
// touched; each thread loads its column of several rows before using the first. The layer's step
// (layer_decode_step_kernel) runs the same column code (step_column) with a block per stream, its lanes made in the
// kernel and its readings normed there. Built with -fmad=false: multiplies and adds are rounded separately, as on
// the CPU.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/bf16_cuda.cuh"
#include "kernels/decode_step.h"
#include "kernels/product_key_topk_warp.cuh"

namespace sdm {
namespace {

constexpr int kMaxThreads = 128;               // columns per block
constexpr int kMinThreads = 32;                // one warp
constexpr int64_t kSharedBytes = 48 * 1024;    // the default dynamic shared memory limit (no opt-in needed)

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float from_f(float x, float*) { return x; }
__device__ __forceinline__ __nv_bfloat16 from_f(float x, __nv_bfloat16*) { return __float2bfloat16_rn(x); }

// Shared memory of a block: the working rows cur [W][threads] (float), then the token's lanes (LaneShared):
// loaded or made once by the block, in parallel, instead of once per lane in each thread's serial loops.
struct LaneShared {
  int32_t* first;      // [W] first write lane of each write lane's slot
  int32_t* read_lane;  // [R] first write lane of each read lane's slot
  int32_t* k_idx;      // [W]
  int32_t* q_idx;      // [R]
  float* k_val;        // [W]
  float* q_val;        // [R]
  float* x;            // [W] log-gates (one per lane, or x[0] for the token)
  float* end;          // what follows the lanes
};
__host__ __device__ inline int64_t lane_floats(int64_t W, int64_t R) { return 3 * (W + R) + W; }
__device__ inline LaneShared lane_shared(float* base, int64_t W, int64_t R) {
  LaneShared ln;
  ln.first = reinterpret_cast<int32_t*>(base);
  ln.read_lane = ln.first + W;
  ln.k_idx = ln.read_lane + R;
  ln.q_idx = ln.k_idx + W;
  ln.k_val = reinterpret_cast<float*>(ln.q_idx + R);
  ln.q_val = ln.k_val + W;
  ln.x = ln.q_val + R;
  ln.end = ln.x + W;
  return ln;
}
int64_t shared_bytes(const DecodeDims& dm, int threads) { return 4 * (dm.W * threads + lane_floats(dm.W, dm.R)); }
// The layer's kernel adds beta, the readings y [D] and four scalars (b, a and the head's gate parameters, then
// the norm's statistics).
__host__ __device__ inline int64_t shared_bytes(const LayerDecodeDims& dm, int threads) {
  return 4 * (dm.W * threads + lane_floats(dm.W, dm.R) + 1 + dm.D + 4);
}
// The ranking layer kernel adds, 16-byte aligned (as the top-k's own kernels give the warp selection), the two
// lists' scores and ids [2k] each, a sort buffer per ranking warp, and the two rows' top lists.
__host__ __device__ inline int64_t rank_offset(const LayerDecodeDims& dm, int threads) {
  return (shared_bytes(dm, threads) + 15) / 16 * 16;
}
// The ranking layer kernel's widest block: a warp per row and factor, or two (rank_split), or kMaxThreads columns.
constexpr int kLayerMaxThreads = 64 * kLayerRankMaxFactors;
// Factors longer than kSplitAbove are ranked by two warps each, half the elements a warp (select_factor_half), where
// the block can have the 4 F warps. One warp's selection of 1024 keys is straight-line code of 32 chunks whose
// instruction fetch stalled the warp more than its keys' loads did (ncu at K 2^20, 2026-12-05, H200).
constexpr int kSplitAbove = 256;
__host__ __device__ inline bool rank_split(const ProductKeyDims& pk) {
  int32_t longest = 0;
  for (int f = 0; f < pk.F; ++f) longest = pk.n[f] > longest ? pk.n[f] : longest;
  return longest > kSplitAbove && 128 * pk.F <= kLayerMaxThreads;
}
__host__ __device__ inline int rank_warps(const ProductKeyDims& pk) { return (rank_split(pk) ? 4 : 2) * pk.F; }
int64_t shared_bytes(const LayerDecodeDims& dm, const ProductKeyDims& pk, int threads) {
  return rank_offset(dm, threads) + 16 * pk.k +
         8 * (rank_warps(pk) * topk_warp::sort_slots(pk) + 2 * int64_t{pk.tops});
}

// Bank rows a thread loads before using the first (one per lane): the step is a short chain of dependent loads,
// and a loop that waits for each row in turn costs one memory latency per lane. 16 covers the written rows, then
// the read rows, of W, R <= 16 in one round each.
constexpr int kInFlight = 16;

// The token on one column of a stream's rows (row r's element at col[r * D]), the lanes in shared memory: returns
// the column's reading in float32. `cur` is the thread's working column (lane n at cur[n * stride]).
template <typename T>
__device__ float step_column(const LaneShared& ln, float* cur, int64_t stride, T* col, int64_t W, int64_t R,
                             int64_t K, int64_t D, int64_t x_stride, float beta, float v) {
  for (int64_t n0 = 0; n0 < W; n0 += kInFlight) {  // each distinct written row decays once
    float row[kInFlight];
#pragma unroll
    for (int i = 0; i < kInFlight; ++i) {
      const int64_t n = n0 + i;
      if (n < W && ln.first[n] == n) row[i] = to_f(col[ln.k_idx[n] * D]);
    }
#pragma unroll
    for (int i = 0; i < kInFlight; ++i) {
      const int64_t n = n0 + i;
      if (n < W && ln.first[n] == n) cur[n * stride] = expf(ln.x[n * x_stride]) * row[i];
    }
  }
  float d = 0.0f;  // pred, then the delta-rule correction
  for (int64_t n = 0; n < W; ++n) {
    if (ln.first[n] >= 0) d += ln.k_val[n] * cur[ln.first[n] * stride];
  }
  d = beta * (v - d);
  for (int64_t n = 0; n < W; ++n) {
    if (ln.first[n] >= 0) cur[ln.first[n] * stride] += ln.k_val[n] * d;
  }
  for (int64_t n = 0; n < W; ++n) {
    if (ln.first[n] == n) col[ln.k_idx[n] * D] = from_f(cur[n * stride], col);
  }
  // Reads after the write: a written row from its float32 working row, any other from the bank (kInFlight at a
  // time, summed in lane order).
  float y = 0.0f;
  for (int64_t m0 = 0; m0 < R; m0 += kInFlight) {
    float row[kInFlight];
    bool ok[kInFlight];  // lane m0 + i exists and its slot is in range (an out-of-range id reads nothing)
#pragma unroll
    for (int i = 0; i < kInFlight; ++i) {
      const int64_t m = m0 + i;
      const int32_t r = m < R ? ln.q_idx[m] : -1;
      ok[i] = r >= 0 && r < K;
      if (ok[i]) row[i] = ln.read_lane[m] >= 0 ? cur[ln.read_lane[m] * stride] : to_f(col[r * D]);
    }
#pragma unroll
    for (int i = 0; i < kInFlight; ++i)
      if (ok[i]) y += ln.q_val[m0 + i] * row[i];
  }
  return y;
}

// A list's weights on one warp, in lane_weights' phases: the elementwise ones on every lane, the sum on lane 0 in
// index order (the CPU's bits), so that the chain is n adds, not n exponentials and divisions. w holds the scores.
__device__ void lane_weights_warp(float* w, int64_t n, int32_t act, float scale, bool is_bf16, int lane) {
  float top = -INFINITY;
  for (int64_t i = lane; i < n; i += 32) {
    w[i] = lane_activation(act, scale * w[i]);
    top = fmaxf(top, w[i]);
  }
  if (act == kSoftmax) {
    for (int o = 16; o > 0; o /= 2) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, o));
    for (int64_t i = lane; i < n; i += 32) w[i] = lane_exp(w[i], top);
  }
  __syncwarp();
  float denominator = 0.0f;
  if (lane == 0) denominator = lane_denominator(act, w, n);
  denominator = __shfl_sync(0xffffffffu, denominator, 0);
  for (int64_t i = lane; i < n; i += 32) w[i] = lane_weight(act, w[i], denominator, is_bf16);
}

// lane_values on the block's first two warps (its one warp, if it has one): warp 0 the write list's weights, the
// log-gates and beta; warp 1 the read list's weights. The block's width is a multiple of 32.
__device__ void lane_values_block(const LayerDecodeDims& dm, const float* gates, float b, float a, float* k_val,
                                  float* q_val, float* x, float* beta) {
  const int warp = static_cast<int>(threadIdx.x >> 5), lane = static_cast<int>(threadIdx.x & 31);
  if (warp == 0) {
    lane_weights_warp(k_val, dm.W, dm.write_act, dm.write_scale, dm.bf16, lane);
    const float g = token_log_gate(gates, a);
    if (dm.per_write_gates) {
      for (int64_t n = lane; n < dm.W; n += 32) x[n] = write_log_gate(g, k_val[n]);  // the lane's own weights
    } else if (lane == 0) {
      x[0] = g;
    }
    if (lane == 0) *beta = sigmoid_of(b);
  }
  if (warp == (blockDim.x > 32 ? 1 : 0)) lane_weights_warp(q_val, dm.R, dm.read_act, dm.read_scale, dm.bf16, lane);
}

template <typename T>
__global__ void decode_step_kernel(DecodeDims dm, DecodeToken<T> tok, T* __restrict__ bank, int64_t tiles) {
  extern __shared__ float shared[];
  const int64_t W = dm.W, R = dm.R, K = dm.K, D = dm.D;
  const int64_t s = blockIdx.x / tiles;
  const int64_t j = (blockIdx.x % tiles) * blockDim.x + threadIdx.x;
  const LaneShared ln = lane_shared(shared + W * blockDim.x, W, R);
  const int32_t* k_idx_in = tok.k_idx + s * W;
  for (int64_t n = threadIdx.x; n < W; n += blockDim.x) {
    ln.k_idx[n] = k_idx_in[n];
    ln.k_val[n] = to_f(tok.k_val[s * W + n]);
    ln.first[n] = first_write_lane(k_idx_in, W, K, k_idx_in[n]);
    if (dm.per_write_gates) ln.x[n] = tok.x[s * W + n];
  }
  for (int64_t m = threadIdx.x; m < R; m += blockDim.x) {
    ln.q_idx[m] = tok.q_idx[s * R + m];
    ln.q_val[m] = to_f(tok.q_val[s * R + m]);
    ln.read_lane[m] = first_write_lane(k_idx_in, W, K, ln.q_idx[m]);
  }
  if (!dm.per_write_gates && threadIdx.x == 0) ln.x[0] = tok.x[s];
  __syncthreads();
  if (j >= D) return;
  const float y = step_column(ln, shared + threadIdx.x, blockDim.x, bank + s * K * D + j, W, R, K, D,
                              dm.per_write_gates ? 1 : 0, tok.beta[s], to_f(tok.v[s * D + j]));
  tok.y[s * D + j] = from_f(y, tok.y);
}

// The layer's step: a block per stream, its columns in batches of the block's width. kRank: warps F q + f (q = 0
// the write row, 1 the read row) select factor f's top list of row q (with long factors, rank_split, warps
// 2 (F q + f) + h half h of it each, then the even warp of each two merges), then warp q its top k, as the top-k's
// block-per-row kernel does (kernels/product_key_topk_warp.cuh), into shared memory. The block loads the lanes,
// two warps make their weights and gates (lane_values_block), the block runs the step on every column, keeps the
// rounded readings in shared memory, warp 0 sums them for the norm (warp_order_sums' order), then every thread
// writes the outputs of its columns.
template <typename T, bool kRank>
__global__ void __launch_bounds__(kLayerMaxThreads, 1)
    layer_decode_step_kernel(LayerDecodeDims dm, LayerDecodeInputs in, T* __restrict__ bank,
                             const __grid_constant__ ProductKeyDims pk, const int32_t* __restrict__ table) {
  extern __shared__ __align__(16) float shared[];
  const int64_t W = dm.W, R = dm.R, K = dm.K, D = dm.D;
  const int64_t s = blockIdx.x;
  const LaneShared ln = lane_shared(shared + W * blockDim.x, W, R);
  float* beta = ln.end;
  float* y = beta + 1;   // [D]
  float* stats = y + D;  // b, a and the gate parameters, then the norm's shift and multiplier
  const int64_t row = proj_row(dm, s);
  // The global loads that do not depend on the lists, issued before the ranking and the barriers rather than after
  // them: the thread's first value column and output column, and the block's last threads' scalars (b, a and the
  // head's gate parameters, stored to shared memory after the ranking).
  const bool first_column = threadIdx.x < D;
  const float v_first = first_column ? value_at(in.proj, row + dm.v_off + threadIdx.x, dm.bf16) : 0.0f;
  const OutColumn out_first = first_column ? out_column(dm, in, s, threadIdx.x) : OutColumn{};
  const int last = blockDim.x - 1;  // threads that load one list entry less (W, R <= the block's width, mostly)
  const int64_t from_last = last - static_cast<int64_t>(threadIdx.x);  // the last four threads load stats[from_last]
  float stat = 0.0f;
  if (from_last == 0) stat = value_at(in.proj, row + dm.b_off, dm.bf16);
  if (from_last == 1) stat = value_at(in.proj, row + dm.a_off, dm.bf16);
  if (from_last == 2 || from_last == 3) stat = in.gates[gate_params(dm, s) + from_last - 2];
  const int32_t* ids = nullptr;  // the stream's lists: in global memory, or ranked into shared memory (kRank)
  const float* scores = nullptr;
  if constexpr (!kRank) {
    ids = in.ids + write_list(dm, s);
    scores = in.scores + write_list(dm, s);
  } else {
    float* list_scores = reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(shared) +
                                                  rank_offset(dm, blockDim.x));  // [2k]
    int32_t* list_ids = reinterpret_cast<int32_t*>(list_scores + 2 * pk.k);       // [2k]
    uint64_t* bufs = reinterpret_cast<uint64_t*>(list_ids + 2 * pk.k);            // [rank_warps][sort slots]
    const int64_t slots = topk_warp::sort_slots(pk);
    topk_warp::Top* tops = reinterpret_cast<topk_warp::Top*>(bufs + rank_warps(pk) * slots);  // [2][tops]
    const int warp = static_cast<int>(threadIdx.x >> 5), lane = static_cast<int>(threadIdx.x & 31);
    if (rank_split(pk)) {  // warp 4 (q F + f) + h ranks half h of row q's factor f; the even one of the two merges
      const int pair = warp / 2, q = pair / pk.F, f = pair % pk.F;
      const bool ranks = warp < 4 * pk.F;
      const T* xr = static_cast<const T*>(in.proj) + row + (ranks ? dm.rank_off[q] : 0);
      if (ranks) topk_warp::select_factor_half<true, 16>(pk, xr, f, warp % 2, bufs + warp * slots, lane);
      __syncthreads();
      if (ranks && warp % 2 == 0)
        topk_warp::merge_factor(pk, xr, f, bufs + warp * slots, bufs + (warp + 1) * slots, tops + q * pk.tops, lane);
    } else if (warp < 2 * pk.F) {
      const int q = warp / pk.F, f = warp % pk.F;
      topk_warp::select_factor<true, 32>(pk, static_cast<const T*>(in.proj) + row + dm.rank_off[q], f,
                                         bufs + warp * slots, tops + q * pk.tops, lane);
    }
    __syncthreads();
    if (warp < 2) {
      topk_warp::select_slots<true, 32>(pk, tops + warp * pk.tops, table, bufs + warp * pk.F * slots,
                                        list_scores + warp * pk.k, list_ids + warp * pk.k, lane);
    }
    __syncthreads();
    ids = list_ids;
    scores = list_scores;
  }
  // The lists' ids and scores and the scalars into shared memory across the block; then two warps make the weights
  // and gates from the copies there.
  for (int64_t n = threadIdx.x; n < W; n += blockDim.x) {
    ln.k_idx[n] = ids[n];
    ln.k_val[n] = scores[n];
  }
  for (int64_t m = threadIdx.x; m < R; m += blockDim.x) {
    ln.q_idx[m] = ids[dm.k + m];
    ln.q_val[m] = scores[dm.k + m];
  }
  if (from_last < 4) stats[from_last] = stat;
  __syncthreads();
  lane_values_block(dm, stats + 2, stats[0], stats[1], ln.k_val, ln.q_val, ln.x, beta);
  // The lane maps need the ids only: the block's last threads make them, beside the weights' two warps where the
  // block has more.
  for (int64_t i = from_last; i < W + R; i += blockDim.x) {
    if (i < W)
      ln.first[i] = first_write_lane(ln.k_idx, W, K, ln.k_idx[i]);
    else
      ln.read_lane[i - W] = first_write_lane(ln.k_idx, W, K, ln.q_idx[i - W]);
  }
  __syncthreads();
  T* rows = bank + s * K * D;
  for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
    const float v = j == threadIdx.x ? v_first : value_at(in.proj, row + dm.v_off + j, dm.bf16);
    y[j] = rounded_value(step_column(ln, shared + threadIdx.x, blockDim.x, rows + j, W, R, K, D,
                                     dm.per_write_gates ? 1 : 0, *beta, v),
                         dm.bf16);
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    float sum = 0.0f, sum_sq = 0.0f;
    if (dm.norm != kNoNorm) {
      for (int64_t j = threadIdx.x; j < D; j += 32) {
        sum += y[j];
        sum_sq += y[j] * y[j];
      }
      for (int o = 16; o > 0; o /= 2) {
        sum += __shfl_xor_sync(0xffffffffu, sum, o);
        sum_sq += __shfl_xor_sync(0xffffffffu, sum_sq, o);
      }
    }
    if (threadIdx.x == 0) {
      stats[0] = 0.0f;
      stats[1] = 1.0f;
      if (dm.norm != kNoNorm) norm_stats(dm, sum, sum_sq, &stats[0], &stats[1]);
    }
  }
  __syncthreads();
  T* out = static_cast<T*>(in.out) + s * D;
  for (int64_t j = threadIdx.x; j < D; j += blockDim.x)
    out[j] = from_f(layer_out(dm, j == threadIdx.x ? out_first : out_column(dm, in, s, j), y[j], stats[0], stats[1]),
                    out);
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

// A block per stream, as wide as the columns (up to kMaxThreads) while its shared memory fits the default limit.
template <typename T>
int launch_layer(const LayerDecodeDims& dm, const LayerDecodeInputs& in, T* bank, cudaStream_t stream) {
  if (dm.S <= 0 || dm.D <= 0) return static_cast<int>(cudaSuccess);
  int threads = static_cast<int>(std::min<int64_t>(kMaxThreads, (dm.D + 31) / 32 * 32));
  while (threads > kMinThreads && shared_bytes(dm, threads) > kSharedBytes) threads /= 2;
  if (shared_bytes(dm, threads) > kSharedBytes || dm.S > 0x7fffffff) return static_cast<int>(cudaErrorInvalidValue);
  layer_decode_step_kernel<T, false><<<static_cast<unsigned>(dm.S), threads, shared_bytes(dm, threads), stream>>>(
      dm, in, bank, ProductKeyDims{}, nullptr);
  return static_cast<int>(cudaGetLastError());
}

// The ranking kernel: a warp per row and factor at least, its shared memory opted in beyond the default where the
// shapes need it (within kLayerRankMaxFactors and kLayerRankMaxK, below the H100's and H200's 227 KiB).
template <typename T>
int launch_layer_rank(const LayerDecodeDims& dm, const ProductKeyDims& pk, const int32_t* table,
                      const LayerDecodeInputs& in, T* bank, cudaStream_t stream) {
  if (dm.S <= 0 || dm.D <= 0) return static_cast<int>(cudaSuccess);
  if (pk.F < 1 || pk.F > kLayerRankMaxFactors || pk.k > kLayerRankMaxK || dm.k != pk.k || dm.S > 0x7fffffff)
    return static_cast<int>(cudaErrorInvalidValue);
  const int threads = static_cast<int>(
      std::max<int64_t>(32 * rank_warps(pk), std::min<int64_t>(kMaxThreads, (dm.D + 31) / 32 * 32)));
  const int64_t bytes = shared_bytes(dm, pk, threads);
  const auto kernel = layer_decode_step_kernel<T, true>;
  if (bytes > kSharedBytes) {
    const int rc = static_cast<int>(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
    if (rc) return rc;
  }
  kernel<<<static_cast<unsigned>(dm.S), threads, bytes, stream>>>(dm, in, bank, pk, table);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int layer_decode_step_cuda(const LayerDecodeDims& dm, const LayerDecodeInputs& in, void* bank, CUstream_st* stream) {
  if (dm.bf16) return launch_layer(dm, in, static_cast<__nv_bfloat16*>(bank), stream);
  return launch_layer(dm, in, static_cast<float*>(bank), stream);
}

int layer_decode_rank_step_cuda(const LayerDecodeDims& dm, const ProductKeyDims& pk, const int32_t* table,
                                const LayerDecodeInputs& in, void* bank, CUstream_st* stream) {
  if (dm.bf16) return launch_layer_rank(dm, pk, table, in, static_cast<__nv_bfloat16*>(bank), stream);
  return launch_layer_rank(dm, pk, table, in, static_cast<float*>(bank), stream);
}

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
