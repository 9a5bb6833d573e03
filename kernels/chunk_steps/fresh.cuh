// A fresh result (docs/DESIGN.md "Forward steps"): when XLA hands the CUDA loops the input bank (or gradient bank)
// and its result as two buffers, the loops read each row from the input until its first write instead of copying
// the whole input first. Here: each slot's first writing step, the gather lanes' row tags and the copy of the rows
// no step writes.
#ifndef JAX_SDM_KERNELS_CHUNK_STEPS_FRESH_CUH_
#define JAX_SDM_KERNELS_CHUNK_STEPS_FRESH_CUH_

#include "kernels/chunk_steps/device.cuh"

namespace sdm {
namespace {

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
// A forward slab's steps (kernels/chunk_steps.h SlabCarry): chunk c is step c + 1, and step 0 stands for every
// earlier slab.
constexpr StepOf kForwardSlabStep{1, 1, false};

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

// A later slab's first steps (SlabCarry): every slot an earlier slab wrote was written at step 0, before this
// slab's steps; the others stay untouched.
__global__ void age_first_kernel(int64_t n, uint32_t* __restrict__ first) {
  chain_start();
  for (int64_t i = entry_start(); i < n; i += entry_stride())
    if (first[i] != kUntouched) first[i] = 0;
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

// The rows no step writes, from the input (its block StepDims::input_stream) into the result, or zeros for a null
// input.
// Each warp reads 32 rows' first steps in one load and copies the untouched rows among them (VEC columns per lane;
// D a multiple of VEC): at model sizes nearly every row is written, so most warps skip all 32 of their rows after
// that one load.
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
      const int64_t row = r0 + __ffs(m) - 1, at = row * dm.D;
      const int64_t in_at = (dm.input_stream(row / dm.K) * dm.K + row % dm.K) * dm.D;
      for (int64_t col = lane * VEC; col < dm.D; col += 32 * VEC) {
        if (input == nullptr) {
          const float zeros[VEC] = {};
          store_cols<VEC>(result + at + col, zeros);
        } else {
          Cols<VEC, T> x;
          x.load(input + in_at + col);
          x.store(result + at + col);
        }
      }
    }
  }
}


}  // namespace
}  // namespace sdm

#endif  // JAX_SDM_KERNELS_CHUNK_STEPS_FRESH_CUH_
