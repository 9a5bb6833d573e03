// Device helpers of the CUDA chunk steps (docs/MATH.md "Chunked form" and "Backward of a chunk", laid out for the
// GPU as docs/DESIGN.md "Forward steps" and "Backward steps" describe): conversions between a bank's dtype and
// float32, VEC columns of a row at a time (16-byte loads and stores where the shapes allow), the walks of the
// one-warp-per-row kernels over their columns, warp sums and dots in a fixed order, programmatic dependent launch
// (chain_start), the units of the layout (kernels/chunk_steps.h) and 4-float quads for shared-memory staging.
//
// Every kernel of the chunk steps keeps one writer per bank row, gradient row and output cell and sums in a fixed
// order (lanes in sorted or lane order, warp shuffles in a fixed xor tree): results are bitwise reproducible, with
// no floating-point atomics (fresh.cuh's integer minimum does not depend on the order). The kernels that walk bank
// and gradient rows are bound by memory latency: each thread loads several rows (or row segments) before using the
// first, and their register budgets (__launch_bounds__) are set for the blocks per SM that keep enough loads in
// flight.
#ifndef JAX_SDM_KERNELS_CHUNK_STEPS_DEVICE_CUH_
#define JAX_SDM_KERNELS_CHUNK_STEPS_DEVICE_CUH_

#include <cuda_bf16.h>
#include <cuda_pipeline.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "kernels/bf16_cuda.cuh"
#include "kernels/chunk_steps.h"

namespace sdm {
namespace {

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

// kStreaming: stores that the L2 evicts first (st.global.cs), for data no kernel of the call reads soon (the
// snapshot, a chunk's written rows), so that it does not push out rows that this or the next kernels read again.
template <int VEC, typename T, bool kStreaming = false>
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
      if constexpr (kStreaming) __stcs(reinterpret_cast<uint4*>(p) + k, raw);
      else reinterpret_cast<uint4*>(p)[k] = raw;
    }
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) from_f(p + i, x[i]);
  }
}

