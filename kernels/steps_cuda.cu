// CUDA chunk steps (docs/MATH.md "Chunked form", "Backward of a chunk"): the math of steps_cpu.cc laid out for
// the GPU. The host loops over the chunks and enqueues, per chunk, a few maximally parallel kernels on the
// caller's stream (one program per token, slot group or column slice):
//
//   forward   gather (stream, token): G and Q0 rows, 16-byte loads     -> workspace / G residual
//             solve  (stream, 32-column slice): u, delta = Minv u, y = Q0 + QK delta
//             write  (stream, write group = one warp): snapshot, then cpe * S0 + sum_e w[e] delta[t_e], once
//   backward  before the loop, all chunks at once (they do not depend on the bank):
//             dy part (unit, slice): du = Minv^T QK^T dy, kept in dv's buffer
//             per chunk, in reverse:
//             gwr    (stream, token): sum_n w dS1[s] (gradient rows)
//             solve  (stream, slice): du += Minv^T gwr, dG = -beta du
//             phase A (stream, write group = one warp): dcpe, dw, dk_eff dots, the gradient row, the restore
//             read side (stream, read group = one warp): dS0 += q_w dy, dq_w on the restored rows
//             after the loop, all chunks at once:
//             dots   (unit, tile of 32 token rows): dA, dQK and dbeta from dots staged through shared memory,
//                    dv = beta du
//
// The gradient bank is float32 or, for bfloat16 banks, bfloat16 (GT): its rows are read into float32 and
// rounded once where a kernel writes them.
//
// One writer per bank row, gradient row and output cell; every sum in a fixed order (lanes in sorted or lane
// order, warp shuffles in a fixed xor tree): bitwise reproducible, no floating-point atomics (one integer minimum,
// whose result does not depend on the order, marks each slot's first writing chunk: see "Fresh output bank"). Rows are read and written VEC
// columns per thread (16 bytes of bfloat16 when D allows), chosen from the shapes. The kernels that walk bank and
// gradient rows are bound by memory latency: each thread loads several rows (or row segments) before using the
// first, and their register budgets (__launch_bounds__) are set for the blocks per SM that keep enough loads in
// flight.
#include <cuda_bf16.h>
#include <cuda_pipeline.h>
#include <cuda_runtime.h>

#include <cstdint>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "kernels/bf16_cuda.cuh"
#include "kernels/steps.h"

namespace sdm {
namespace {

constexpr int kSlice = 32;          // columns per block of the solve kernels
constexpr int kSolveThreadsMax = 1024;  // threads per block of the solve kernels: one per tile
constexpr int kRowThreadsMax = 256;  // column threads (x) per block of the per-token row kernels
constexpr int kRowThreadsCap = 512;  // threads (x times parts) per block of the per-token row kernels
constexpr int kRowBlocksPerSM = 2;   // their register budget: 2 blocks of 512 threads per SM (64 registers)
constexpr int kGroupWarps = 8;      // warps (= groups) per block of the group kernels
constexpr int kGroupBlocksPerSM = 2;  // register budget of the group kernels: 2 blocks per SM (128 registers)
constexpr int kInlineEntries = 2;   // Phase A handles groups of up to this many entries in one pass over the row
constexpr int kOwnerWarps = 8;      // warps per block of the unpacked group kernels (one block per stream and token)
constexpr int kOwnerBlocksPerSM = 2;  // their register budget: 2 blocks of 256 threads per SM (128 registers)
constexpr int64_t kOwnerStageFloats = 8192;  // a block stages its token's vectors in shared memory up to this size

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ void from_f(float* p, float x) { *p = x; }
__device__ __forceinline__ void from_f(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }

// VEC consecutive columns starting at p (aligned to VEC elements), as floats: 16-byte loads where possible. kRO:
// through the read-only path (ld.global.nc), for rows no kernel writes while it runs (load_cols_ro).
template <int VEC, typename T, bool kRO = false>
__device__ __forceinline__ void load_cols(const T* p, float* out) {
  constexpr int kBytes = VEC * static_cast<int>(sizeof(T));
  if constexpr (kBytes % 16 == 0) {
    constexpr int kPer = 16 / sizeof(T);
#pragma unroll
    for (int k = 0; k < kBytes / 16; ++k) {
      const uint4* at = reinterpret_cast<const uint4*>(p) + k;
      const uint4 raw = kRO ? __ldg(at) : *at;
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int i = 0; i < kPer; ++i) out[k * kPer + i] = to_f(e[i]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) out[i] = to_f(kRO ? __ldg(p + i) : p[i]);
  }
}

// load_cols of rows that no kernel writes while it runs (delta, dG: float32; dy: the bank's dtype): the read-only
// path also lets the compiler issue these loads ahead of the row stores before them.
template <int VEC, typename T>
__device__ __forceinline__ void load_cols_ro(const T* p, float* out) {
  load_cols<VEC, T, true>(p, out);
}

template <int VEC, typename T>
__device__ __forceinline__ void store_cols(T* p, const float* x) {
  constexpr int kBytes = VEC * static_cast<int>(sizeof(T));
  if constexpr (kBytes % 16 == 0) {
    constexpr int kPer = 16 / sizeof(T);
#pragma unroll
    for (int k = 0; k < kBytes / 16; ++k) {
      uint4 raw;
      T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
      for (int i = 0; i < kPer; ++i) from_f(e + i, x[k * kPer + i]);
      reinterpret_cast<uint4*>(p)[k] = raw;
    }
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) from_f(p + i, x[i]);
  }
}

template <int VEC, typename T>
__device__ __forceinline__ void copy_cols(const T* src, T* dst) {
  if constexpr (VEC * sizeof(T) % 16 == 0) {
#pragma unroll
    for (int k = 0; k < static_cast<int>(VEC * sizeof(T) / 16); ++k)
      reinterpret_cast<uint4*>(dst)[k] = reinterpret_cast<const uint4*>(src)[k];
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) dst[i] = src[i];
  }
}

// VEC consecutive columns of a row held in the row's own dtype (VEC * sizeof(T) bytes of registers, half those of
// floats for bfloat16): the row kernels load several of these before using the first (more loads in flight per
// thread, the kernels are latency-bound) and widen each column to float where it is used.
template <int VEC, typename T>
struct Cols {
  static constexpr int kBytes = VEC * static_cast<int>(sizeof(T));
  static constexpr bool kWide = kBytes % 16 == 0;
  alignas(kWide ? 16 : alignof(T)) T v[VEC];
  __device__ __forceinline__ void load(const T* p) {
    if constexpr (kWide) {
#pragma unroll
      for (int k = 0; k < kBytes / 16; ++k) reinterpret_cast<uint4*>(v)[k] = reinterpret_cast<const uint4*>(p)[k];
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i) v[i] = p[i];
    }
  }
  __device__ __forceinline__ void store(T* p) const {
    if constexpr (kWide) {
#pragma unroll
      for (int k = 0; k < kBytes / 16; ++k) reinterpret_cast<uint4*>(p)[k] = reinterpret_cast<const uint4*>(v)[k];
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i) p[i] = v[i];
    }
  }
  __device__ __forceinline__ float operator[](int i) const { return to_f(v[i]); }
};

// Segments (VEC columns each, 32 * VEC apart) a lane of a group kernel loads before using the first: as many as
// fit the kernel's budget of loaded bytes per lane (its registers: `__launch_bounds__`), given the bytes loaded
// per segment; 1 to 4.
constexpr int kWriteLaneBytes = 64;    // the forward write kernel
constexpr int kTwoRowLaneBytes = 128;  // Phase A and the read side
__host__ __device__ constexpr int segs_for(int budget, int seg_bytes) {
  return budget / seg_bytes < 1 ? 1 : budget / seg_bytes > 4 ? 4 : budget / seg_bytes;
}

// S segments of VEC columns (32 * VEC apart) of a row from column d0 on, as far as D.
template <int VEC, int S, typename T>
__device__ __forceinline__ void load_batch(const T* row, int64_t d0, int64_t D, Cols<VEC, T> (&x)[S]) {
#pragma unroll
  for (int k = 0; k < S; ++k) {
    if (d0 + k * 32 * VEC >= D) break;
    x[k].load(row + d0 + k * 32 * VEC);
  }
}

// A lane of a one-warp-per-row kernel walks two rows `a` and `b` (D columns each, dtypes A and B) in batches of S
// segments of VEC columns (32 * VEC apart), all of a batch loaded before the first is used, and calls
// body(d, a_cols, b_cols, pre_cols) per segment in increasing column order d (the order of the lane's partial sums),
// with the same columns of NPRE rows `pre` (the token's vectors, float32 in shared memory when staged) read then:
// they hold no registers while the rows are in flight.
template <int VEC, int NPRE, typename A, typename B, typename P, typename Body>
__device__ __forceinline__ void walk_two_rows(const A* a, const B* b, const P* const (&pre)[NPRE], int64_t D,
                                              int lane, Body body) {
  constexpr int S = segs_for(kTwoRowLaneBytes, VEC * static_cast<int>(sizeof(A) + sizeof(B)));
  constexpr int64_t kStep = 32 * VEC;
  for (int64_t d0 = static_cast<int64_t>(lane) * VEC; d0 < D; d0 += S * kStep) {
    Cols<VEC, A> x[S];
    Cols<VEC, B> y[S];
    load_batch(a, d0, D, x);
    load_batch(b, d0, D, y);
#pragma unroll
    for (int k = 0; k < S; ++k) {
      const int64_t d = d0 + k * kStep;
      if (d >= D) break;
      float p[NPRE][VEC];
#pragma unroll
      for (int i = 0; i < NPRE; ++i) load_cols<VEC>(pre[i] + d, p[i]);
      body(d, x[k], y[k], p);
    }
  }
}

__device__ __forceinline__ int64_t unit_of(const StepDims& dm, int64_t s, int64_t c) {
  return ((s / dm.P) * dm.NC + c) * dm.P + s % dm.P;
}

// Programmatic dependent launch (sm_90 and later): the host launches each kernel of a call so that its blocks may
// start while the previous kernel on the stream drains (hiding the launch gap between the ~200-470 launches of a
// call). Every kernel calls chain_start() in every block, before any early return: it waits until the previous
// kernel has completed and its writes are visible, then lets the next kernel launch. So a kernel's completion
// implies its predecessors', and each kernel sees everything earlier kernels wrote. It is the first thing a kernel
// does, except where a kernel loads, before it, data that was final before its predecessor started: when kernel
// N starts, N - 1 has passed its chain_start, so N - 2 and everything before it have completed (fwd_write_kernel, the
// staged in-loop solves).
// A no-op before sm_90.
__device__ __forceinline__ void chain_start() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Sum over the warp in a fixed xor tree: every lane gets the same, reproducible value.
__device__ __forceinline__ float warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// <a, b> over D columns by one warp, VEC columns per lane and step.
template <int VEC, typename A, typename B>
__device__ __forceinline__ float warp_dot(const A* a, const B* b, int64_t D, int lane) {
  float s = 0.f;
  for (int64_t d = static_cast<int64_t>(lane) * VEC; d < D; d += 32 * VEC) {
    float x[VEC], y[VEC];
    load_cols<VEC>(a + d, x);
    load_cols<VEC>(b + d, y);
#pragma unroll
    for (int i = 0; i < VEC; ++i) s += x[i] * y[i];
  }
  return warp_sum(s);
}

// Per-chunk scratch rows ([streams, C, D] float32 each) and where the residuals go.
struct ChunkRows {
  float* G;      // forward: the gathers (when saving, the vg residual's buffer: the solve replaces them by v - G)
  float* Q0;     // forward: the read gathers
  float* delta;  // forward: the write vectors (the delta residual when saving)
  bool per_unit; // residual layout (per unit) or scratch layout (per stream)
  __device__ __forceinline__ int64_t at(const StepDims& dm, int64_t u, int64_t s) const {
    return (per_unit ? u : s) * dm.C * dm.D;
  }
};

