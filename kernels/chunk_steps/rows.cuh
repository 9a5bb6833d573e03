// Where the chunk-step kernels read bank rows, and the per-token gather of rows (docs/MATH.md "The forward
// chunk step": the gathers G and Q0; "Backward of a chunk": GWR): the per-chunk scratch rows of the
// workspace, the sources of a gathered row (one bank; with packed sequences the working or the initial bank; a fresh
// result's input or result, by row tag) and gather_row, the gather of one token's row.
#ifndef JAX_SDM_KERNELS_CHUNK_STEPS_ROWS_CUH_
#define JAX_SDM_KERNELS_CHUNK_STEPS_ROWS_CUH_

#include "kernels/chunk_steps/device.cuh"

namespace sdm {
namespace {

constexpr int kRowThreadsMax = 256;  // column threads (x) per block of the per-token row kernels
constexpr int kRowThreadsCap = 512;  // threads (x times parts) per block of the per-token row kernels
constexpr int kRowBlocksPerSM = 2;   // their register budget: 2 blocks of 512 threads per SM (64 registers)

// Per-chunk scratch rows ([streams, C, D] float32 each) and where the residuals go.
struct ChunkRows {
  float* G;      // forward: the gathers (when saving, the vg residual's buffer: applying the inverse replaces them
                 // by v - G)
  float* Q0;     // forward: the read gathers
  float* delta;  // forward: the write vectors (the delta residual when saving)
  bool per_unit; // residual layout (per unit) or scratch layout (per stream)
  __device__ __forceinline__ int64_t at(const StepDims& dm, int64_t u, int64_t s) const {
    return (per_unit ? u : s) * dm.C * dm.D;
  }
};

// Backward scratch ([streams, C, D] float32): gwr and dG of the chunk the loop is at, and du (the adjoint of
// u = beta (v - G)) in a ring of a batch of chunks ([chunks, streams, C, D] at backward_du_ring_at): from the dy
// part, the apply-inverse kernel adding its bank-dependent part, until the dots kernel turns it into dv = beta du.
struct BackRows {
  float* gwr;
  float* dG;
  float* du;
  float* dbeta_parts;  // the dots' shares of dbeta ([units, dots_tiles, C] at backward_dbeta_parts_at)
};

// The rows a gather reads: slot s's row of one bank (has(s): s is in range; an out-of-range id touches no row).
template <typename T>
struct BankRows {
  const T* rows;
  int64_t K, D;
  __device__ __forceinline__ bool has(int32_t s) const { return s >= 0 && s < K; }
  __device__ __forceinline__ const T* operator()(int32_t s) const { return rows + s * D; }
};

// Packed sequences (kernels/chunk_steps.h StepSegments, docs/DESIGN.md "Packed sequences") as the kernels see them. The
// kernels follow forward_cpu / backward_cpu: a token reads a row from the working bank if it continues the
// segment running at its chunk's start (local 0) and the row's stamp is that segment, else the initial bank's.
template <typename T>
struct SegView {
  const int32_t* local;     // [units, C]
  const int32_t* seg0;      // [units]
  const T* initial;         // the initial bank, in the bank's layout
  int32_t* stamp;           // [streams, K]
  int32_t* stamp_snapshot;  // [units, C * W], null in a forward without residuals
  void* dinitial;           // backward: the initial bank's gradient, in the gradient bank's dtype and layout
};

// Without packed sequences: no view (fwd_gather_kernel's Seg).
struct NoSegments {};

// Whether token t of unit u reads slot `slot` of stream s from the working bank.
template <typename T>
__device__ __forceinline__ bool seg_current(const SegView<T>& sv, const StepDims& dm, int64_t s, int64_t u,
                                            int64_t t, int32_t slot) {
  return sv.local[u * dm.C + t] == 0 && sv.stamp[s * dm.K + slot] == sv.seg0[u];
}

// The unit's last segment (its largest local), by every lane of a whole warp.
__device__ __forceinline__ int32_t warp_unit_last(const int32_t* local_u, int64_t C) {
  int32_t m = local_u[0];
  for (int64_t t = threadIdx.x % 32; t < C; t += 32) m = max(m, local_u[t]);
  for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
  return m;
}

// The row a token of a packed chunk reads: the working bank's if current, else the initial bank's.
template <typename T>
struct SegmentRows {
  const T* bank;
  const T* initial;
  const int32_t* stamp;  // the stream's stamps
  int32_t seg0;
  bool continues;        // the token's local is 0
  int64_t K, D;
  __device__ __forceinline__ bool has(int32_t s) const { return s >= 0 && s < K; }
  __device__ __forceinline__ const T* operator()(int32_t s) const {
    return (continues && stamp[s] == seg0 ? bank : initial) + s * D;
  }
};

// The fresh output bank as the forward's gathers see it: the input bank and the gather lanes' row tags.
template <typename T>
struct FreshView {
  const T* input;        // [streams, K, D]
  const int32_t* w_tag;  // [units, C, W]
  const int32_t* r_tag;  // [units, C, R]
};

// A gather's rows by row tag (lane_tags_kernel): the result's or the input's row of the slot. A null input is all
// zeros (the backward's zero cotangent): its rows add nothing and are skipped.
template <typename T>
struct FreshRows {
  const T* result;
  const T* input;
  int64_t D;
  __device__ __forceinline__ bool has(int32_t tag) const { return tag >= 0 || (tag != -1 && input != nullptr); }
  __device__ __forceinline__ const T* operator()(int32_t tag) const {
    return tag >= 0 ? result + tag * D : input + (-2 - tag) * D;
  }
};


// out_row = sum over lanes of weight * rows[idx] for one token; one block per (stream, token). Threads are
// (column, part): blockDim.x threads cover the columns VEC at a time, and the lanes are split into blockDim.y
// contiguous parts whose partial sums are added in part order (a fixed order): more rows in flight per token.
// `partial` is dynamic shared memory of blockDim.y * blockDim.x * VEC floats, then room for `lanes` ids and weights
// (row_block). Used for the gathers G, Q0 (bank rows) and the GWR gather (gradient rows). `row_of(id)` is the row
// of a lane's id and `row_of.has(id)` whether it has one (BankRows; with packed sequences SegmentRows, the working
// or the initial bank's row; FreshRows for the row tags of a fresh output bank).
// The block stages the token's ids and weights in shared memory first: read from global memory in each batch,
// they put an L2 round trip before every batch's row loads (the kernel is bound by the latency of its chains of
// loads, not by bandwidth).
template <int VEC, typename T, typename RowOf>
__device__ __forceinline__ void gather_row(RowOf row_of, const int32_t* idx, const float* weight,
                                           int64_t lanes, int64_t D, float* __restrict__ out, float* partial) {
  constexpr int kInFlight = sizeof(T) == 2 ? 8 : 4;  // independent row loads issued before the first is used
  const int threads = blockDim.x * blockDim.y, tid = threadIdx.y * blockDim.x + threadIdx.x;
  int32_t* sid = reinterpret_cast<int32_t*>(partial + threads * VEC);
  float* sw = reinterpret_cast<float*>(sid + lanes);
  for (int64_t k = tid; k < lanes; k += threads) {
    sid[k] = idx[k];
    sw[k] = weight[k];
  }
  __syncthreads();
  const int64_t per_part = (lanes + blockDim.y - 1) / blockDim.y;
  const int64_t n_lo = threadIdx.y * per_part, n_hi = min(lanes, n_lo + per_part);
  const int64_t tile = static_cast<int64_t>(blockDim.x) * VEC;
  for (int64_t d0 = 0; d0 < D; d0 += tile) {  // the same trip count for every thread: barriers inside are safe
    const int64_t d = d0 + static_cast<int64_t>(threadIdx.x) * VEC;
    float acc[VEC] = {};
    if (d < D) {
#pragma unroll 1
      for (int64_t n0 = n_lo; n0 < n_hi; n0 += kInFlight) {
        Cols<VEC, T> x[kInFlight];
        bool ok[kInFlight];
#pragma unroll
        for (int j = 0; j < kInFlight; ++j) {
          const int32_t id = n0 + j < n_hi ? sid[n0 + j] : -1;
          ok[j] = row_of.has(id);
          if (ok[j]) x[j].load(row_of(id) + d);
        }
#pragma unroll
        for (int j = 0; j < kInFlight; ++j) {  // lanes in order within the part
          if (!ok[j]) continue;
          const float wgt = sw[n0 + j];
#pragma unroll
          for (int i = 0; i < VEC; ++i) acc[i] += wgt * x[j][i];
        }
      }
    }
    float* mine = partial + tid * VEC;
#pragma unroll
    for (int i = 0; i < VEC; ++i) mine[i] = acc[i];
    __syncthreads();
    if (threadIdx.y == 0 && d < D) {
      for (unsigned part = 1; part < blockDim.y; ++part) {
        const float* other = partial + (part * blockDim.x + threadIdx.x) * VEC;
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[i] += other[i];
      }
      store_cols<VEC>(out + d, acc);
    }
    __syncthreads();
  }
}

}  // namespace
}  // namespace sdm

#endif  // JAX_SDM_KERNELS_CHUNK_STEPS_ROWS_CUH_
