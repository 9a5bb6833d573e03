// The snapshot of the CUDA chunk steps (docs/MATH.md "The forward chunk step": the snapshot; kernels/chunk_steps.h
// ForwardIO::snapshot): for every unit and write group g, the row of the group's slot as it was before the chunk's
// write, in the bank's dtype, at [unit, g]. The forward's write kernels store it (snapshot_store), VEC columns per
// lane at a time; Phase A reads it as S0 for its dots (a row of the bank's dtype at snapshot_row) and puts it back
// into the bank (snapshot_restore). These functions are the only code that knows how a snapshot row is stored.
#ifndef JAX_SDM_KERNELS_CHUNK_STEPS_SNAPSHOT_CUH_
#define JAX_SDM_KERNELS_CHUNK_STEPS_SNAPSHOT_CUH_

#include <type_traits>

#include "kernels/chunk_steps/device.cuh"

namespace sdm {
namespace {

// Where the forward stores write group g's row of unit u; null for a forward without residuals.
template <typename T>
__device__ __forceinline__ T* snapshot_row(void* snapshot, const StepDims& dm, int64_t u, int64_t g) {
  return snapshot ? static_cast<T*>(snapshot) + (u * dm.C * dm.W + g) * dm.D : nullptr;
}

// Where the backward reads it.
template <typename T>
__device__ __forceinline__ const T* snapshot_row(const void* snapshot, const StepDims& dm, int64_t u, int64_t g) {
  return static_cast<const T*>(snapshot) + (u * dm.C * dm.W + g) * dm.D;
}

// Columns [d, d + VEC) of `to` from `from`: a row's columns held in registers (Cols), or a row in memory.
template <int VEC, typename T, typename From>
__device__ __forceinline__ void put_cols(T* to, int64_t d, const From& from) {
  if constexpr (std::is_pointer_v<From>) copy_cols<VEC>(from + d, to + d);
  else from.store(to + d);
}

// Store columns [d, d + VEC) of the row before the write into snapshot row `snap`: `row` is the row's columns as
// loaded (Cols) or the bank row itself.
template <int VEC, typename T, typename Row>
__device__ __forceinline__ void snapshot_store(T* snap, int64_t d, const Row& row) {
  put_cols<VEC>(snap, d, row);
}

// Restore columns [d, d + VEC) of bank row `row` from its snapshot: `snap` is the snapshot's columns as loaded
// (Cols) or snapshot row itself.
template <int VEC, typename T, typename Snap>
__device__ __forceinline__ void snapshot_restore(T* row, int64_t d, const Snap& snap) {
  put_cols<VEC>(row, d, snap);
}

}  // namespace
}  // namespace sdm

#endif  // JAX_SDM_KERNELS_CHUNK_STEPS_SNAPSHOT_CUH_