// The rows a gather reads: slot s's row of one bank (has(s): s is in range; an out-of-range id touches no row).
template <typename T>
struct BankRows {
  const T* rows;
  int64_t K, D;
  __device__ __forceinline__ bool has(int32_t s) const { return s >= 0 && s < K; }
  __device__ __forceinline__ const T* operator()(int32_t s) const { return rows + s * D; }
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

// Packed sequences (kernels/steps.h StepSegments, docs/DESIGN.md "Packed sequences") as the kernels see them. The
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

// Fresh result (forward_cuda's bank, backward_cuda's gradient bank, when XLA hands the input and the result as two
// buffers; not with packed sequences): instead of copying the whole input into the result first, a row is read
// from the input until the first step that writes it, whose kernel stores it into the result; the rows no step
// writes are copied once (copy_untouched_kernel). The steps, in the order the loop runs them: forward, chunk c's
// write is step c; backward (chunks in reverse, r = NC - 1 - c), chunk c's Phase A is step 2r and its read side
// step 2r + 1. Before the loop, first_touch_kernel finds each slot's first writing step. A kernel that reads rows
// as they are before step t (the forward's gathers and write of chunk c: t = c; the backward's GWR and Phase A:
// 2r; the read side: 2r + 1) reads a slot's row from the input iff that first step is t or later:
// lane_tags_kernel tags every gather lane with it (FreshRows) and group_table_kernel every group (kFromInput), so
// the row kernels pick the buffer without a dependent load.
constexpr uint32_t kUntouched = 0xffffffffu;  // the first step of a slot no step writes
constexpr int32_t kFromInput = 1 << 30;       // a group's table `hi` flag: its row is read from the input

__device__ __forceinline__ int64_t chunk_of_unit(const StepDims& dm, int64_t u) { return (u / dm.P) % dm.NC; }
__device__ __forceinline__ int64_t stream_of_unit(const StepDims& dm, int64_t u) {
  return (u / (dm.NC * dm.P)) * dm.P + u % dm.P;
}

// The step (above) of unit u's lanes or groups of one map: mul * c + add, with c counted from the last chunk when
// `reverse`.
struct StepOf {
  int mul, add;
  bool reverse;
  __device__ __forceinline__ uint32_t operator()(const StepDims& dm, int64_t u) const {
    const int64_t c = chunk_of_unit(dm, u);
    return static_cast<uint32_t>(mul * (reverse ? dm.NC - 1 - c : c) + add);
  }
};
constexpr StepOf kForwardStep{1, 0, false}, kPhaseAStep{2, 0, true}, kReadSideStep{2, 1, true};

// The call-wide passes over a map's entries (first writes, lane tags, group tables) run units along y and a unit's n
// entries along x, both grid-strided (unit_grid), so that the unit's stream, chunk and step are worked out once per
// unit rather than by 64-bit divisions per entry. (Measured on the H200: their times did not change, 14-27 us each
// at the flagship; their random 4-byte reads and integer atomics are what bounds them.)
__device__ __forceinline__ int64_t entry_start() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t entry_stride() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

// first[s * K + slot] = min(first, the step of each lane of stream s on the slot) over a map's lanes (`lanes` per
// token, ids `idx`); first is filled with kUntouched before the first map. An integer minimum: the same result in
// any order of the atomics.
__global__ void first_touch_kernel(StepDims dm, const int32_t* __restrict__ idx, int64_t lanes, StepOf step,
                                   uint32_t* __restrict__ first) {
  chain_start();
  const int64_t n = dm.C * lanes, units = dm.V * dm.NC * dm.P;
  for (int64_t u = blockIdx.y; u < units; u += gridDim.y) {
    const int32_t* ids = idx + u * n;
    uint32_t* f = first + stream_of_unit(dm, u) * dm.K;
    const uint32_t at = step(dm, u);
    for (int64_t e = entry_start(); e < n; e += entry_stride()) {
      const int32_t slot = ids[e];
      if (slot >= 0 && slot < dm.K) atomicMin(f + slot, at);
    }
  }
}

// A gather lane's row tag, for a gather that reads rows as they are before `step` of its unit: the slot when an
// earlier step wrote it (the row is in the result), -2 - slot when none did (the input's row), -1 for an
// out-of-range id (no row).
__global__ void lane_tags_kernel(StepDims dm, const int32_t* __restrict__ idx, int64_t lanes, StepOf step,
                                 const uint32_t* __restrict__ first, int32_t* __restrict__ tags) {
  chain_start();
  const int64_t n = dm.C * lanes, units = dm.V * dm.NC * dm.P;
  for (int64_t u = blockIdx.y; u < units; u += gridDim.y) {
    const uint32_t* f = first + stream_of_unit(dm, u) * dm.K;
    const uint32_t at = step(dm, u);
    for (int64_t e = entry_start(); e < n; e += entry_stride()) {
      const int32_t slot = idx[u * n + e];
      tags[u * n + e] = slot < 0 || slot >= dm.K ? -1 : f[slot] >= at ? -2 - slot : slot;
    }
  }
}

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

// The rows no step writes, from the input into the result, or zeros for a null input. Each warp reads 32 rows'
// first steps in one load and copies the untouched rows among them (VEC columns per lane; D a multiple of VEC): at
// model sizes nearly every row is written, and a thread per column with a lookup each cost 66 us at the flagship.
template <int VEC, typename T>
__global__ void copy_untouched_kernel(StepDims dm, const uint32_t* __restrict__ first, const T* __restrict__ input,
                                      T* __restrict__ result) {
  chain_start();
  const int lane = threadIdx.x % 32;
  const int64_t rows = dm.V * dm.P * dm.K;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;  // 32 rows per warp and round
  for (int64_t r0 = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) - lane; r0 < rows; r0 += step) {
    const bool untouched = r0 + lane < rows && first[r0 + lane] == kUntouched;
    for (unsigned m = __ballot_sync(0xffffffffu, untouched); m != 0; m &= m - 1) {
      const int64_t at = (r0 + __ffs(m) - 1) * dm.D;
      for (int64_t col = lane * VEC; col < dm.D; col += 32 * VEC) {
        if (input == nullptr) {
          const float zeros[VEC] = {};
          store_cols<VEC>(result + at + col, zeros);
        } else {
          Cols<VEC, T> x;
          x.load(input + at + col);
          x.store(result + at + col);
        }
      }
    }
  }
}

// One block per (stream, token, side): side 0 gathers the write lanes' G row, side 1 the read lanes' Q0 row (two
// blocks rather than one doing both in turn: twice the rows in flight per chunk). Seg is NoSegments; SegView<T>
// with packed sequences (each lane's row from the working or the initial bank); or FreshView<T> for a fresh
// output bank (each lane's row from the result or the input bank, by its tag).
template <int VEC, typename T, typename Seg>
__global__ void __launch_bounds__(kRowThreadsCap, kRowBlocksPerSM) fwd_gather_kernel(StepDims dm, StepPhase1 p1, const T* __restrict__ bank, int64_t c, ChunkRows rows, Seg sg) {
  chain_start();
  extern __shared__ float partial[];
  const int64_t s = blockIdx.x, t = blockIdx.y;
  const int64_t u = unit_of(dm, s, c);
  const T* S = bank + s * dm.K * dm.D;
  const auto side = [&](auto row_of, const int32_t* w_ids, const int32_t* r_ids) {
    if (blockIdx.z == 0) {
      gather_row<VEC, T>(row_of, w_ids + (u * dm.C + t) * dm.W, p1.k_eff + (u * dm.C + t) * dm.W, dm.W, dm.D,
                         rows.G + rows.at(dm, u, s) + t * dm.D, partial);
    } else {
      gather_row<VEC, T>(row_of, r_ids + (u * dm.C + t) * dm.R, p1.q_w + (u * dm.C + t) * dm.R, dm.R, dm.D,
                         rows.Q0 + s * dm.C * dm.D + t * dm.D, partial);
    }
  };
  if constexpr (std::is_same_v<Seg, SegView<T>>) {
    side(SegmentRows<T>{S, sg.initial + s * dm.K * dm.D, sg.stamp + s * dm.K, sg.seg0[u],
                        sg.local[u * dm.C + t] == 0, dm.K, dm.D}, p1.k_idx, p1.q_idx);
  } else if constexpr (std::is_same_v<Seg, FreshView<T>>) {
    side(FreshRows<T>{S, sg.input + s * dm.K * dm.D, dm.D}, sg.w_tag, sg.r_tag);
  } else {
    side(BankRows<T>{S, dm.K, dm.D}, p1.k_idx, p1.q_idx);
  }
}

constexpr int kQuads = kSlice / 4;  // 4-column quads per row of a slice

// Rows of the solve kernels' shared-memory slices: C rounded up to whole 4-row tiles.
__host__ __device__ inline int tile_rows(int64_t C) { return static_cast<int>((C + 3) / 4 * 4); }

// A solve kernel reads the unit's C x C matrices from shared memory when they fit next to its slices ("staged"),
// else from global memory through L1. Staged, a block issues every load it needs at its start as asynchronous
// copies and waits once: the kernels were bound by serial rounds of global loads (the slice, then each matrix, then
// the epilogue's rows), with one block of a few warps per SM to hide them. The in-loop solves are staged up to
// C = kStagedLoopMaxC where the device allows a block the shared memory (the forward's: 67 KB at C = 64, 199 KB at
// C = 128, within the 227 KB of sm_90); the dy part (all chunks in one launch, throughput-bound with several
// blocks per SM) up to kStagedDyMaxC. Host-side (solve_staged in the launchers).
constexpr int kStagedLoopMaxC = 128, kStagedDyMaxC = 64;

// Row stride of a staged matrix: 16-byte rows, and 4 floats of padding that spread a tile's rows over the banks.
__host__ __device__ inline int matrix_stride(int64_t C) { return tile_rows(C) + 4; }

// Loads of the products: plain loads (shared memory, staged) or the read-only path (global memory).
template <bool kShared>
__device__ __forceinline__ float load_m(const float* p) {
  if constexpr (kShared) return *p;
  else return __ldg(p);
}
template <bool kShared>
__device__ __forceinline__ float4 load_m4(const float* p) {
  if constexpr (kShared) return *reinterpret_cast<const float4*>(p);
  else return __ldg(reinterpret_cast<const float4*>(p));
}

// Asynchronous copy of 4 floats (16 bytes when `whole` and aligned, else float by float for those below `n`) from
// global `src` into shared `dst`, zeros for the floats at or past n.
__device__ __forceinline__ void copy_quad_async(float* dst, const float* src, int n, bool whole) {
  if (whole && n >= 4) {
    __pipeline_memcpy_async(dst, src, 16);
    return;
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if (k < n) __pipeline_memcpy_async(dst + k, src + k, 4);
    else dst[k] = 0.f;
  }
}

// Stage the unit's C x C matrix M into Ms [tile_rows(C), matrix_stride(C)] (zeros past C), asynchronously.
__device__ __forceinline__ void stage_matrix_async(const float* M, int C, float* Ms) {
  const int ms = matrix_stride(C), quads = ms / 4;
  for (int idx = threadIdx.x; idx < tile_rows(C) * quads; idx += blockDim.x) {
    const int r = idx / quads, c0 = 4 * (idx % quads);
    copy_quad_async(Ms + r * ms + c0, M + r * C + c0, r < C ? C - c0 : 0, C % 4 == 0);
  }
}

// Stage columns [d0, d0 + kSlice) of C rows of D floats into out [tile_rows(C), kSlice] (zeros past C and D),
// asynchronously.
__device__ __forceinline__ void stage_slice_async(const float* rows, int C, int64_t D, int64_t d0, float* out) {
  for (int idx = threadIdx.x; idx < tile_rows(C) * kQuads; idx += blockDim.x) {
    const int t = idx / kQuads;
    const int64_t d = d0 + 4 * (idx % kQuads);
    const int n = t < C && d < D ? static_cast<int>(D - d < 4 ? D - d : 4) : 0;
    copy_quad_async(out + 4 * idx, rows + t * D + d, n, D % 4 == 0);
  }
}

// Wait for this thread's asynchronous copies, then for the block's.
__device__ __forceinline__ void staged_wait() {
  __pipeline_commit();
  __pipeline_wait_prior(0);
  __syncthreads();
}

// Columns [d, d + 4) of a float32 row (zeros past D): one 16-byte access when D % 4 == 0 (rows are then 16-byte
// aligned and d, a multiple of 4, lies below D or the whole quad does).
__device__ __forceinline__ float4 load_quad(const float* row, int64_t d, int64_t D) {
  if (D % 4 == 0) return d < D ? *reinterpret_cast<const float4*>(row + d) : make_float4(0.f, 0.f, 0.f, 0.f);
  float v[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) v[k] = d + k < D ? row[d + k] : 0.f;
  return make_float4(v[0], v[1], v[2], v[3]);
}

// The same of a bfloat16 row, widened (one 8-byte access when D % 4 == 0).
__device__ __forceinline__ float4 load_quad(const __nv_bfloat16* row, int64_t d, int64_t D) {
  if (D % 4 == 0) {
    if (d >= D) return make_float4(0.f, 0.f, 0.f, 0.f);
    const uint2 raw = *reinterpret_cast<const uint2*>(row + d);
    const __nv_bfloat16* e = reinterpret_cast<const __nv_bfloat16*>(&raw);
    return make_float4(to_f(e[0]), to_f(e[1]), to_f(e[2]), to_f(e[3]));
  }
  float v[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) v[k] = d + k < D ? to_f(row[d + k]) : 0.f;
  return make_float4(v[0], v[1], v[2], v[3]);
}

