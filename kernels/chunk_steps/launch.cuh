// The host side of the CUDA chunk steps (docs/DESIGN.md "Forward steps", "Backward steps"): launches (with
// programmatic dependent launch where the device has it), the launch configuration from the shapes only, the
// places of the workspace's arrays (kernels/chunk_steps.h), the group tables' builds and a fresh result's
// preparation. forward_cuda.cu and backward_cuda.cu run the chunk loops with these.
#ifndef JAX_SDM_KERNELS_CHUNK_STEPS_LAUNCH_CUH_
#define JAX_SDM_KERNELS_CHUNK_STEPS_LAUNCH_CUH_

#include <algorithm>

#include "kernels/chunk_steps/dense.cuh"
#include "kernels/chunk_steps/device.cuh"
#include "kernels/chunk_steps/fresh.cuh"
#include "kernels/chunk_steps/groups.cuh"
#include "kernels/chunk_steps/rows.cuh"

namespace sdm {
namespace {

// Allow `bytes` of dynamic shared memory (idempotent; kernels with static shared memory too must not rely on
// the default 48 KB).
template <typename Kernel>
int smem_attribute(Kernel kernel, size_t bytes) {
  return static_cast<int>(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(bytes)));
}

// Shared memory of a dense kernel: `slices` [tile_rows(C), stride] float32 slices, and when staged `staged_slices`
// more and `matrices` [tile_rows(C), matrix_stride(C)] matrices.
struct DenseSmem {
  int slices, staged_slices, matrices;
  size_t bytes(int64_t C, bool staged, int stride = kSlice) const {
    const size_t slice = static_cast<size_t>(tile_rows(C)) * stride;
    const size_t matrix = static_cast<size_t>(tile_rows(C)) * matrix_stride(C);
    return sizeof(float) * (staged ? (slices + staged_slices) * slice + matrices * matrix : slices * slice);
  }
};
constexpr DenseSmem kFwdApplySmem{2, 2, 2}, kBwdApplySmem{1, 1, 1}, kDySmem{2, 0, 2};

// Attribute `attr` of the current device, or 0 when the query fails.
inline int device_attribute(cudaDeviceAttr attr) {
  int device = 0, value = 0;
  if (cudaGetDevice(&device) != cudaSuccess || cudaDeviceGetAttribute(&value, attr, device) != cudaSuccess) return 0;
  return value;
}

// Whether a dense kernel (`max_c`: kStagedLoopMaxC or kStagedDyMaxC) is staged at chunk size C on this device: up to
// max_c, and its shared memory within what the device allows a block.
inline bool dense_staged(int64_t C, int max_c, const DenseSmem& smem, int stride = kSlice) {
  return C <= max_c && smem.bytes(C, true, stride) <=
                           static_cast<size_t>(device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin));
}

// Whether the kernels of a call are launched with programmatic stream serialization (device.cuh chain_start): on
// devices of compute capability 9.0 and later, in a build with SDM_CUDA_PDL (kernels/chunk_steps.h
// kChunkStepsPdl). The results are the same either way, only the scheduling changes.
inline bool use_pdl() {
  return kChunkStepsPdl && device_attribute(cudaDevAttrComputeCapabilityMajor) >= 9;
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

// Lane parts per block of the row gathers (row_block; their partial sums are added in part order, so the rounding
// depends on their number): the forward gather's lanes in one part, the GWR gather's in 2, the faster choices on
// the H200 (benchmarks/RESULTS.md).
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

// The call's group tables after the per-chunk rows of the workspace (kernels/chunk_steps.h), each of `chunks` chunks
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
  const int32_t* links = nullptr;  // the backward's: each entry's link, for the tables by first entry
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
                          m.order, m.group, m.idx, m.lanes, tables.chunks, c0, c1, by_first, first,
                          by_first ? m.links : nullptr, m.step, out[i]);
    if (rc) return rc;
  }
  return 0;
}

