// The snapshot of the CUDA chunk steps (docs/MATH.md "The forward chunk step": the snapshot, "Snapshot storage";
// kernels/chunk_steps.h ForwardIO::snapshot): for every unit and write group g, the row of the group's slot as it
// was before the chunk's write, at [unit, g]. In the bank's dtype, the forward's write kernels store it
// (snapshot_store), VEC columns per lane at a time; Phase A reads it as S0 for its dots (a row of the bank's dtype at
// snapshot_row) and puts it back into the bank (snapshot_restore). In another dtype (kernels/snapshot_codec.h) the
// group's warp stores the row before the write (snapshot_store_row) and Phase A first restores the bank row from it
// (snapshot_restore_row), then reads S0 there. These functions are the only code that knows how a snapshot row is
// stored.
#ifndef JAX_SDM_KERNELS_CHUNK_STEPS_SNAPSHOT_CUH_
#define JAX_SDM_KERNELS_CHUNK_STEPS_SNAPSHOT_CUH_

#include <type_traits>

#include "kernels/chunk_steps/device.cuh"
#include "kernels/snapshot_codec.h"

namespace sdm {
namespace {

// What a write kernel knows of its snapshot's dtype: nothing (it asks io), the bank's, or another one (its launch
// picked a kernel of its own for either, so that the bank-dtype one keeps its registers).
enum class SnapshotKernel { kAny, kBank, kCoded };

// Where the forward stores write group g's row of unit u in the bank's dtype; null for a forward without residuals
// or a snapshot of another dtype (snapshot_store_row stores those).
template <typename T, SnapshotKernel kKind = SnapshotKernel::kAny>
__device__ __forceinline__ T* snapshot_row(const ForwardIO& io, const StepDims& dm, int64_t u, int64_t g) {
  if (kKind == SnapshotKernel::kCoded || !io.snapshot) return nullptr;
  if (kKind == SnapshotKernel::kAny && io.snapshot_dtype != SnapshotDtype::kBank) return nullptr;
  return static_cast<T*>(io.snapshot) + (u * dm.C * dm.W + g) * dm.D;
}

// Where the backward reads it (a snapshot of the bank's dtype).
template <typename T>
__device__ __forceinline__ const T* snapshot_row(const BackwardIO& io, const StepDims& dm, int64_t u, int64_t g) {
  return static_cast<const T*>(io.snapshot) + (u * dm.C * dm.W + g) * dm.D;
}

// Where group g's row of unit u starts, in bytes, in a snapshot of another dtype than the bank's (its scale, if any,
// is at u * C * W + g).
__device__ __forceinline__ int64_t snapshot_coded_at(SnapshotDtype t, const StepDims& dm, int64_t u, int64_t g) {
  return (u * dm.C * dm.W + g) * snapshot_row_bytes(t, dm.D, 0);
}

// A snapshot of another dtype than the bank's (bfloat16 of a float32 bank, float8, int4), by the whole warp of the
// row's group before the write changes the row: the row's largest magnitude (a warp maximum, exact in any order),
// its scale (lane 0 stores it), then the coded bytes, a lane a 4-byte word (a byte where rows are not 4-byte
// aligned; snapshot_byte: one writer per byte, two int4 codes in one), read in full before the warp goes on to
// write the row. Nothing for a forward without residuals or a snapshot of the bank's dtype (snapshot_store).
template <typename T>
__device__ __forceinline__ void snapshot_store_row(const ForwardIO& io, const StepDims& dm, int64_t u, int64_t g,
                                                   const T* row, int lane) {
  const SnapshotDtype t = io.snapshot_dtype;
  if (!io.snapshot || t == SnapshotDtype::kBank) return;
  const int64_t D = dm.D;
  float scale = 0.f;
  if (snapshot_scaled(t)) {
    float amax = 0.f;
    for (int64_t d = lane; d < D; d += 32) amax = fmaxf(amax, fabsf(to_f(row[d])));
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    scale = snapshot_scale(t, amax);
    if (lane == 0) io.snapshot_scale[u * dm.C * dm.W + g] = scale;
  }
  uint8_t* out = static_cast<uint8_t*>(io.snapshot) + snapshot_coded_at(t, dm, u, g);
  const auto elem = [&](int64_t d) { return to_f(row[d]); };
  const int64_t bytes = snapshot_row_bytes(t, D, 0);
  if (bytes % 4 == 0) {  // every row 4-byte aligned: a word per lane (4x fewer store transactions than bytes)
    for (int64_t w = lane; w < bytes / 4; w += 32) {
      uint32_t word = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i) word |= static_cast<uint32_t>(snapshot_byte(t, 4 * w + i, D, scale, elem)) << (8 * i);
      reinterpret_cast<uint32_t*>(out)[w] = word;
    }
  } else {
    for (int64_t b = lane; b < bytes; b += 32) out[b] = snapshot_byte(t, b, D, scale, elem);
  }
  __syncwarp();  // every lane has read the row before any lane writes it
}

// Phase A's restore of a row from a snapshot of another dtype than the bank's, by the whole warp: the decoded
// values rounded to the bank's dtype, which Phase A then reads as S0 from the bank row (the row is complete for
// every lane after the warp barrier). Returns false, doing nothing, for a snapshot of the bank's dtype
// (snapshot_restore puts that back column by column).
template <typename T>
__device__ __forceinline__ bool snapshot_restore_row(const BackwardIO& io, const StepDims& dm, int64_t u, int64_t g,
                                                     T* row, int lane) {
  const SnapshotDtype t = io.snapshot_dtype;
  if (t == SnapshotDtype::kBank) return false;
  const uint8_t* in = static_cast<const uint8_t*>(io.snapshot) + snapshot_coded_at(t, dm, u, g);
  const float scale = snapshot_scaled(t) ? io.snapshot_scale[u * dm.C * dm.W + g] : 0.f;
  for (int64_t d = lane; d < dm.D; d += 32) from_f(row + d, snapshot_element(t, in, d, scale));
  __syncwarp();
  return true;
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