__device__ __forceinline__ void store_quad(float* row, int64_t d, int64_t D, float4 x) {
  if (D % 4 == 0) {
    if (d < D) *reinterpret_cast<float4*>(row + d) = x;
    return;
  }
  const float v[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
  for (int k = 0; k < 4; ++k)
    if (d + k < D) row[d + k] = v[k];
}

__device__ __forceinline__ void fma_quad(float4& acc, float m, const float4& c) {
  acc.x += m * c.x;
  acc.y += m * c.y;
  acc.z += m * c.z;
  acc.w += m * c.w;
}

// The solve kernels' operands that are not staged in shared memory (the unit's C x C matrices, float32 rows of the
// slice read after the first product) are asked into L1 when a block starts: their first touch would otherwise be
// a serial chain of cache misses inside the products, and with one block of a few warps per SM nothing hides it.
__device__ __forceinline__ void prefetch_l1(const float* p) { asm volatile("prefetch.global.L1 [%0];" ::"l"(p)); }

__device__ __forceinline__ void prefetch_matrix(const float* M, int C) {
  for (int i = threadIdx.x * 32; i < C * C; i += blockDim.x * 32) prefetch_l1(M + i);  // 128-byte lines
}

// Columns [d0, d0 + kSlice) of C rows of D floats (a line at each end of a row's columns).
__device__ __forceinline__ void prefetch_slice(const float* rows, int C, int64_t D, int64_t d0) {
  const int64_t last = min(d0 + kSlice, D) - 1;
  for (int t = threadIdx.x; t < C; t += blockDim.x) {
    prefetch_l1(rows + t * D + d0);
    prefetch_l1(rows + t * D + last);
  }
}

// Stage a [tile_rows(C), kSlice] slice in shared memory: row t < C, quad q is quad(t, q), rows past C are zero.
template <typename Quad>
__device__ __forceinline__ void stage_quads(int C, float* out, Quad quad) {
  const int n = tile_rows(C) * kQuads;
#pragma unroll 4
  for (int idx = threadIdx.x; idx < n; idx += blockDim.x) {
    const int t = idx / kQuads;
    reinterpret_cast<float4*>(out)[idx] = t < C ? quad(t, idx % kQuads) : make_float4(0.f, 0.f, 0.f, 0.f);
  }
}

// Rows per tile of the solve kernels' products. The in-loop solves (forward, backward), staged: a tile is one row
// and 4 columns, a thread per tile (512 at C = 64): one block per SM, and with 4 x 4 tiles its 4 warps (one per
// scheduler) issued about every 4 cycles. Otherwise 4 x 4 tiles: one 16-byte load of M feeds 16 multiply-adds,
// which suits the dy part (one launch with many blocks per SM, throughput-bound) and the global-memory path.
template <bool kStaged, bool kInLoop>
constexpr int kTileRows = kStaged && kInLoop ? 1 : 4;

// Threads per block of a solve kernel (in the loop or the dy part; staged or not): one per tile of a slice, whole
// warps, at most kSolveThreadsMax (more tiles take turns).
inline int solve_threads(int64_t C, bool in_loop, bool staged) {
  const int rows = staged ? (in_loop ? kTileRows<true, true> : kTileRows<true, false>)
                          : (in_loop ? kTileRows<false, true> : kTileRows<false, false>);
  return std::min(kSolveThreadsMax, (tile_rows(C) / rows * kQuads + 31) / 32 * 32);
}

// body(r0, q) for every tile (rows r0 .. r0 + kRows - 1, quad q) of a slice, one tile per thread and turn.
template <int kRows, typename Body>
__device__ __forceinline__ void for_tiles(int C, Body body) {
  const int n = tile_rows(C) / kRows * kQuads;
  for (int idx = threadIdx.x; idx < n; idx += blockDim.x) body(kRows * (idx / kQuads), idx % kQuads);
}

// The triangular products of the solve kernels on a [tile_rows(C), kSlice] shared-memory slice `cols`, for the
// tile of rows r = r0 + j (j < kRows, 1 or 4) and columns [4q, 4q + 4), with M's rows `ms` floats
// apart (in shared memory when kStaged, zeros past C; else in global memory, ms = C):
//   lower:      x[j] = sum_{k = 0..r} M[r, k] cols[k]       (k ascending)
//   transposed: x[j] = sum_{k = r..C-1} M[k, r] cols[k]     (k ascending)
// Each column's sum runs in the order of a one-column loop, whatever the tile's shape. The main loop issues 4 steps
// of loads before using the first. Rows past C (the last tile when C % 4 != 0) read M's row C - 1; their sums are
// not used.
template <bool kTransposed, bool kStaged, int kRows>
__device__ __forceinline__ void tri_tile(const float* __restrict__ M, int ms, const float* cols, int r0, int q, int C,
                                         float4 (&x)[kRows]) {
  const bool vec = kStaged || C % 4 == 0;  // rows of M 16-byte aligned, and (global) no tile row past C
  int r[kRows];
#pragma unroll
  for (int j = 0; j < kRows; ++j) {
    r[j] = min(r0 + j, C - 1);
    x[j] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  const float4* c4 = reinterpret_cast<const float4*>(cols) + q;
  auto m = [&](int j, int k) { return load_m<kStaged>(kTransposed ? M + k * ms + r[j] : M + r[j] * ms + k); };
  // Steps k that only some rows of the tile take: transposed k < r0 + kRows - 1 (before), lower k > r0 (after).
  if constexpr (kTransposed) {
    for (int k = r0; k < min(r0 + kRows - 1, C); ++k) {
      const float4 c = c4[k * kQuads];
#pragma unroll
      for (int j = 0; j < kRows; ++j)
        if (k >= r0 + j) fma_quad(x[j], m(j, k), c);
    }
  }
  int k = kTransposed ? r0 + kRows - 1 : 0;
  const int hi = kTransposed ? C : r0 + 1;
  for (; k + 4 <= hi; k += 4) {
    float4 c[4];
    float mk[4][kRows];  // [step][row]
#pragma unroll
    for (int s = 0; s < 4; ++s) c[s] = c4[(k + s) * kQuads];
    if (vec && kTransposed && kRows == 4) {
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        const float4 t = load_m4<kStaged>(M + (k + s) * ms + r0);
        const float tv[4] = {t.x, t.y, t.z, t.w};
#pragma unroll
        for (int j = 0; j < kRows; ++j) mk[s][j] = tv[j];
      }
    } else if (vec && !kTransposed) {
#pragma unroll
      for (int j = 0; j < kRows; ++j) {
        const float4 t = load_m4<kStaged>(M + r[j] * ms + k);
        mk[0][j] = t.x, mk[1][j] = t.y, mk[2][j] = t.z, mk[3][j] = t.w;
      }
    } else {
#pragma unroll
      for (int s = 0; s < 4; ++s)
#pragma unroll
        for (int j = 0; j < kRows; ++j) mk[s][j] = m(j, k + s);
    }
#pragma unroll
    for (int s = 0; s < 4; ++s)
#pragma unroll
      for (int j = 0; j < kRows; ++j) fma_quad(x[j], mk[s][j], c[s]);
  }
  for (; k < hi; ++k) {
    const float4 c = c4[k * kQuads];
#pragma unroll
    for (int j = 0; j < kRows; ++j) fma_quad(x[j], m(j, k), c);
  }
  if constexpr (!kTransposed) {
    for (int k = r0 + 1; k < min(r0 + kRows, C); ++k) {
      const float4 c = c4[k * kQuads];
#pragma unroll
      for (int j = 0; j < kRows; ++j)
        if (k <= r0 + j) fma_quad(x[j], m(j, k), c);
    }
  }
}

// One block per (stream, kSlice-column slice), one thread per tile (kTileRows rows, 4 columns) and turn. Shared
// memory: u and delta slices; staged, also the G and Q0 slices and Minv, QK.
template <bool kStaged>
__global__ void fwd_solve_kernel(StepDims dm, StepPhase1 p1, ForwardIO io, int64_t c, ChunkRows rows) {
  constexpr int kRows = kTileRows<kStaged, true>;
  extern __shared__ __align__(16) float sh[];
  const int C = static_cast<int>(dm.C), slice = tile_rows(C) * kSlice, ms = kStaged ? matrix_stride(C) : C;
  const int64_t D = dm.D;
  const int64_t s = blockIdx.x, d0 = static_cast<int64_t>(blockIdx.y) * kSlice;
  const int64_t u = unit_of(dm, s, c);
  float* su = sh;
  float* sdelta = su + slice;
  float* sG = sdelta + slice;
  float* sq0 = sG + slice;
  float* smi = sq0 + slice;
  float* sqk = smi + tile_rows(C) * ms;
  float* G = rows.G + rows.at(dm, u, s);  // the gathers; saving, v - G replaces them (the vg residual)
  const float* v = io.v + u * C * D;
  const float* beta = io.beta + u * C;
  const float* minv = p1.minv + u * C * C;
  const float* QK = p1.QK + u * C * C;
  const float* Q0 = rows.Q0 + s * C * D;
  if constexpr (kStaged) {
    // Minv, QK and v were final before the chunk loop began: their copies are issued before chain_start waits for
    // the gather (see chain_start), so they overlap its end; G and Q0 after.
    stage_matrix_async(minv, C, smi);
    stage_matrix_async(QK, C, sqk);
    stage_slice_async(v, C, D, d0, su);
    chain_start();
    stage_slice_async(G, C, D, d0, sG);
    stage_slice_async(Q0, C, D, d0, sq0);
    staged_wait();
    for (int idx = threadIdx.x; idx < slice / 4; idx += blockDim.x) {  // u = beta (v - G), in place of v
      const int t = idx / kQuads;
      const float b = t < C ? beta[t] : 0.f;
      float4& x = reinterpret_cast<float4*>(su)[idx];
      const float4 g = reinterpret_cast<const float4*>(sG)[idx];
      const float4 vg = make_float4(x.x - g.x, x.y - g.y, x.z - g.z, x.w - g.w);
      if (rows.per_unit && t < C) store_quad(G + t * D, d0 + 4 * (idx % kQuads), D, vg);
      x = make_float4(b * vg.x, b * vg.y, b * vg.z, b * vg.w);
    }
  } else {
    chain_start();
    prefetch_matrix(minv, C);
    prefetch_matrix(QK, C);
    prefetch_slice(Q0, C, D, d0);
    stage_quads(C, su, [&](int t, int q) {  // u = beta (v - G)
      const float b = beta[t];
      const float4 x = load_quad(v + t * D, d0 + 4 * q, D), g = load_quad(G + t * D, d0 + 4 * q, D);
      const float4 vg = make_float4(x.x - g.x, x.y - g.y, x.z - g.z, x.w - g.w);
      if (rows.per_unit) store_quad(G + t * D, d0 + 4 * q, D, vg);
      return make_float4(b * vg.x, b * vg.y, b * vg.z, b * vg.w);
    });
  }
  __syncthreads();
  float* delta = rows.delta + rows.at(dm, u, s);
  for_tiles<kRows>(C, [&](int r0, int q) {  // delta = Minv u
    float4 x[kRows];
    tri_tile<false, kStaged, kRows>(kStaged ? smi : minv, ms, su, r0, q, C, x);
#pragma unroll
    for (int j = 0; j < kRows; ++j) {
      if (r0 + j >= C) break;
      reinterpret_cast<float4*>(sdelta + (r0 + j) * kSlice)[q] = x[j];
      store_quad(delta + (r0 + j) * D, d0 + 4 * q, D, x[j]);
    }
  });
  __syncthreads();
  for_tiles<kRows>(C, [&](int r0, int q) {  // y = Q0 + QK delta
    float4 x[kRows];
    tri_tile<false, kStaged, kRows>(kStaged ? sqk : QK, ms, sdelta, r0, q, C, x);
    const int64_t d = d0 + 4 * q;
#pragma unroll
    for (int j = 0; j < kRows; ++j) {
      if (r0 + j >= C) break;
      const float4 q0 = kStaged ? reinterpret_cast<const float4*>(sq0 + (r0 + j) * kSlice)[q]
                                : load_quad(Q0 + (r0 + j) * D, d, D);
      store_quad(io.y + (u * C + r0 + j) * D, d, D,
                 make_float4(x[j].x + q0.x, x[j].y + q0.y, x[j].z + q0.z, x[j].w + q0.w));
    }
  });
}

// One slot group of a chunk (DESIGN.md "Phase 1": a run of sorted entries [lo, hi) with one slot): its slot
// (-1 when the warp has nothing to do: an empty group, padding, an out-of-range slot), its entries and the first
// of them in sorted order. A table of these for every unit and group is built before the chunks that read it
// (group_table_kernel; the backward's per batch of chunks: table_unit) so that a group kernel's warp finds its row
// with one 16-byte load instead of a chain of three dependent ones (group offsets, then the sorted order, then the
// slot id) before its first row load can issue.
struct alignas(16) GroupEntry {
  int32_t slot, lo, hi, first;
};

// A map's group table holds the groups of `chunks` chunks: the forward's all NC, built before its loop; the
// backward's a ring of table_chunks (kernels/steps.h), rebuilt per batch of that many chunks as its reverse loop
// reaches them (backward_loop). Chunk c is at ring place c % chunks, stream s's n = C * lanes entries at table unit
// table_unit(s, c) = table_unit(0, c) + s. A kernel of chunk c takes the tables from its place on (ChunkTables::at),
// so that its readers find stream s's entries at s * n, with no ring arithmetic of their own.
__host__ __device__ inline int64_t table_unit(const StepDims& dm, int64_t chunks, int64_t s, int64_t c) {
  return c % chunks * (dm.V * dm.P) + s;
}

// The table of a map of DESIGN.md (w_* with k_idx, or r_* with q_idx; `lanes` its W or R; holding `chunks` chunks)
// for chunks [c0, c1) of every stream s, n = C * lanes entries per unit u at out = table + table_unit(s, c) * n: by
// group, out[g] = {slot, lo, hi, first} for every group g < n (the packed kernels); or by first entry (the unpacked
// kernels), out[first] = {slot, lo, hi, g} at the first sorted entry of every group with a slot in range, the rest
// left as they are (filled with -1 before). With `first` (a fresh result's first steps; by first entry) `hi`
// carries kFromInput when the group's kernel, at `step`, reads its row from the input. Nothing is written before
// chain_start (backward_loop's ring relies on it).
__global__ void group_table_kernel(StepDims dm, const int32_t* __restrict__ order, const int32_t* __restrict__ group,
                                   const int32_t* __restrict__ idx, int64_t lanes, int64_t chunks, int64_t c0,
                                   int64_t c1, bool by_first, const uint32_t* __restrict__ first, StepOf step,
                                   GroupEntry* __restrict__ table) {
  chain_start();
  const int64_t n = dm.C * lanes, streams = dm.V * dm.P;
  for (int64_t b = blockIdx.y; b < streams * (c1 - c0); b += gridDim.y) {
    const int64_t s = b % streams, c = c0 + b / streams, u = unit_of(dm, s, c);
    GroupEntry* out = table + table_unit(dm, chunks, s, c) * n;
    const int32_t* bounds = group + u * (n + 1);
    const uint32_t* f = first ? first + s * dm.K : nullptr;
    const uint32_t at = step(dm, u);
    for (int64_t g = entry_start(); g < n; g += entry_stride()) {
      GroupEntry e{-1, bounds[g], bounds[g + 1], -1};
      if (e.lo < e.hi) {
        const int32_t head = order[u * n + e.lo];
        const int32_t slot = head >= 0 ? idx[u * n + head] : -1;
        if (slot >= 0 && slot < dm.K) {
          e.slot = slot;
          e.first = head;
        }
      }
      if (!by_first) {
        out[g] = e;
      } else if (e.slot >= 0) {
        const bool from_input = f && f[e.slot] >= at;
        out[e.first] = GroupEntry{e.slot, e.lo, e.hi | (from_input ? kFromInput : 0), static_cast<int32_t>(g)};
      }
    }
  }
}

// The slot group of this warp (one warp per group; blockIdx.x the stream, blockIdx.y * kGroupWarps + warp the
// group) in chunk c: its unit u, its sorted entries [lo, hi), the first of them and its slot, from chunk c's
// group table of a map with `lanes` lanes (W or R). False when the warp has no group.
struct Group {
  int64_t s, u, g;
  int lane;
  int32_t lo, hi, slot, first;
  bool from_input;  // a fresh output bank's first write of the slot: the row is the input bank's
};

__device__ __forceinline__ bool warp_group(const StepDims& dm, int64_t c, const GroupEntry* table, int64_t lanes,
                                           Group* out) {
  const int64_t n = dm.C * lanes;
  out->s = blockIdx.x;
  out->g = static_cast<int64_t>(blockIdx.y) * kGroupWarps + threadIdx.x / 32;
  out->lane = threadIdx.x % 32;
  if (out->g >= n) return false;
  out->u = unit_of(dm, out->s, c);
  const int4 e = __ldg(reinterpret_cast<const int4*>(table + out->s * n + out->g));
  out->slot = e.x;
  out->lo = e.y;
  out->hi = e.z;
  out->first = e.w;
  out->from_input = false;
  return out->slot >= 0;
}

// The group tables of a kernel's chunk (ChunkTables::at): write groups, and read groups (backward); stream s's
// C * W or C * R entries at s * C * W or s * C * R.
struct GroupTables {
  const GroupEntry* w;
  const GroupEntry* r;
};

// The unpacked group kernels take each slot group at its first sorted entry (the table by first entry): one block
// per (stream s, token t of unit u), whose warps take the token's entries in turn, each the group it heads, if any.
// Most groups have one entry, so the float32 vectors a group reads (delta; delta and dG; dy) are the token's: the
// block stages them in shared memory once (stage_token) instead of each warp reading them from L2, and the
// registers that held them keep more bank rows in flight.

// Floats per staged vector: D rounded up to whole quads (16-byte aligned rows; a partial quad's zeros stay inside).
__host__ __device__ constexpr int64_t owner_stride(int64_t D) { return (D + 3) / 4 * 4; }

// Row t = blockIdx.y of each of the NV vectors `vecs` into shared memory `staged` when NV * D <= kOwnerStageFloats
// (else pre points at them in global memory); pre[i] is where row t of vecs[i] is read. Ends with a block barrier.
template <int NV>
__device__ __forceinline__ void stage_token(int64_t D, const float* const (&vecs)[NV], float* staged,
                                            const float* (&pre)[NV]) {
  const int64_t t = blockIdx.y, stride = owner_stride(D);
  const bool stage = NV * stride <= kOwnerStageFloats;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    pre[i] = vecs[i] + t * D;
    if (!stage) continue;
    for (int64_t d = 4 * static_cast<int64_t>(threadIdx.x); d < D; d += 4 * static_cast<int64_t>(blockDim.x))
      copy_quad_async(staged + i * stride + d, pre[i] + d, static_cast<int>(D - d < 4 ? D - d : 4), D % 4 == 0);
    pre[i] = staged + i * stride;
  }
  if (stage) staged_wait();
}