// A fresh result's arrays in the workspace, after the group tables (kernels/chunk_steps.h): each slot's first writing
// step ([streams, K]), then the gather lanes' row tags: the forward's write and read lanes, the backward's GWR
// lanes (its write lanes; no read tags).
struct FreshArrays {
  uint32_t* first;
  int32_t* w_tag;
  int32_t* r_tag;
  float* zero_row;  // the backward's: a row of zeros (16-byte aligned), read for a zero cotangent's rows
  int32_t* last;    // the forward's: each slot's latest stored write, as its snapshot entry (Links)
};
inline FreshArrays fresh_arrays_at(const StepDims& dm, GroupEntry* after_tables, bool forward) {
  uint32_t* first = reinterpret_cast<uint32_t*>(after_tables);
  int32_t* w_tag = reinterpret_cast<int32_t*>(first + dm.streams() * dm.K);
  int32_t* end = w_tag + dm.units() * dm.C * dm.W;
  if (forward) return FreshArrays{first, w_tag, end, nullptr, end + dm.units() * dm.C * dm.R};
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
// are built after, from the first steps), and the rows no step writes copied from the input into the result. A
// forward slab after the first (`carried`) starts from the earlier slabs' first steps instead of none, and only the
// last (`copy`) copies the untouched rows (SlabCarry).
template <int VEC, typename T>
int prepare_fresh(bool pdl, const StepDims& dm, const TouchMap (&maps)[2], uint32_t* first, const T* input,
                  T* result, cudaStream_t stream, bool carried = false, bool copy = true) {
  const int64_t rows = dm.streams() * dm.K;  // copy_untouched_kernel: a thread per row, a warp per 32 rows
  int rc = carried ? launch(pdl, age_first_kernel, dim3(stride_blocks(rows)), dim3(256), 0, stream, rows, first)
                   : static_cast<int>(cudaMemsetAsync(first, 0xff, rows * sizeof(uint32_t), stream));
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
  if (!rc && rows && copy)
    rc = launch(pdl, copy_untouched_kernel<VEC, T>, dim3(stride_blocks(rows)), dim3(256), 0, stream, dm,
                static_cast<const uint32_t*>(first), input, result);
  return rc;
}

// The whole input into the result when they are two buffers (packed sequences update the result in place); zeros
// for a null input. A shared input (StepDims::input_streams) is copied once per group of streams that reads it.
template <typename T>
int copy_whole(const StepDims& dm, const T* input, T* result, cudaStream_t stream) {
  const size_t bytes = dm.streams() * dm.K * dm.D * sizeof(T);
  if (input == result) return 0;
  if (input == nullptr) return static_cast<int>(cudaMemsetAsync(result, 0, bytes, stream));  // a zero cotangent
  const size_t tile = dm.input_streams ? dm.input_streams * dm.K * dm.D * sizeof(T) : bytes;
  int rc = 0;
  for (size_t at = 0; at < bytes && !rc; at += tile)
    rc = static_cast<int>(cudaMemcpyAsync(reinterpret_cast<char*>(result) + at, input, tile,
                                          cudaMemcpyDeviceToDevice, stream));
  return rc;
}

// Launch shape of the unpacked group kernels (for_owned_groups) over a map of `lanes` lanes: blocks of kOwnerWarps
// warps per (stream, token, owner_split part), and the shared memory that stages NV float32 vectors of the token
// (none when they do not fit).
struct OwnerLaunch {
  dim3 grid, block;
  size_t smem;
};
// A token's lanes are split (owner_split) only when one block a token would make less than 1.5 waves of blocks on
// this device's SMs; the results are the same either way.
inline OwnerLaunch owner_launch(const StepDims& dm, int nv, int64_t lanes) {
  const int64_t floats = nv * owner_stride(dm.D);
  const int64_t sms = device_attribute(cudaDevAttrMultiProcessorCount);
  const bool split = 2 * dm.streams() * dm.C < 3 * sms * kOwnerBlocksPerSM;
  return OwnerLaunch{dim3(dm.streams(), dm.C, split ? owner_split(lanes) : 1), dim3(kOwnerWarps * 32),
                     floats <= kOwnerStageFloats ? floats * sizeof(float) : 0};
}

// Columns per thread of the gradient rows' gather and copies: 16 bytes, 8 bfloat16 or 4 float32 columns.
template <int VEC, typename GT>
constexpr int kGVecOf = sizeof(GT) == 2 ? VEC : (VEC >= 4 ? 4 : 1);

// Columns per thread from the shapes: 8 (16 bytes of bfloat16, two float4 of float32) when D allows, else 4,
// else 1. Every D works; the wide paths need D to be a multiple of VEC (rows stay 16-byte aligned).
inline int vec_of(int64_t D) { return D % 8 == 0 ? 8 : D % 4 == 0 ? 4 : 1; }

}  // namespace
}  // namespace sdm

#endif  // JAX_SDM_KERNELS_CHUNK_STEPS_LAUNCH_CUH_