// kLastUse: `src` is a row in global memory that a kernel reads and stores for the last time in its chunk (the
// forward write, Phase A), loaded as lines the L2 evicts first (ld.global.cs), its stores streamed too (store_cols'
// kStreaming): the kernel's finished rows then leave the L2 first, and the rows the kernel before it gathered, which
// this kernel's later warps read again, stay (benchmarks/last_use.cu measures the pattern).
template <int VEC, typename T, bool kLastUse = false>
__device__ __forceinline__ void copy_cols(const T* src, T* dst) {
  if constexpr (VEC * sizeof(T) % 16 == 0) {
#pragma unroll
    for (int k = 0; k < static_cast<int>(VEC * sizeof(T) / 16); ++k) {
      const uint4* at = reinterpret_cast<const uint4*>(src) + k;
      reinterpret_cast<uint4*>(dst)[k] = kLastUse ? __ldcs(at) : *at;
    }
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) dst[i] = kLastUse ? __ldcs(src + i) : src[i];
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
  template <bool kLastUse = false>
  __device__ __forceinline__ void load(const T* p) { copy_cols<VEC, T, kLastUse>(p, v); }
  __device__ __forceinline__ void store(T* p) const { copy_cols<VEC>(v, p); }
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
template <bool kLastUse = false, int VEC, int S, typename T>
__device__ __forceinline__ void load_batch(const T* row, int64_t d0, int64_t D, Cols<VEC, T> (&x)[S]) {
#pragma unroll
  for (int k = 0; k < S; ++k) {
    if (d0 + k * 32 * VEC >= D) break;
    x[k].template load<kLastUse>(row + d0 + k * 32 * VEC);
  }
}

// A row in memory as walk_two_sources reads it: VEC columns at a time, as Cols of the row's dtype. (Another source,
// snapshot.cuh's CodedRowSource, reads a coded snapshot row and decodes its columns where they are used.)
// kLastUse: loaded as copy_cols<..., kLastUse> does.
template <int VEC, typename T, bool kLastUse = false>
struct RowSource {
  using ColsT = Cols<VEC, T>;
  static constexpr int kBytes = VEC * static_cast<int>(sizeof(T));  // loaded per segment
  const T* row;
  __device__ __forceinline__ void load(int64_t d, ColsT& c) const { c.template load<kLastUse>(row + d); }
};

// A lane of a one-warp-per-row kernel walks two row sources `a` and `b` (D columns each) in batches of S segments of
// VEC columns (32 * VEC apart), all of a batch loaded before the first is used, and calls
// body(d, a_cols, b_cols, pre_cols) per segment in increasing column order d (the order of the lane's partial sums),
// with the same columns of NPRE rows `pre` (the token's vectors, float32 in shared memory when staged) read then:
// they hold no registers while the rows are in flight.
template <int VEC, int NPRE, typename SA, typename SB, typename P, typename Body>
__device__ __forceinline__ void walk_two_sources(const SA& a, const SB& b, const P* const (&pre)[NPRE], int64_t D,
                                                 int lane, Body body) {
  constexpr int S = segs_for(kTwoRowLaneBytes, SA::kBytes + SB::kBytes);
  constexpr int64_t kStep = 32 * VEC;
  for (int64_t d0 = static_cast<int64_t>(lane) * VEC; d0 < D; d0 += S * kStep) {
    typename SA::ColsT x[S];
    typename SB::ColsT y[S];
    // load_batch's loop with each load under its own bound test instead of a break: load_batch's break spills
    // Phase A's coded instances at VEC 4 (ptxas), and this form in load_batch moves the forward write kernel's.
#pragma unroll
    for (int k = 0; k < S; ++k)
      if (d0 + k * kStep < D) a.load(d0 + k * kStep, x[k]);
#pragma unroll
    for (int k = 0; k < S; ++k)
      if (d0 + k * kStep < D) b.load(d0 + k * kStep, y[k]);
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
// staged in-loop dense kernels).
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

__device__ __forceinline__ int64_t chunk_of_unit(const StepDims& dm, int64_t u) { return (u / dm.P) % dm.NC; }
__device__ __forceinline__ int64_t stream_of_unit(const StepDims& dm, int64_t u) {
  return (u / (dm.NC * dm.P)) * dm.P + u % dm.P;
}

// The call-wide passes over a map's entries (first writes, lane tags, group tables) run units along y and a unit's n
// entries along x, both grid-strided (unit_grid), so that the unit's stream, chunk and step are worked out once per
// unit rather than by 64-bit divisions per entry.
__device__ __forceinline__ int64_t entry_start() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t entry_stride() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

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

// __stwb: one 16-byte store. A plain float4 assignment here compiled to four 4-byte stores (nvcc 13.0, the staged
// fwd_apply_inverse_kernel's PTX), each a partial write of the same sectors.
__device__ __forceinline__ void store_quad(float* row, int64_t d, int64_t D, float4 x) {
  if (D % 4 == 0) {
    if (d < D) __stwb(reinterpret_cast<float4*>(row + d), x);
    return;
  }
  const float v[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
  for (int k = 0; k < 4; ++k)
    if (d + k < D) row[d + k] = v[k];
}

// The same into a bfloat16 row, each value rounded to nearest even (one 8-byte store when D % 4 == 0).
__device__ __forceinline__ void store_quad(__nv_bfloat16* row, int64_t d, int64_t D, float4 x) {
  const float v[4] = {x.x, x.y, x.z, x.w};
  if (D % 4 == 0) {
    if (d >= D) return;
    alignas(8) __nv_bfloat16 e[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) from_f(e + k, v[k]);
    *reinterpret_cast<uint2*>(row + d) = *reinterpret_cast<const uint2*>(e);
    return;
  }
#pragma unroll
  for (int k = 0; k < 4; ++k)
    if (d + k < D) from_f(row + d + k, v[k]);
}

__device__ __forceinline__ void fma_quad(float4& acc, float m, const float4& c) {
  acc.x += m * c.x;
  acc.y += m * c.y;
  acc.z += m * c.z;
  acc.w += m * c.w;
}

}  // namespace
}  // namespace sdm

#endif  // JAX_SDM_KERNELS_CHUNK_STEPS_DEVICE_CUH_