// The groups one warp takes: the entries w = base + warp + k * kOwnerWarps (k < 32) of the block's token, lane k
// holding entry k's table row, loaded up front in one round (not one dependent load per group); next() hands out
// the groups these entries head, in increasing w, through shuffles. Warp-uniform.
struct OwnedGroups {
  const GroupEntry* mine;  // the token's table rows
  int64_t lanes, t;
  int64_t base = 0;
  int4 e;
  unsigned todo;
  Group gr;
  __device__ __forceinline__ OwnedGroups(const StepDims& dm, int64_t s, int64_t u, const GroupEntry* table,
                                         int64_t lanes_)
      : mine(table + (s * dm.C + blockIdx.y) * lanes_), lanes(lanes_), t(blockIdx.y) {
    gr.s = s;
    gr.u = u;
    gr.lane = threadIdx.x % 32;
    load_round();
  }
  __device__ __forceinline__ int64_t entry(int k) const {
    return base + static_cast<int64_t>(threadIdx.x / 32) + static_cast<int64_t>(k) * kOwnerWarps;
  }
  __device__ __forceinline__ void load_round() {
    const int64_t w = entry(gr.lane);
    e = w < lanes ? __ldg(reinterpret_cast<const int4*>(mine + w)) : make_int4(-1, -1, -1, -1);
    todo = __ballot_sync(0xffffffffu, e.x >= 0);
  }
  __device__ __forceinline__ bool next() {
    while (todo == 0) {
      base += 32 * kOwnerWarps;
      if (base >= lanes) return false;
      load_round();
    }
    const int k = __ffs(todo) - 1;
    todo &= todo - 1;
    gr.slot = __shfl_sync(0xffffffffu, e.x, k);
    gr.lo = __shfl_sync(0xffffffffu, e.y, k);
    const int32_t hi = __shfl_sync(0xffffffffu, e.z, k);
    gr.hi = hi & ~kFromInput;
    gr.from_input = (hi & kFromInput) != 0;
    gr.g = __shfl_sync(0xffffffffu, e.w, k);
    gr.first = static_cast<int32_t>(t * lanes + entry(k));
    return true;
  }
};

// body(group, vectors) for every group the warp takes, the token's vectors staged first. Vectors in the bank's
// dtype (V, the read side's dy) are widened to float32 on their way into shared memory (cp.async copies bytes as
// they are); too long to stage, body gets them where they are, in their dtype (`pre` then has another type).
template <int NV, typename V, typename Body>
__device__ __forceinline__ void for_owned_groups(const StepDims& dm, int64_t s, int64_t u, const GroupEntry* table,
                                                 int64_t lanes, const V* const (&vecs)[NV], float* staged,
                                                 Body body) {
  OwnedGroups owned(dm, s, u, table, lanes);
  if constexpr (std::is_same_v<V, float>) {
    const float* pre[NV];
    stage_token(dm.D, vecs, staged, pre);
    while (owned.next()) body(owned.gr, pre);
  } else {
    const int64_t D = dm.D, t = blockIdx.y, stride = owner_stride(D);
    if (NV * stride > kOwnerStageFloats) {
      const V* pre[NV];
#pragma unroll
      for (int i = 0; i < NV; ++i) pre[i] = vecs[i] + t * D;
      while (owned.next()) body(owned.gr, pre);
      return;
    }
    const float* pre[NV];
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      for (int64_t d = 4 * static_cast<int64_t>(threadIdx.x); d < D; d += 4 * static_cast<int64_t>(blockDim.x))
        *reinterpret_cast<float4*>(staged + i * stride + d) = load_quad(vecs[i] + t * D, d, D);
      pre[i] = staged + i * stride;
    }
    __syncthreads();
    while (owned.next()) body(owned.gr, pre);
  }
}

// acc += sum over the sorted entries e = order[from..hi) of coef[e] * vecs[e / W][0, VEC) (vecs: rows of D floats,
// offset to the columns of acc). With acc = scale * row first, the written row of the forward (cpe S0 + sum w
// delta; it adds the first entry itself, whose vector is its block's token's, and passes from = lo + 1) and Phase A's
// bank gradient of a long group (cpe dS1 + sum k_eff dG, from = lo) are this one sum.
template <int VEC, typename V>
__device__ __forceinline__ void group_add(const int32_t* order, int32_t from, int32_t hi, const float* coef,
                                          const V* vecs, int64_t W, int64_t D, float* acc) {
  for (int32_t k = from; k < hi; ++k) {
    const int32_t e = order[k];
    float x[VEC];
    load_cols_ro<VEC>(vecs + (e / W) * D, x);
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[i] += coef[e] * x[i];
  }
}

// The forward write of one group, the columns of one batch of S segments per lane from d0 (x: the row's
// segments, loaded): snapshot, then row = cpe * S0 + sum over the group's entries (sorted order) of w[e] * delta[t_e],
// the first entry's delta the block's token's (pre).
template <int VEC, int S, typename T>
__device__ __forceinline__ void write_batch(const StepDims& dm, const StepPhase1& p1, const ForwardIO& io, T* bank,
                                            const float* delta, const float* pre, const Group& gr, int64_t d0,
                                            const Cols<VEC, T> (&x)[S]) {
  const int64_t C = dm.C, W = dm.W, D = dm.D, u = gr.u;
  constexpr int64_t kStep = 32 * VEC;
  T* row = bank + (gr.s * dm.K + gr.slot) * D;
  T* snap = io.snapshot ? static_cast<T*>(io.snapshot) + (u * C * W + gr.g) * D : nullptr;
  const float* w = p1.w + u * C * W;
  const float cpe = p1.cpe[u * C * W + gr.first], w0 = w[gr.first];
#pragma unroll
  for (int k = 0; k < S; ++k) {
    const int64_t d = d0 + k * kStep;
    if (d >= D) break;
    if (snap) x[k].store(snap + d);
    float dl[VEC], acc[VEC];
    load_cols<VEC>(pre + d, dl);
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[i] = __fmaf_rn(w0, dl[i], cpe * x[k][i]);
    group_add<VEC>(p1.w_order + u * C * W, gr.lo + 1, gr.hi, w, delta + d, W, D, acc);
    store_cols<VEC>(row + d, acc);
  }
}

// `input` is the input bank of a fresh output bank (the rows of groups from_input are read there), else `bank`.
template <int VEC, typename T>
__global__ void __launch_bounds__(kOwnerWarps * 32, kOwnerBlocksPerSM)
    fwd_write_kernel(StepDims dm, StepPhase1 p1, ForwardIO io, const T* input, T* __restrict__ bank, int64_t c,
                     ChunkRows rows, GroupTables tables) {
  extern __shared__ __align__(16) float staged[];
  const int64_t D = dm.D, s = blockIdx.x, u = unit_of(dm, s, c);
  constexpr int S = segs_for(kWriteLaneBytes, VEC * static_cast<int>(sizeof(T)));
  const auto row_of = [&](const Group& gr) { return (gr.from_input ? input : bank) + (s * dm.K + gr.slot) * D; };
  const float* delta = rows.delta + rows.at(dm, u, s);
  const float* const vecs[1] = {delta};
  const float* pre[1];
  // The group table and the rows this kernel reads were final before the solve it follows started (that solve
  // waited for the gather, which waited for the previous chunk's write): the table rows and the first group's
  // row are loaded before chain_start waits for the solve, so those loads overlap its end; delta after.
  OwnedGroups owned(dm, s, u, tables.w, dm.W);
  const int64_t d0 = static_cast<int64_t>(owned.gr.lane) * VEC;
  if (D > S * 32 * VEC) {  // rows of several batches: one group at a time
    chain_start();
    stage_token(D, vecs, staged, pre);
    while (owned.next()) {
      const T* row = row_of(owned.gr);
      for (int64_t d = d0; d < D; d += S * 32 * VEC) {
        Cols<VEC, T> x[S];
        load_batch(row, d, D, x);
        write_batch<VEC>(dm, p1, io, bank, delta, pre[0], owned.gr, d, x);
      }
    }
    return;
  }
  // Rows of one batch: the next group's row is loaded before this one's is written (two rows in flight per warp).
  const bool any = owned.next();
  Group cur = owned.gr;
  Cols<VEC, T> x[S];
  if (any) load_batch(row_of(cur), d0, D, x);
  chain_start();
  stage_token(D, vecs, staged, pre);
  if (!any) return;
  for (;;) {
    const bool more = owned.next();
    Cols<VEC, T> y[S];
    if (more) load_batch(row_of(owned.gr), d0, D, y);
    write_batch<VEC>(dm, p1, io, bank, delta, pre[0], cur, d0, x);
    if (!more) break;
    cur = owned.gr;
#pragma unroll
    for (int k = 0; k < S; ++k) x[k] = y[k];
  }
}

// Backward scratch ([streams, C, D] float32 each). du (the adjoint of u = beta (v - G)) lives in dv's buffer,
// one [C, D] block per unit, until the dots kernel turns it into dv = beta du.
struct BackRows {
  float* gwr;
  float* dG;
};

// Before the loop, every unit at once: du = Minv^T (QK^T dy), the part of the adjoint that does not depend on
// the bank; one block per (unit, column slice). Shared memory: the dy and QK^T dy slices; staged, QK and Minv.
template <typename T, bool kStaged>
__global__ void bwd_dy_kernel(StepDims dm, StepPhase1 p1, BackwardIO io) {
  chain_start();
  constexpr int kRows = kTileRows<kStaged, false>;
  extern __shared__ __align__(16) float sh[];
  const int C = static_cast<int>(dm.C), slice = tile_rows(C) * kSlice, ms = kStaged ? matrix_stride(C) : C;
  const int64_t D = dm.D;
  const int64_t u = blockIdx.x, d0 = static_cast<int64_t>(blockIdx.y) * kSlice;
  float* sdy = sh;
  float* sdd = sdy + slice;
  float* sqk = sdd + slice;
  float* smi = sqk + tile_rows(C) * ms;
  const float* QK = p1.QK + u * C * C;
  const float* minv = p1.minv + u * C * C;
  const T* dy = static_cast<const T*>(io.dy) + u * C * D;
  if constexpr (kStaged) {
    stage_matrix_async(QK, C, sqk);
    stage_matrix_async(minv, C, smi);
    if constexpr (std::is_same_v<T, float>)
      stage_slice_async(dy, C, D, d0, sdy);
    else  // widened on the way (cp.async copies bytes as they are), while the matrices' copies fly
      stage_quads(C, sdy, [&](int t, int q) { return load_quad(dy + t * D, d0 + 4 * q, D); });
    staged_wait();
  } else {
    prefetch_matrix(QK, C);
    prefetch_matrix(minv, C);
    stage_quads(C, sdy, [&](int t, int q) { return load_quad(dy + t * D, d0 + 4 * q, D); });
    __syncthreads();
  }
  for_tiles<kRows>(C, [&](int r0, int q) {
    float4 x[kRows];
    tri_tile<true, kStaged, kRows>(kStaged ? sqk : QK, ms, sdy, r0, q, C, x);
#pragma unroll
    for (int j = 0; j < kRows; ++j)
      if (r0 + j < C) reinterpret_cast<float4*>(sdd + (r0 + j) * kSlice)[q] = x[j];
  });
  __syncthreads();
  for_tiles<kRows>(C, [&](int r0, int q) {
    float4 x[kRows];
    tri_tile<true, kStaged, kRows>(kStaged ? smi : minv, ms, sdd, r0, q, C, x);
#pragma unroll
    for (int j = 0; j < kRows; ++j)
      if (r0 + j < C) store_quad(io.dv + (u * C + r0 + j) * D, d0 + 4 * q, D, x[j]);
  });
}

// With packed sequences (kPacked, `local` the tokens' segments) only the chunk's last segment's writes were
// stored: the other tokens' rows are zero (and their dw stays 0).
// With a fresh result (kFresh) each lane's gradient row comes from the result or the input, by its tag (`w_tag`,
// lane_tags_kernel).
template <int VEC, typename GT, bool kPacked, bool kFresh>
__global__ void __launch_bounds__(kRowThreadsCap, kRowBlocksPerSM) bwd_gwr_kernel(StepDims dm, StepPhase1 p1, const GT* __restrict__ dbank, const GT* dbank_in, const int32_t* w_tag, int64_t c, BackRows rows, const int32_t* local) {
  chain_start();
  extern __shared__ float partial[];
  const int64_t s = blockIdx.x, t = blockIdx.y;
  const int64_t u = unit_of(dm, s, c);
  int64_t lanes = dm.W;
  if constexpr (kPacked) {
    const int32_t* local_u = local + u * dm.C;
    if (local_u[t] != warp_unit_last(local_u, dm.C)) lanes = 0;
  }
  const int64_t at = (u * dm.C + t) * dm.W;
  float* out = rows.gwr + (s * dm.C + t) * dm.D;
  if constexpr (kFresh) {
    const GT* input = dbank_in ? dbank_in + s * dm.K * dm.D : nullptr;  // null: a zero cotangent
    gather_row<VEC, GT>(FreshRows<GT>{dbank + s * dm.K * dm.D, input, dm.D}, w_tag + at,
                        p1.w + at, lanes, dm.D, out, partial);
  } else {
    gather_row<VEC, GT>(BankRows<GT>{dbank + s * dm.K * dm.D, dm.K, dm.D}, p1.k_idx + at, p1.w + at, lanes, dm.D,
                        out, partial);
  }
}

// In the loop: du += Minv^T gwr (the bank-dependent part), dG = -beta du. Shared memory: the gwr slice; staged,
// also the du slice and Minv.
template <bool kStaged>
__global__ void bwd_solve_kernel(StepDims dm, StepPhase1 p1, BackwardIO io, int64_t c, BackRows rows) {
  constexpr int kRows = kTileRows<kStaged, true>;
  extern __shared__ __align__(16) float sh[];
  const int C = static_cast<int>(dm.C), slice = tile_rows(C) * kSlice, ms = kStaged ? matrix_stride(C) : C;
  const int64_t D = dm.D;
  const int64_t s = blockIdx.x, d0 = static_cast<int64_t>(blockIdx.y) * kSlice;
  const int64_t u = unit_of(dm, s, c);
  float* sg = sh;
  float* sdu = sg + slice;
  float* smi = sdu + slice;
  const float* minv = p1.minv + u * C * C;
  const float* gwr = rows.gwr + s * C * D;
  float* du = io.dv + u * C * D;
  if constexpr (kStaged) {
    // Minv and du (the dy part's, written before the loop; only this kernel adds to it) are final before the
    // previous kernel: staged before chain_start waits for the GWR gather, as in fwd_solve_kernel; gwr after.
    stage_matrix_async(minv, C, smi);
    stage_slice_async(du, C, D, d0, sdu);
    chain_start();
    stage_slice_async(gwr, C, D, d0, sg);
    staged_wait();
  } else {
    chain_start();
    prefetch_matrix(minv, C);
    prefetch_slice(du, C, D, d0);
    stage_quads(C, sg, [&](int t, int q) { return load_quad(gwr + t * D, d0 + 4 * q, D); });
    __syncthreads();
  }
  for_tiles<kRows>(C, [&](int r0, int q) {
    float4 x[kRows];
    tri_tile<true, kStaged, kRows>(kStaged ? smi : minv, ms, sg, r0, q, C, x);
    const int64_t d = d0 + 4 * q;
#pragma unroll
    for (int j = 0; j < kRows; ++j) {
      const int r = r0 + j;
      if (r >= C) break;
      const float4 old = kStaged ? reinterpret_cast<const float4*>(sdu + r * kSlice)[q] : load_quad(du + r * D, d, D);
      const float4 y = make_float4(old.x + x[j].x, old.y + x[j].y, old.z + x[j].z, old.w + x[j].w);
      const float beta = io.beta[u * C + r];
      store_quad(du + r * D, d, D, y);
      store_quad(rows.dG + (s * C + r) * D, d, D, make_float4(-beta * y.x, -beta * y.y, -beta * y.z, -beta * y.w));
    }
  });
}

// After the loop, every unit at once, one block per (unit, tile of kDotsTile token rows i): with
// a_ij = <du_i, delta_j> and q_ij = <dy_i, delta_j> (each one thread's sum over d ascending),
//   dA[i, j] = -beta_i a_ij (j < i),  dQK[i, j] = q_ij (j <= i),  0 elsewhere,
//   dbeta_i = <du_i, v_i - G_i> - sum_{j < i} A[i, j] a_ij   (= <du_i, v_i - G_i - (A delta)_i>),
// and dv_i = beta_i du_i in place of du_i. The block walks the tiles (i0, j0), j0 <= i0, of kDotsTile x kDotsTile
// cells; their rows are staged in shared memory kDotsCols columns at a time, transposed ([column][row]), and thread
// (ti, tj) computes the 4 x 4 cells (i0 + 4 ti + r, j0 + 4 tj + c): per column three 16-byte loads (4 du, 4 dy,
// 4 delta) feed 32 products. (The 32-row tiles of one row by 4 cells per thread it replaces needed six loads for
// eight products and were bound by shared-memory loads: 602 us at chunk 128 on the flagship, 1144 at 256.) The
// diagonal tile (j0 = i0) is the last one a block computes: while staging it, each thread also writes dv = beta du
// over the du element it loaded (its last read) and each thread adds its columns' share of <du_i, v_i - G_i>.
// Every sum runs in a fixed order.
constexpr int kDotsTile = 64;
constexpr int kDotsCols = 32;                              // columns staged per step
constexpr int kDotsSide = kDotsTile / 4;                   // threads per tile side: 16
constexpr int kDotsThreads = kDotsSide * kDotsSide;        // 256
constexpr int kDotsStride = kDotsTile + 4;                 // floats per staged column: 16-byte rows, no bank conflicts
constexpr int kDotsStaged = kDotsTile * kDotsCols / kDotsThreads;  // elements each thread stages per array: 8

template <typename T>  // dy's dtype, the bank's
__global__ void __launch_bounds__(kDotsThreads, 2) bwd_dots_kernel(StepDims dm, StepPhase1 p1, BackwardIO io) {
  chain_start();
  const T* dy = static_cast<const T*>(io.dy);
  __shared__ __align__(16) float sdu[kDotsCols][kDotsStride], sdy[kDotsCols][kDotsStride],
      sdl[kDotsCols][kDotsStride];
  __shared__ __align__(16) float svg[kDotsCols][kDotsStride];  // v - G on the diagonal tile
  __shared__ float red[kDotsTile][kDotsSide + 1];
  const int64_t C = dm.C, D = dm.D;
  const int64_t u = blockIdx.x, i0 = static_cast<int64_t>(blockIdx.y) * kDotsTile;
  const int t = threadIdx.x, ti = t / kDotsSide, tj = t % kDotsSide;
  const int64_t base = u * C * D;
  float part[4] = {};  // this thread's shares of dbeta_i, rows i0 + 4 ti + r
  for (int64_t j0 = 0; j0 <= i0; j0 += kDotsTile) {  // j0 > i0: every cell masked
    const bool diag = j0 == i0;
    float a[4][4] = {}, q[4][4] = {};
    for (int64_t d0 = 0; d0 < D; d0 += kDotsCols) {
      // A warp stages 4 rows x 8 columns per round: 32 bytes of each row from global memory, and its transposed
      // stores (row + 68 column) fall in 32 distinct banks.
#pragma unroll 4  // 8 unrolled spill at 2 blocks per SM
      for (int n = 0; n < kDotsStaged; ++n) {
        const int w = n * (kDotsThreads / 32) + t / 32, lane = t % 32;
        const int r = 4 * (w % kDotsSide) + lane % 4, dd = 8 * (w / kDotsSide) + lane / 4;
        const int64_t d = d0 + dd;
        const bool in_i = i0 + r < C && d < D, in_j = j0 + r < C && d < D;
        const int64_t ki = base + (i0 + r) * D + d, kj = base + (j0 + r) * D + d;
        const float du = in_i ? io.dv[ki] : 0.f;  // du until written back as dv below
        sdu[dd][r] = du;
        sdy[dd][r] = in_i ? to_f(dy[ki]) : 0.f;
        sdl[dd][r] = in_j ? io.delta[kj] : 0.f;
        if (diag) {
          svg[dd][r] = in_i ? io.vg[ki] : 0.f;
          if (in_i) io.dv[ki] = io.beta[u * C + i0 + r] * du;
        }
      }
      __syncthreads();
#pragma unroll 4
      for (int dd = 0; dd < kDotsCols; ++dd) {
        const float4 x4 = *reinterpret_cast<const float4*>(&sdu[dd][4 * ti]);
        const float4 z4 = *reinterpret_cast<const float4*>(&sdy[dd][4 * ti]);
        const float4 l4 = *reinterpret_cast<const float4*>(&sdl[dd][4 * tj]);
        const float x[4] = {x4.x, x4.y, x4.z, x4.w}, z[4] = {z4.x, z4.y, z4.z, z4.w},
                    l[4] = {l4.x, l4.y, l4.z, l4.w};
#pragma unroll
        for (int r = 0; r < 4; ++r) {
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            a[r][c] += x[r] * l[c];
            q[r][c] += z[r] * l[c];
          }
        }
      }
      if (diag) {
        for (int dd = tj; dd < kDotsCols; dd += kDotsSide) {
#pragma unroll
          for (int r = 0; r < 4; ++r) part[r] += sdu[dd][4 * ti + r] * svg[dd][4 * ti + r];
        }
      }
      __syncthreads();
    }
    const int64_t jc = j0 + 4 * tj;  // this thread's first column
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int64_t i = i0 + 4 * ti + r;
      if (i >= C) break;
      const float beta_i = io.beta[u * C + i];
      const float* A = p1.A + (u * C + i) * C;
      float da[4], dq[4];
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int64_t j = jc + c;
        da[c] = j < i ? -beta_i * a[r][c] : 0.f;
        dq[c] = j <= i ? q[r][c] : 0.f;
        if (j < i) part[r] -= A[j] * a[r][c];
      }
      float* dA_row = io.dA + (u * C + i) * C;
      float* dQK_row = io.dQK + (u * C + i) * C;
      if (C % 4 == 0 && jc + 3 < C) {  // 16-byte aligned: C and jc are multiples of 4
        *reinterpret_cast<float4*>(dA_row + jc) = make_float4(da[0], da[1], da[2], da[3]);
        *reinterpret_cast<float4*>(dQK_row + jc) = make_float4(dq[0], dq[1], dq[2], dq[3]);
      } else {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          if (jc + c >= C) break;
          dA_row[jc + c] = da[c];
          dQK_row[jc + c] = dq[c];
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < 4; ++r) {  // the tiles past the diagonal: every cell masked
    const int64_t i = i0 + 4 * ti + r;
    if (i >= C) break;
    for (int64_t j = i0 + kDotsTile + tj; j < C; j += kDotsSide) {
      io.dA[(u * C + i) * C + j] = 0.f;
      io.dQK[(u * C + i) * C + j] = 0.f;
    }
    red[4 * ti + r][tj] = part[r];
  }
  __syncthreads();
  if (t < kDotsTile && i0 + t < C) {
    float x = red[t][0];
    for (int k = 1; k < kDotsSide; ++k) x += red[t][k];
    io.dbeta[u * C + i0 + t] = x;
  }
}

// Phase A's dots of a long group, each one warp_dot: dcpe = <dS1, S0> at the group's first entry e0, and per entry e
// dw = <delta_e, dS1>, dk_eff = <dG_e, S0> (entry e's outputs at base + e).
template <int VEC, typename T, typename GT>
__device__ __forceinline__ void phase_a_dots(const GT* drow, const T* s0, const float* delta, const float* dG,
                                             const int32_t* order, int32_t lo, int32_t hi, int64_t W, int64_t D,
                                             int lane, const BackwardIO& io, int64_t base, int64_t e0) {
  const float dcpe = warp_dot<VEC>(drow, s0, D, lane);
  if (lane == 0) io.dcpe[e0] = dcpe;
  for (int32_t k = lo; k < hi; ++k) {
    const int32_t e = order[k];
    const float dw = warp_dot<VEC>(delta + (e / W) * D, drow, D, lane);
    const float dk = warp_dot<VEC>(dG + (e / W) * D, s0, D, lane);
    if (lane == 0) {
      io.dw[base + e] = dw;
      io.dk_eff[base + e] = dk;
    }
  }
}

// Where a group kernel of the backward reads its gradient row (at `offset` of a bank): the result's, or until a fresh
// result's first write the cotangent's, a row of zeros for a zero cotangent (null `input`).
template <typename GT>
__device__ __forceinline__ const GT* fresh_source(const Group& gr, const GT* input, const GT* result,
                                                  const GT* zero_row, int64_t offset) {
  if (!gr.from_input) return result + offset;
  return input ? input + offset : zero_row;
}

template <int VEC, typename T, typename GT>
__global__ void __launch_bounds__(kOwnerWarps * 32, kOwnerBlocksPerSM)
    bwd_phase_a_kernel(StepDims dm, StepPhase1 p1, BackwardIO io, T* __restrict__ bank, GT* __restrict__ dbank,
                       const GT* dbank_in, const GT* zero_row, int64_t c, BackRows rows, GroupTables tables) {
  chain_start();
  extern __shared__ __align__(16) float staged[];
  const int64_t C = dm.C, W = dm.W, D = dm.D, K = dm.K, s = blockIdx.x, u = unit_of(dm, s, c);
  const float* delta = io.delta + u * C * D;
  const float* dG = rows.dG + s * C * D;
  const float* const vecs[2] = {delta, dG};
  for_owned_groups(dm, s, u, tables.w, W, vecs, staged, [&](const Group& gr, const float* const (&pre)[2]) {
    const int lane = gr.lane;
    const int32_t lo = gr.lo, hi = gr.hi, slot = gr.slot;
    const int32_t* order = p1.w_order + u * C * W;
    GT* drow = dbank + (s * K + slot) * D;  // dS1 is read at dsrc (the input's row until a fresh result's first write)
    const GT* dsrc = fresh_source(gr, dbank_in, dbank, zero_row, (s * K + slot) * D);
    const T* s0 = static_cast<const T*>(io.snapshot) + (u * C * W + gr.g) * D;
    const int64_t e0 = u * C * W + gr.first;
    const float cpe = p1.cpe[e0];
    const float* k_eff = p1.k_eff + u * C * W;
    T* row = bank + (s * K + slot) * D;
    if (hi - lo > kInlineEntries) {
      phase_a_dots<VEC>(dsrc, s0, delta, dG, order, lo, hi, W, D, lane, io, u * C * W, e0);
      for (int64_t d = static_cast<int64_t>(lane) * VEC; d < D; d += 32 * VEC) {
        float acc[VEC];
        load_cols<VEC>(dsrc + d, acc);
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[i] *= cpe;
        group_add<VEC>(order, lo, hi, k_eff, dG + d, W, D, acc);
        store_cols<VEC>(drow + d, acc);
        copy_cols<VEC>(s0 + d, row + d);
      }
      return;
    }
    // One pass over the row, in batches of segments per lane loaded before the first is used: the dots (as per-lane
    // partial sums over the lane's columns in increasing order, reduced in the fixed xor tree afterwards:
    // warp_dot's order), the gradient row and the restore. The first entry's delta and dG are the block's token's.
    const int32_t n = hi - lo;
    float p_cpe = 0.f, p_w[kInlineEntries] = {}, p_k[kInlineEntries] = {};
    walk_two_rows<VEC>(dsrc, s0, pre, D, lane, [&](int64_t d, const Cols<VEC, GT>& ds, const Cols<VEC, T>& sv,
                                                 const float (&first)[2][VEC]) {
      float acc[VEC];
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        p_cpe += ds[i] * sv[i];
        acc[i] = cpe * ds[i];
      }
#pragma unroll
      for (int j = 0; j < kInlineEntries; ++j) {
        if (j >= n) break;
        const int32_t e = j == 0 ? gr.first : order[lo + j];
        float dl[VEC], dg[VEC];
        if (j == 0) {
#pragma unroll
          for (int i = 0; i < VEC; ++i) dl[i] = first[0][i], dg[i] = first[1][i];
        } else {
          load_cols_ro<VEC>(delta + (e / W) * D + d, dl);
          load_cols_ro<VEC>(dG + (e / W) * D + d, dg);
        }
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          p_w[j] += dl[i] * ds[i];
          p_k[j] += dg[i] * sv[i];
          acc[i] += k_eff[e] * dg[i];
        }
      }
      store_cols<VEC>(drow + d, acc);
      sv.store(row + d);
    });
    const float dcpe = warp_sum(p_cpe);
    if (lane == 0) io.dcpe[e0] = dcpe;
#pragma unroll
    for (int j = 0; j < kInlineEntries; ++j) {
      if (j >= n) break;
      const float dw = warp_sum(p_w[j]), dk = warp_sum(p_k[j]);
      if (lane == 0) {
        io.dw[u * C * W + order[lo + j]] = dw;
        io.dk_eff[u * C * W + order[lo + j]] = dk;
      }
    }
  });
}

template <int VEC, typename T, typename GT>
__global__ void __launch_bounds__(kOwnerWarps * 32, kOwnerBlocksPerSM)
    bwd_read_side_kernel(StepDims dm, StepPhase1 p1, BackwardIO io, const T* __restrict__ bank,
                         GT* __restrict__ dbank, const GT* dbank_in, const GT* zero_row, int64_t c,
                         GroupTables tables) {
  chain_start();
  extern __shared__ __align__(16) float staged[];
  const int64_t C = dm.C, R = dm.R, D = dm.D, K = dm.K, s = blockIdx.x, u = unit_of(dm, s, c);
  const T* dy = static_cast<const T*>(io.dy) + u * C * D;
  const T* const vecs[1] = {dy};
  for_owned_groups(dm, s, u, tables.r, R, vecs, staged, [&](const Group& gr, const auto& pre) {
    const int lane = gr.lane;
    const int32_t lo = gr.lo, hi = gr.hi, slot = gr.slot;
    const int32_t* order = p1.r_order + u * C * R;
    GT* drow = dbank + (s * K + slot) * D;  // read at dsrc, as in Phase A
    const GT* dsrc = fresh_source(gr, dbank_in, dbank, zero_row, (s * K + slot) * D);
    const T* row = bank + (s * K + slot) * D;
    const float* q_w = p1.q_w + u * C * R;
    if (hi - lo > kInlineEntries) {
      for (int32_t k = lo; k < hi; ++k) {
        const int32_t r = order[k];
        const float dq = warp_dot<VEC>(dy + (r / R) * D, row, D, lane);
        if (lane == 0) io.dq_w[u * C * R + r] = dq;
      }
      for (int64_t d = static_cast<int64_t>(lane) * VEC; d < D; d += 32 * VEC) {
        float acc[VEC];
        load_cols<VEC>(dsrc + d, acc);
        for (int32_t k = lo; k < hi; ++k) {
          const int32_t r = order[k];
          float x[VEC];
          load_cols<VEC>(dy + (r / R) * D + d, x);
#pragma unroll
          for (int i = 0; i < VEC; ++i) acc[i] += q_w[r] * x[i];
        }
        store_cols<VEC>(drow + d, acc);
      }
      return;
    }
    // One pass over the row in batches of segments per lane (row and gradient row loaded before the first is
    // used): dq_w as per-lane partials (warp_dot's order) and the gradient row += q_w dy, the first entry's dy the
    // block's token's.
    const int32_t n = hi - lo;
    float p_q[kInlineEntries] = {};
    walk_two_rows<VEC>(row, dsrc, pre, D, lane, [&](int64_t d, const Cols<VEC, T>& x, const Cols<VEC, GT>& ds,
                                                  const float (&first)[1][VEC]) {
      float acc[VEC];
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc[i] = ds[i];
#pragma unroll
      for (int j = 0; j < kInlineEntries; ++j) {
        if (j >= n) break;
        const int32_t r = j == 0 ? gr.first : order[lo + j];
        float z[VEC];
        if (j == 0) {
#pragma unroll
          for (int i = 0; i < VEC; ++i) z[i] = first[0][i];
        } else {
          load_cols_ro<VEC>(dy + (r / R) * D + d, z);
        }
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          p_q[j] += z[i] * x[i];
          acc[i] += q_w[r] * z[i];
        }
      }
      store_cols<VEC>(drow + d, acc);
    });
#pragma unroll
    for (int j = 0; j < kInlineEntries; ++j) {
      if (j >= n) break;
      const float dq = warp_sum(p_q[j]);
      if (lane == 0) io.dq_w[u * C * R + order[lo + j]] = dq;
    }
  });
}

// ---- Packed sequences: the group kernels (docs/DESIGN.md "Packed sequences"). Phase 1 ran on virtual slots
// (slot + K * local), so a group holds the entries of one slot and one segment of the chunk, and the unit's group
// table is sorted by (local, slot). The forward stores only the last segment's groups (one per slot: one writer
// per row); the backward's earlier-segment groups and the read side can meet a row several times per chunk (once
// per segment), so one warp takes all of a slot's groups, in segment order (the CPU loops' order).

// The group of slot + K * local in the unit's table (n entries, valid groups first in increasing virtual slot,
// then empty ones), or -1: a binary search on (local of the group's first entry, slot).
__device__ __forceinline__ int64_t find_group(const GroupEntry* table, int64_t n, const int32_t* local_u,
                                              int64_t lanes, int64_t K, int64_t target) {
  const auto key = [&](int64_t g) {
    const GroupEntry e = table[g];
    return e.slot < 0 ? INT64_MAX : e.slot + K * static_cast<int64_t>(local_u[e.first / lanes]);
  };
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (key(mid) < target) lo = mid + 1;
    else hi = mid;
  }
  return lo < n && key(lo) == target ? lo : -1;
}

// For the warp of a group (slot `slot`, segment `l`) whose slot may have groups in other segments of the chunk:
// false if an earlier segment has one (that group's warp takes this one too); else body(group, segment) for this
// group and then for the slot's groups of the segments l + 1 .. until - 1, in order.
template <typename Body>
__device__ __forceinline__ void slot_chain(const GroupEntry* table, int64_t n, const int32_t* local_u, int64_t lanes,
                                           int64_t K, int32_t slot, int64_t g, int32_t l, int32_t until, Body body) {
  for (int32_t e = 0; e < l; ++e)
    if (find_group(table, n, local_u, lanes, K, slot + K * static_cast<int64_t>(e)) >= 0) return;
  body(g, l);
  for (int32_t next = l + 1; next < until; ++next) {
    const int64_t h = find_group(table, n, local_u, lanes, K, slot + K * static_cast<int64_t>(next));
    if (h >= 0) body(h, next);
  }
}

// The gradient of a group's gathers (a read group, or a write group of an earlier segment in Phase A): for each
// entry x (sorted order), out[x] = <vecs_x, row> (warp_dot), and target += sum coef[x] vecs_x, where vecs_x is the
// row of D floats of x's token ((x / lanes) * D): dy and q_w for reads, dG and k_eff for writes.
template <int VEC, typename V, typename T, typename GT>
__device__ __forceinline__ void gathers_gradient(const GroupEntry& e, const int32_t* order, const V* vecs,
                                                 const float* coef, int64_t lanes, int64_t D, int lane, const T* row,
                                                 GT* target, float* out) {
  for (int32_t k = e.lo; k < e.hi; ++k) {
    const int32_t x = order[k];
    const float dot = warp_dot<VEC>(vecs + (x / lanes) * D, row, D, lane);
    if (lane == 0) out[x] = dot;
  }
  for (int64_t d = static_cast<int64_t>(lane) * VEC; d < D; d += 32 * VEC) {
    float acc[VEC];
    load_cols<VEC>(target + d, acc);
    group_add<VEC>(order, e.lo, e.hi, coef, vecs + d, lanes, D, acc);
    store_cols<VEC>(target + d, acc);
  }
}

// Forward write with packed sequences: the groups of the chunk's last segment only. The row starts from the row
// as at its segment's start (the working row if current, else the initial bank's); the snapshot keeps the working
// row as it was and the stamp snapshot its stamp; the row is then stamped seg0 + last.
template <int VEC, typename T>
__global__ void __launch_bounds__(kGroupWarps * 32, kGroupBlocksPerSM)
    fwd_write_packed_kernel(StepDims dm, StepPhase1 p1, ForwardIO io, T* __restrict__ bank, int64_t c,
                            ChunkRows rows, GroupTables tables, SegView<T> sg) {
  chain_start();
  Group gr;
  if (!warp_group(dm, c, tables.w, dm.W, &gr)) return;
  const int64_t C = dm.C, W = dm.W, D = dm.D, K = dm.K, s = gr.s, u = gr.u, g = gr.g;
  const int32_t* local_u = sg.local + u * C;
  const int32_t last = warp_unit_last(local_u, C);
  if (local_u[gr.first / W] != last) return;  // an earlier segment's group: that segment is over
  const int32_t stamp = sg.stamp[s * K + gr.slot];
  const bool current = local_u[gr.first / W] == 0 && stamp == sg.seg0[u];
  T* row = bank + (s * K + gr.slot) * D;
  const T* old = current ? row : sg.initial + (s * K + gr.slot) * D;
  T* snap = io.snapshot ? static_cast<T*>(io.snapshot) + (u * C * W + g) * D : nullptr;
  const int32_t* order = p1.w_order + u * C * W;
  const float cpe = p1.cpe[u * C * W + gr.first];
  const float* delta = rows.delta + rows.at(dm, u, s);
  for (int64_t d = static_cast<int64_t>(gr.lane) * VEC; d < D; d += 32 * VEC) {
    float acc[VEC];
    load_cols<VEC>(old + d, acc);
    if (snap) copy_cols<VEC>(row + d, snap + d);
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[i] *= cpe;
    group_add<VEC>(order, gr.lo, gr.hi, p1.w + u * C * W, delta + d, W, D, acc);
    store_cols<VEC>(row + d, acc);
  }
  __syncwarp();  // every lane has read the stamp
  if (gr.lane == 0) {
    if (sg.stamp_snapshot) sg.stamp_snapshot[u * C * W + g] = stamp;
    sg.stamp[s * K + gr.slot] = sg.seg0[u] + last;
  }
}

// Phase A with packed sequences, the stored groups (the chunk's last segment; one per slot): restore the stamp,
// take the dots on the row as at the segment's start (the snapshot if current, else the initial bank's row), send
// cpe dS1 + sum k_eff dG to the row's gradient if current, else to the initial bank's (the row's gradient is then
// 0: the write replaced a row it did not read), restore the row.
template <int VEC, typename T, typename GT>
__global__ void __launch_bounds__(kGroupWarps * 32, kGroupBlocksPerSM)
    bwd_phase_a_packed_kernel(StepDims dm, StepPhase1 p1, BackwardIO io, T* __restrict__ bank, GT* __restrict__ dbank,
                              int64_t c, BackRows rows, GroupTables tables, SegView<T> sg) {
  chain_start();
  Group gr;
  if (!warp_group(dm, c, tables.w, dm.W, &gr)) return;
  const int64_t C = dm.C, W = dm.W, D = dm.D, K = dm.K, s = gr.s, u = gr.u, g = gr.g;
  const int lane = gr.lane;
  const int32_t* local_u = sg.local + u * C;
  if (local_u[gr.first / W] != warp_unit_last(local_u, C)) return;  // earlier segments: the next kernel
  const int32_t stamp = sg.stamp_snapshot[u * C * W + g];
  const bool current = local_u[gr.first / W] == 0 && stamp == sg.seg0[u];
  const int64_t at = (s * K + gr.slot) * D;
  GT* drow = dbank + at;
  GT* target = current ? drow : static_cast<GT*>(sg.dinitial) + at;
  const T* snap = static_cast<const T*>(io.snapshot) + (u * C * W + g) * D;
  const T* s0 = current ? snap : sg.initial + at;
  const int32_t* order = p1.w_order + u * C * W;
  const int64_t e0 = u * C * W + gr.first;
  const float cpe = p1.cpe[e0];
  const float* delta = io.delta + u * C * D;
  const float* dG = rows.dG + s * C * D;
  phase_a_dots<VEC>(drow, s0, delta, dG, order, gr.lo, gr.hi, W, D, lane, io, u * C * W, e0);
  for (int64_t d = static_cast<int64_t>(lane) * VEC; d < D; d += 32 * VEC) {
    float acc[VEC];
    load_cols<VEC>(drow + d, acc);
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[i] *= cpe;
    if (!current) {
      float x[VEC];
      const float zero[VEC] = {};
      load_cols<VEC>(target + d, x);
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc[i] += x[i];
      store_cols<VEC>(drow + d, zero);
    }
    group_add<VEC>(order, gr.lo, gr.hi, p1.k_eff + u * C * W, dG + d, W, D, acc);
    store_cols<VEC>(target + d, acc);
    copy_cols<VEC>(snap + d, bank + at + d);
  }
  if (lane == 0) sg.stamp[s * K + gr.slot] = stamp;
}

// With packed sequences, the groups that add only their gathers' gradient, after Phase A's stored groups (on the
// restored rows and stamps): kRead false, Phase A's groups of the chunk's earlier segments (not stored): dk_eff
// and sum k_eff dG; kRead true, the read side: dq_w and sum q_w dy. Each goes to the row's gradient if current,
// else to the initial bank's, with the dots on the row as at its segment's start; a slot's groups in segment
// order, by one warp (slot_chain).
template <int VEC, typename T, typename GT, bool kRead>
__global__ void __launch_bounds__(kGroupWarps * 32, kGroupBlocksPerSM)
    bwd_gathers_packed_kernel(StepDims dm, StepPhase1 p1, BackwardIO io, const T* __restrict__ bank,
                              GT* __restrict__ dbank, int64_t c, BackRows rows, GroupTables tables, SegView<T> sg) {
  chain_start();
  const int64_t lanes = kRead ? dm.R : dm.W;
  Group gr;
  if (!warp_group(dm, c, kRead ? tables.r : tables.w, lanes, &gr)) return;
  const int64_t C = dm.C, D = dm.D, K = dm.K, s = gr.s, u = gr.u, n = C * lanes;
  const int32_t* local_u = sg.local + u * C;
  const int32_t last = warp_unit_last(local_u, C);
  const int32_t l = local_u[gr.first / lanes];
  if (!kRead && l == last) return;  // a stored group: done by bwd_phase_a_packed_kernel
  const GroupEntry* table = (kRead ? tables.r : tables.w) + s * n;
  const int32_t* order = (kRead ? p1.r_order : p1.w_order) + u * n;
  // The read side's vectors are dy (the bank's dtype), the write side's dG (float32).
  using V = std::conditional_t<kRead, T, float>;
  const V* vecs;
  if constexpr (kRead)
    vecs = static_cast<const T*>(io.dy) + u * C * D;
  else
    vecs = rows.dG + s * C * D;
  const float* coef = (kRead ? p1.q_w : p1.k_eff) + u * n;
  float* out = (kRead ? io.dq_w : io.dk_eff) + u * n;
  const int64_t at = (s * K + gr.slot) * D;
  slot_chain(table, n, local_u, lanes, K, gr.slot, gr.g, l, kRead ? last + 1 : last, [&](int64_t h, int32_t) {
    const GroupEntry e = table[h];
    const bool current = seg_current(sg, dm, s, u, e.first / lanes, gr.slot);
    gathers_gradient<VEC>(e, order, vecs, coef, lanes, D, gr.lane, (current ? bank : sg.initial) + at,
                          (current ? dbank : static_cast<GT*>(sg.dinitial)) + at, out);
  });
}

// Allow `bytes` of dynamic shared memory (idempotent; kernels with static shared memory too must not rely on
// the default 48 KB).
template <typename Kernel>
int smem_attribute(Kernel kernel, size_t bytes) {
  return static_cast<int>(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(bytes)));
}

// Shared memory of a solve kernel: `slices` [tile_rows(C), kSlice] float32 slices, and when staged `staged_slices`
// more and `matrices` [tile_rows(C), matrix_stride(C)] matrices.
struct SolveSmem {
  int slices, staged_slices, matrices;
  size_t bytes(int64_t C, bool staged) const {
    const size_t slice = static_cast<size_t>(tile_rows(C)) * kSlice;
    const size_t matrix = static_cast<size_t>(tile_rows(C)) * matrix_stride(C);
    return sizeof(float) * (staged ? (slices + staged_slices) * slice + matrices * matrix : slices * slice);
  }
};
constexpr SolveSmem kFwdSolveSmem{2, 2, 2}, kBwdSolveSmem{1, 1, 1}, kDySmem{2, 0, 2};

// Whether a solve kernel (`max_c`: kStagedLoopMaxC or kStagedDyMaxC) is staged at chunk size C on this device: up to
// max_c, and its shared memory within what the device allows a block.
inline bool solve_staged(int64_t C, int max_c, const SolveSmem& smem) {
  if (C > max_c) return false;
  int device = 0, limit = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess)
    return false;
  return smem.bytes(C, true) <= static_cast<size_t>(limit);
}

// An integer A/B setting from the environment: 0 when unset or not a number.
inline int env_int(const char* name) {
  const char* env = std::getenv(name);
  return env ? std::atoi(env) : 0;
}

// Largest chunk size whose dy part is staged: kStagedDyMaxC, or what SDM_CUDA_DY_STAGED_MAX_C sets (for measuring:
// staged or not, every sum is the same; the shared-memory limit still applies).
inline int dy_staged_max_c() {
  static const int max_c = env_int("SDM_CUDA_DY_STAGED_MAX_C");
  return max_c > 0 ? max_c : kStagedDyMaxC;
}

// An A/B switch read once per process: on unless the environment sets `name` to 0.
inline bool env_switch(const char* name) {
  const char* env = std::getenv(name);
  return env == nullptr || std::strcmp(env, "0") != 0;
}

// Whether the kernels of a call are launched with programmatic stream serialization (chain_start): on devices of
// compute capability 9.0 and later, unless SDM_CUDA_PDL=0 (for measuring the difference; results are the same
// either way, only the scheduling changes).
inline bool use_pdl() {
  static const bool enabled = env_switch("SDM_CUDA_PDL");
  int device = 0, major = 0;
  return enabled && cudaGetDevice(&device) == cudaSuccess &&
         cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess && major >= 9;
}

// Whether a result the caller hands as a buffer of its own is filled fresh (first writes read the input; see
// prepare_fresh), unless SDM_CUDA_FRESH=0: then the whole input is copied into it first and updated in place (for
// measuring the difference; the results are the same bit for bit).
inline bool use_fresh() {
  static const bool enabled = env_switch("SDM_CUDA_FRESH");
  return enabled;
}

// One kernel launch of a call on `stream`, with programmatic dependent launch when `pdl`; the launch's error.
template <typename... Params, typename... Args>
int launch(bool pdl, void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
           Args... args) {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = &attr;
  cfg.numAttrs = pdl ? 1 : 0;
  return static_cast<int>(cudaLaunchKernelEx(&cfg, kernel, static_cast<Params>(args)...));
}

// Lane parts per block of the row gathers (row_block): `fallback` (the forward gather's 1, the GWR gather's 2), or
// what SDM_CUDA_GATHER_PARTS sets for both (1, 2 or 4; for measuring: the parts' partial sums are added in part
// order, so the rounding changes with their number). Measured on the H200 (flagship, chunk 128, NOTES v15, v21):
// 2 parts of 32 lanes in blocks of 256 threads beat 4 of 16 in blocks of 512 in both; the forward gather's 1 part
// of 64 lanes beat 2 by 28 us a call, the GWR gather with 1 part was not faster.
inline int gather_parts(int fallback) {
  static const int parts = [] {
    const int p = env_int("SDM_CUDA_GATHER_PARTS");
    return p == 1 || p == 2 || p == 4 ? p : 0;
  }();
  return parts ? parts : fallback;
}
constexpr int kForwardGatherParts = 1, kGwrGatherParts = 2;

// Block of a per-token gather: x threads, one per VEC columns (a whole number of warps, at most
// kRowThreadsMax), times y parts of the lanes (up to `parts`, at most 512 threads in all); and its shared memory
// (the parts' partial sums, then the token's `lanes` ids and weights).
struct RowBlock {
  dim3 threads;
  size_t smem;
};
inline RowBlock row_block(int64_t D, int vec, int64_t lanes, int parts) {
  const int64_t t = (D + vec - 1) / vec;
  const int x = static_cast<int>(std::min<int64_t>(kRowThreadsMax, std::max<int64_t>(32, (t + 31) / 32 * 32)));
  const int y = std::max(1, std::min(parts, kRowThreadsCap / x));
  return RowBlock{dim3(x, y), static_cast<size_t>(x) * y * vec * sizeof(float) +
                                  static_cast<size_t>(lanes) * (sizeof(int32_t) + sizeof(float))};
}

// The call's group tables after the per-chunk rows of the workspace (kernels/steps.h), each of `chunks` chunks
// (table_unit): the write groups', then (the backward's) the read groups' (or null).
struct ChunkTables {
  GroupEntry* w;
  GroupEntry* r;
  int64_t chunks;
  ChunkTables(const StepDims& dm, float* workspace, int64_t chunks_, bool reads)
      : w(reinterpret_cast<GroupEntry*>(workspace + step_rows_floats(dm))),
        r(reads ? w + dm.streams() * chunks_ * dm.C * dm.W : nullptr), chunks(chunks_) {}
  // Where the tables end (the workspace's next array).
  GroupEntry* end(const StepDims& dm) const {
    return (r ? r : w) + dm.streams() * chunks * dm.C * (r ? dm.R : dm.W);
  }
  // The tables of chunk c's kernels: from the chunk's place on.
  GroupTables at(const StepDims& dm, int64_t c) const {
    const int64_t unit = table_unit(dm, chunks, 0, c);
    return GroupTables{w + unit * dm.C * dm.W, r ? r + unit * dm.C * dm.R : nullptr};
  }
};

// Blocks of a grid-stride launch of 256 threads over `total` items.
inline int stride_blocks(int64_t total) { return static_cast<int>(std::min<int64_t>((total + 255) / 256, 4096)); }

// Blocks of a launch of 256 threads over `units` units of n entries each (the passes over a map's entries): units
// along y, entries along x, each grid-strided.
inline dim3 unit_grid(int64_t units, int64_t n) {
  return dim3(static_cast<unsigned>(std::min<int64_t>((n + 255) / 256, 64)),
              static_cast<unsigned>(std::min<int64_t>(units, 65535)));
}

// A map's part in the group tables (group_table_kernel): its sorted order, group offsets and ids (w_* with k_idx,
// or r_* with q_idx), its lanes (W or R) and the step of its groups.
struct TableMap {
  const int32_t* order;
  const int32_t* group;
  const int32_t* idx;
  int64_t lanes;
  StepOf step;
};

// The tables of `maps` (the write map's, then the backward's read map's) for chunks [c0, c1) of every stream. By
// first entry all of `tables` is filled with -1 first, in one memset: every entry that heads no group reads slot -1.
template <size_t N>
int build_group_tables(bool pdl, const StepDims& dm, const ChunkTables& tables, const TableMap (&maps)[N],
                       int64_t c0, int64_t c1, bool by_first, const uint32_t* first, cudaStream_t stream) {
  const int64_t units = dm.streams() * (c1 - c0);
  if (units == 0) return 0;
  if (by_first) {
    const size_t bytes = (tables.end(dm) - tables.w) * sizeof(GroupEntry);
    const int rc = static_cast<int>(cudaMemsetAsync(tables.w, 0xff, bytes, stream));
    if (rc) return rc;
  }
  GroupEntry* const out[2] = {tables.w, tables.r};
  for (size_t i = 0; i < N; ++i) {
    const TableMap& m = maps[i];
    if (m.lanes == 0) continue;
    const int rc = launch(pdl, group_table_kernel, unit_grid(units, dm.C * m.lanes), dim3(256), 0, stream, dm,
                          m.order, m.group, m.idx, m.lanes, tables.chunks, c0, c1, by_first, first, m.step, out[i]);
    if (rc) return rc;
  }
  return 0;
}

// A fresh result's arrays in the workspace, after the group tables (kernels/steps.h): each slot's first writing
// step ([streams, K]), then the gather lanes' row tags: the forward's write and read lanes, the backward's GWR
// lanes (its write lanes; no read tags).
struct FreshArrays {
  uint32_t* first;
  int32_t* w_tag;
  int32_t* r_tag;
  float* zero_row;  // the backward's: a row of zeros (16-byte aligned), read for a zero cotangent's rows
};
inline FreshArrays fresh_arrays_at(const StepDims& dm, GroupEntry* after_tables, bool forward) {
  uint32_t* first = reinterpret_cast<uint32_t*>(after_tables);
  int32_t* w_tag = reinterpret_cast<int32_t*>(first + dm.streams() * dm.K);
  int32_t* end = w_tag + dm.units() * dm.C * dm.W;
  if (forward) return FreshArrays{first, w_tag, end, nullptr};
  const uintptr_t at = (reinterpret_cast<uintptr_t>(end) + 15) / 16 * 16;
  return FreshArrays{first, w_tag, nullptr, reinterpret_cast<float*>(at)};
}

// One map's part in a fresh result (prepare_fresh): its ids, the step of its lanes, whether its kernel writes the
// rows (a write map in the forward; both maps in the backward) and where its gather lanes' tags go (or null).
struct TouchMap {
  const int32_t* idx;
  int64_t lanes;
  StepOf step;
  bool writes;
  int32_t* tags;
};

// Before a fresh result's chunk loop: the slots' first writing steps, the gather lanes' tags (the group tables
// are built after, from the first steps), and the rows no step writes copied from the input into the result.
template <int VEC, typename T>
int prepare_fresh(bool pdl, const StepDims& dm, const TouchMap (&maps)[2], uint32_t* first, const T* input,
                  T* result, cudaStream_t stream) {
  int rc = static_cast<int>(cudaMemsetAsync(first, 0xff, dm.streams() * dm.K * sizeof(uint32_t), stream));
  for (const TouchMap& m : maps) {
    const int64_t n = dm.C * m.lanes;
    if (!rc && dm.units() && n && m.writes)
      rc = launch(pdl, first_touch_kernel, unit_grid(dm.units(), n), dim3(256), 0, stream, dm, m.idx, m.lanes,
                  m.step, first);
  }
  for (const TouchMap& m : maps) {
    const int64_t n = dm.C * m.lanes;
    if (!rc && dm.units() && n && m.tags)
      rc = launch(pdl, lane_tags_kernel, unit_grid(dm.units(), n), dim3(256), 0, stream, dm, m.idx, m.lanes,
                  m.step, static_cast<const uint32_t*>(first), m.tags);
  }
  const int64_t rows = dm.streams() * dm.K;  // a thread per row: a warp per 32 rows
  if (!rc && rows)
    rc = launch(pdl, copy_untouched_kernel<VEC, T>, dim3(stride_blocks(rows)), dim3(256), 0, stream, dm,
                static_cast<const uint32_t*>(first), input, result);
  return rc;
}

// The whole input into the result when they are two buffers (packed sequences update the result in place); zeros
// for a null input.
template <typename T>
int copy_whole(const StepDims& dm, const T* input, T* result, cudaStream_t stream) {
  const size_t bytes = dm.streams() * dm.K * dm.D * sizeof(T);
  if (input == result) return 0;
  if (input == nullptr) return static_cast<int>(cudaMemsetAsync(result, 0, bytes, stream));  // a zero cotangent
  return static_cast<int>(cudaMemcpyAsync(result, input, bytes, cudaMemcpyDeviceToDevice, stream));
}

// Launch shape of the unpacked group kernels (for_owned_groups): one block of kOwnerWarps warps per (stream, token),
// and the shared memory that stages NV float32 vectors of the token (none when they do not fit).
struct OwnerLaunch {
  dim3 grid, block;
  size_t smem;
};
inline OwnerLaunch owner_launch(const StepDims& dm, int nv) {
  const int64_t floats = nv * owner_stride(dm.D);
  return OwnerLaunch{dim3(dm.streams(), dm.C), dim3(kOwnerWarps * 32),
                     floats <= kOwnerStageFloats ? floats * sizeof(float) : 0};
}

template <int VEC, typename T>
int forward_loop(const StepDims& dm, const StepPhase1& p1, const ForwardIO& io, const T* input, T* bank,
                 float* workspace, cudaStream_t stream, const StepSegments* segments) {
  const int64_t n = dm.streams() * dm.C * dm.D;
  const bool save = io.delta != nullptr;
  const ChunkRows rows{save ? io.vg : workspace, workspace + n, save ? io.delta : workspace + 2 * n, save};
  const ChunkTables group_tables(dm, workspace, dm.NC, false);
  const bool pdl = use_pdl();
  const bool fresh = segments == nullptr && input != bank && use_fresh();
  const FreshArrays fa = fresh_arrays_at(dm, group_tables.end(dm), true);
  const bool staged = solve_staged(dm.C, kStagedLoopMaxC, kFwdSolveSmem);
  const auto fwd_solve = staged ? fwd_solve_kernel<true> : fwd_solve_kernel<false>;
  const size_t smem = kFwdSolveSmem.bytes(dm.C, staged);
  int rc = 0;
  if (!fresh) rc = copy_whole(dm, input, bank, stream);  // none when input is bank
  if (!rc && fresh) {
    const TouchMap maps[2] = {{p1.k_idx, dm.W, kForwardStep, true, fa.w_tag},
                              {p1.q_idx, dm.R, kForwardStep, false, fa.r_tag}};
    rc = prepare_fresh<VEC>(pdl, dm, maps, fa.first, input, bank, stream);
  }
  if (!rc) {
    const TableMap w_map[1] = {{p1.w_order, p1.w_group, p1.k_idx, dm.W, kForwardStep}};
    rc = build_group_tables(pdl, dm, group_tables, w_map, 0, dm.NC, segments == nullptr, fresh ? fa.first : nullptr,
                            stream);
  }
  if (!rc) rc = smem_attribute(fwd_solve, smem);
  const dim3 slice_grid(dm.streams(), (dm.D + kSlice - 1) / kSlice);
  const dim3 group_grid(dm.streams(), (dm.C * dm.W + kGroupWarps - 1) / kGroupWarps);
  const RowBlock rb = row_block(dm.D, VEC, std::max(dm.W, dm.R), gather_parts(kForwardGatherParts));
  const dim3 gather_grid(dm.streams(), dm.C, 2);
  // The chunk steps: gather, solve, write (with packed sequences the gathers pick each row's bank, and the write
  // kernel stores the last segment's groups and stamps their rows; with a fresh output bank the gathers and the
  // write read a row from the input until its first write).
  const auto steps = [&](auto gather, auto write, auto seg) {
    if (!rc) rc = smem_attribute(gather, rb.smem);
    for (int64_t c = 0; c < dm.NC && !rc; ++c) {
      rc = launch(pdl, gather, gather_grid, rb.threads, rb.smem, stream, dm, p1, static_cast<const T*>(bank), c,
                  rows, seg);
      if (!rc)
        rc = launch(pdl, fwd_solve, slice_grid, dim3(solve_threads(dm.C, true, staged)), smem, stream, dm, p1, io, c,
                    rows);
      if (!rc) rc = write(c);
    }
  };
  if (!segments) {
    const OwnerLaunch ol = owner_launch(dm, 1);
    const auto write = [&](int64_t c) {
      return launch(pdl, fwd_write_kernel<VEC, T>, ol.grid, ol.block, ol.smem, stream, dm, p1, io,
                    fresh ? input : static_cast<const T*>(bank), bank, c, rows, group_tables.at(dm, c));
    };
    if (fresh)
      steps(fwd_gather_kernel<VEC, T, FreshView<T>>, write, FreshView<T>{input, fa.w_tag, fa.r_tag});
    else
      steps(fwd_gather_kernel<VEC, T, NoSegments>, write, NoSegments{});
    return rc;
  }
  const SegView<T> sv{segments->local, segments->seg0, static_cast<const T*>(segments->initial), segments->stamp,
                      segments->stamp_snapshot, nullptr};
  if (!rc) rc = static_cast<int>(cudaMemsetAsync(sv.stamp, 0, dm.streams() * dm.K * sizeof(int32_t), stream));
  steps(fwd_gather_kernel<VEC, T, SegView<T>>, [&](int64_t c) {
    return launch(pdl, fwd_write_packed_kernel<VEC, T>, group_grid, dim3(kGroupWarps * 32), 0, stream, dm, p1, io,
                  bank, c, rows, group_tables.at(dm, c), sv);
  }, sv);
  return rc;
}

// Columns per thread of the gradient rows' gather and copies: 16 bytes, 8 bfloat16 or 4 float32 columns.
template <int VEC, typename GT>
constexpr int kGVecOf = sizeof(GT) == 2 ? VEC : (VEC >= 4 ? 4 : 1);

template <int VEC, typename T, typename GT>
int backward_loop(const StepDims& dm, const StepPhase1& p1, const BackwardIO& io, T* bank, const GT* dbank_in,
                  GT* dbank, float* workspace, cudaStream_t stream, const StepSegments* segments) {
  const int64_t n = dm.streams() * dm.C * dm.D;
  const BackRows rows{workspace, workspace + n};
  const ChunkTables ring(dm, workspace, table_chunks(dm), true);
  const bool pdl = use_pdl();
  const bool dy_staged = solve_staged(dm.C, dy_staged_max_c(), kDySmem);
  const bool staged = solve_staged(dm.C, kStagedLoopMaxC, kBwdSolveSmem);
  const auto bwd_dy = dy_staged ? bwd_dy_kernel<T, true> : bwd_dy_kernel<T, false>;
  const auto bwd_solve = staged ? bwd_solve_kernel<true> : bwd_solve_kernel<false>;
  const size_t dy_smem = kDySmem.bytes(dm.C, dy_staged), solve_smem_bytes = kBwdSolveSmem.bytes(dm.C, staged);
  const bool by_first = segments == nullptr;
  // A fresh gradient bank: the cotangent's rows are read until the first Phase A or read side (in the loop's
  // order, the last chunk first) that writes them.
  const bool fresh = segments == nullptr && dbank_in != dbank && use_fresh();
  const FreshArrays fa = fresh_arrays_at(dm, ring.end(dm), false);
  const GT* zero_row = reinterpret_cast<const GT*>(fa.zero_row);
  int rc = 0;
  if (!fresh) rc = copy_whole(dm, dbank_in, dbank, stream);  // none when dbank_in is dbank
  if (!rc && fresh && dbank_in == nullptr)
    rc = static_cast<int>(cudaMemsetAsync(fa.zero_row, 0, dm.D * sizeof(GT), stream));
  if (!rc && fresh) {
    const TouchMap maps[2] = {{p1.k_idx, dm.W, kPhaseAStep, true, fa.w_tag},
                              {p1.q_idx, dm.R, kReadSideStep, true, nullptr}};
    rc = prepare_fresh<kGVecOf<VEC, GT>>(pdl, dm, maps, fa.first, dbank_in, dbank, stream);
  }
  // The group tables hold ring.chunks chunks (table_unit): the batch of chunk c (c0 = c - c % ring.chunks up to
  // c0 + ring.chunks) is built before the loop reaches its last chunk, the first the loop runs (the last batch's
  // before the loop).
  // Ordering, with PDL (chain_start): a build writes nothing until every kernel launched before it has completed,
  // the previous batch's readers (the only ones of the places it reuses) included: the memset (by first entry) is no
  // PDL launch and starts after them, and each table kernel writes after its chain_start. The batch's readers
  // (Phase A, the read side, the packed group kernels) come after both table kernels and after GWR and the solve
  // of the batch's first chunk, at least three launches after the last table kernel: they find its entries even
  // where they load them before their chain_start (when kernel N starts, N - 2 has completed).
  const uint32_t* first = fresh ? fa.first : nullptr;
  const TableMap table_maps[2] = {{p1.w_order, p1.w_group, p1.k_idx, dm.W, kPhaseAStep},
                                  {p1.r_order, p1.r_group, p1.q_idx, dm.R, kReadSideStep}};
  const auto build_batch = [&](int64_t c) {
    const int64_t c0 = c - c % ring.chunks;
    return build_group_tables(pdl, dm, ring, table_maps, c0, std::min(c0 + ring.chunks, dm.NC), by_first, first,
                              stream);
  };
  if (!rc) rc = build_batch(dm.NC - 1);
  if (!rc) rc = smem_attribute(bwd_dy, dy_smem);
  if (!rc) rc = smem_attribute(bwd_solve, solve_smem_bytes);
  const dim3 row_grid(dm.streams(), dm.C);
  const dim3 slice_grid(dm.streams(), (dm.D + kSlice - 1) / kSlice);
  const dim3 write_grid(dm.streams(), (dm.C * dm.W + kGroupWarps - 1) / kGroupWarps);
  const dim3 read_grid(dm.streams(), (dm.C * dm.R + kGroupWarps - 1) / kGroupWarps);
  constexpr int kGVec = kGVecOf<VEC, GT>;
  const RowBlock rb = row_block(dm.D, kGVec, dm.W, gather_parts(kGwrGatherParts));
  const auto gwr = segments ? bwd_gwr_kernel<kGVec, GT, true, false>
                   : fresh  ? bwd_gwr_kernel<kGVec, GT, false, true>
                            : bwd_gwr_kernel<kGVec, GT, false, false>;
  if (!rc) rc = smem_attribute(gwr, rb.smem);
  if (!rc) {
    rc = launch(pdl, bwd_dy, dim3(dm.units(), (dm.D + kSlice - 1) / kSlice),
                dim3(solve_threads(dm.C, false, dy_staged)), dy_smem, stream, dm, p1, io);
  }
  const dim3 group_block(kGroupWarps * 32);
  const OwnerLaunch phase_a = owner_launch(dm, 2), read_side = owner_launch(dm, 1);
  SegView<T> sv{};
  if (segments) {
    sv = SegView<T>{segments->local, segments->seg0, static_cast<const T*>(segments->initial), segments->stamp,
                    segments->stamp_snapshot, segments->dinitial};
  }
  for (int64_t c = dm.NC - 1; c >= 0 && !rc; --c) {
    if (c % ring.chunks == ring.chunks - 1 && c != dm.NC - 1 && (rc = build_batch(c)) != 0) break;
    const GroupTables tables = ring.at(dm, c);
    rc = launch(pdl, gwr, row_grid, rb.threads, rb.smem, stream, dm, p1, static_cast<const GT*>(dbank), dbank_in,
                static_cast<const int32_t*>(fa.w_tag), c, rows, sv.local);
    if (!rc)
      rc = launch(pdl, bwd_solve, slice_grid, dim3(solve_threads(dm.C, true, staged)), solve_smem_bytes, stream, dm, p1,
                  io, c, rows);
    if (segments) {  // Phase A (the stored groups, then the earlier segments' groups) and the read side
      if (!rc)
        rc = launch(pdl, bwd_phase_a_packed_kernel<VEC, T, GT>, write_grid, group_block, 0, stream, dm, p1, io, bank,
                    dbank, c, rows, tables, sv);
      if (!rc)
        rc = launch(pdl, bwd_gathers_packed_kernel<VEC, T, GT, false>, write_grid, group_block, 0, stream, dm, p1,
                    io, static_cast<const T*>(bank), dbank, c, rows, tables, sv);
      if (!rc)
        rc = launch(pdl, bwd_gathers_packed_kernel<VEC, T, GT, true>, read_grid, group_block, 0, stream, dm, p1, io,
                    static_cast<const T*>(bank), dbank, c, rows, tables, sv);
      continue;
    }
    if (!rc)
      rc = launch(pdl, bwd_phase_a_kernel<VEC, T, GT>, phase_a.grid, phase_a.block, phase_a.smem, stream, dm, p1, io,
                  bank, dbank, dbank_in, zero_row, c, rows, tables);
    if (!rc)
      rc = launch(pdl, bwd_read_side_kernel<VEC, T, GT>, read_side.grid, read_side.block, read_side.smem, stream, dm,
                  p1, io, static_cast<const T*>(bank), dbank, dbank_in, zero_row, c, tables);
  }
  if (!rc) {
    rc = launch(pdl, bwd_dots_kernel<T>, dim3(dm.units(), (dm.C + kDotsTile - 1) / kDotsTile), dim3(kDotsThreads), 0,
                stream, dm, p1, io);
  }
  return rc;
}

// Columns per thread from the shapes: 8 (16 bytes of bfloat16, two float4 of float32) when D allows, else 4,
// else 1. Every D works; the wide paths need D to be a multiple of VEC (rows stay 16-byte aligned).
inline int vec_of(int64_t D) { return D % 8 == 0 ? 8 : D % 4 == 0 ? 4 : 1; }

}  // namespace

template <typename BankT>
int forward_cuda(const StepDims& dm, const StepPhase1& p1, const ForwardIO& io, const BankT* bank_in,
                 BankT* bank_out, float* workspace, CUstream_st* stream, const StepSegments* segments) {
  using T = typename Device<BankT>::type;
  const T* input = reinterpret_cast<const T*>(bank_in);
  T* bank = reinterpret_cast<T*>(bank_out);
  if (dm.streams() == 0 || dm.K == 0 || dm.D == 0) return 0;
  if (dm.NC == 0 || dm.C == 0) return copy_whole(dm, input, bank, stream);  // no steps: the result is the input
  switch (vec_of(dm.D)) {
    case 8: return forward_loop<8>(dm, p1, io, input, bank, workspace, stream, segments);
    case 4: return forward_loop<4>(dm, p1, io, input, bank, workspace, stream, segments);
    default: return forward_loop<1>(dm, p1, io, input, bank, workspace, stream, segments);
  }
}

template <typename BankT, typename GradT>
int backward_cuda(const StepDims& dm, const StepPhase1& p1, const BackwardIO& io, BankT* bank_io,
                  const GradT* dbank_cot, GradT* dbank_out, float* workspace, CUstream_st* stream,
                  const StepSegments* segments) {
  using T = typename Device<BankT>::type;
  using GT = typename Device<GradT>::type;
  T* bank = reinterpret_cast<T*>(bank_io);
  const GT* dbank_in = reinterpret_cast<const GT*>(dbank_cot);
  GT* dbank = reinterpret_cast<GT*>(dbank_out);
  int rc = 0;
  // Entries in no group (out-of-range ids, padding) get zero gradients.
  for (auto [p, n] : {std::pair{io.dk_eff, dm.W}, std::pair{io.dw, dm.W}, std::pair{io.dcpe, dm.W},
                      std::pair{io.dq_w, dm.R}}) {
    if (!rc) rc = static_cast<int>(cudaMemsetAsync(p, 0, dm.units() * dm.C * n * sizeof(float), stream));
  }
  if (dm.streams() == 0 || dm.K == 0 || dm.D == 0 || rc) return rc;
  if (dm.NC == 0 || dm.C == 0) return copy_whole(dm, dbank_in, dbank, stream);  // no steps: dbank is the cotangent
  switch (vec_of(dm.D)) {
    case 8: return backward_loop<8>(dm, p1, io, bank, dbank_in, dbank, workspace, stream, segments);
    case 4: return backward_loop<4>(dm, p1, io, bank, dbank_in, dbank, workspace, stream, segments);
    default: return backward_loop<1>(dm, p1, io, bank, dbank_in, dbank, workspace, stream, segments);
  }
}

template int forward_cuda<float>(const StepDims&, const StepPhase1&, const ForwardIO&, const float*, float*,
                                 float*, CUstream_st*, const StepSegments*);
template int forward_cuda<bf16>(const StepDims&, const StepPhase1&, const ForwardIO&, const bf16*, bf16*, float*,
                                CUstream_st*, const StepSegments*);
template int backward_cuda<float, float>(const StepDims&, const StepPhase1&, const BackwardIO&, float*,
                                         const float*, float*, float*, CUstream_st*, const StepSegments*);
template int backward_cuda<bf16, float>(const StepDims&, const StepPhase1&, const BackwardIO&, bf16*, const float*,
                                        float*, float*, CUstream_st*, const StepSegments*);
template int backward_cuda<bf16, bf16>(const StepDims&, const StepPhase1&, const BackwardIO&, bf16*, const bf16*,
                                       bf16*, float*, CUstream_st*, const StepSegments*);

}  // namespace sdm
