// The CUDA forward chunk loop, forward_cuda (kernels/chunk_steps.h; docs/MATH.md "The forward chunk
// step"; docs/DESIGN.md "Forward steps"): the math of cpu.cc laid out for the GPU. Before the loop, for a fresh
// result, each slot's first writing chunk and the gather lanes' row tags (fresh.cuh), then the write groups' tables
// (groups.cuh); per chunk, three maximally parallel kernels on the caller's stream (forward.cuh):
//
//   gather            (stream, token, side): the G and Q0 rows
//   apply the inverse (stream, 32-column slice): u = beta (v - G), delta = Minv u, y = Q0 + QK delta
//   write             (stream, token; a warp per write group): cpe * S0 + sum_e w[e] delta[t_e], then its snapshot
//
// With packed sequences the write is packed.cuh's.
#include <cuda_runtime.h>

#include "kernels/chunk_steps/forward.cuh"
#include "kernels/chunk_steps/launch.cuh"
#include "kernels/chunk_steps/packed.cuh"

namespace sdm {
namespace {

template <int VEC, typename T>
int forward_loop(const StepDims& dm, const StepPhase1& p1, const ForwardIO& io, const T* input, T* bank,
                 float* workspace, cudaStream_t stream, const StepSegments* segments, const SlabCarry* slab) {
  const int64_t n = dm.streams() * dm.C * dm.D;
  const bool save = io.delta != nullptr;
  const ChunkRows rows{save ? io.vg : workspace, workspace + n, save ? io.delta : workspace + 2 * n, save};
  const ChunkTables group_tables(dm, workspace, dm.NC, false);
  const bool pdl = use_pdl();
  const bool fresh = segments == nullptr && input != bank;
  const FreshArrays fa = fresh_arrays_at(dm, group_tables.end(dm), true);
  // A slab of a carried fresh result (SlabCarry) keeps its first steps in the carry, counted from 1.
  uint32_t* const first = slab ? slab->first : fa.first;
  const StepOf step = slab ? kForwardSlabStep : kForwardStep;
  // The products on tensor cores where their wider slices fit too (dense_tile_rows).
  const bool staged = dense_staged(dm.C, kStagedLoopMaxC, kFwdApplySmem);
  const bool tensor = dense_staged(dm.C, kStagedLoopMaxC, kFwdApplySmem, slice_stride(kMmaRows));
  const int tile = dense_tile_rows(dm.C, true, staged, tensor);
  const auto fwd_apply = loop_dense_kernel<true>(staged, tile, [](auto kStaged, auto kRows) {
    return fwd_apply_inverse_kernel<T, kStaged(), kRows()>;
  });
  const size_t smem = kFwdApplySmem.bytes(dm.C, staged, slice_stride(tile));
  // The links' table: every slot without a write yet (-1) as the loop starts.
  const Links links{save ? fa.last : nullptr, io.link_k, io.link_q};
  // The last chunk's write stores no snapshot and moves no link: no later chunk reads a row through them.
  ForwardIO last_io = io;
  last_io.snapshot = nullptr;
  last_io.snapshot_scale = nullptr;
  const auto write_io = [&](int64_t c) -> const ForwardIO& { return dm.stores_snapshot(c) ? io : last_io; };
  const auto write_links = [&](int64_t c) { return dm.stores_snapshot(c) ? links.last : nullptr; };
  int rc = 0;
  if (save) rc = static_cast<int>(cudaMemsetAsync(fa.last, 0xff, dm.streams() * dm.K * sizeof(int32_t), stream));
  if (!rc && !fresh) rc = copy_whole(dm, input, bank, stream);  // none when input is bank
  if (!rc && fresh) {
    const TouchMap maps[2] = {{p1.k_idx, dm.W, step, true, fa.w_tag}, {p1.q_idx, dm.R, step, false, fa.r_tag}};
    rc = prepare_fresh<VEC>(pdl, dm, maps, first, input, bank, stream, slab && !slab->first_slab,
                            !slab || slab->last_slab);
  }
  if (!rc) {
    const TableMap w_map[1] = {{p1.w_order, p1.w_group, p1.k_idx, dm.W, step}};
    rc = build_group_tables(pdl, dm, group_tables, w_map, 0, dm.NC, segments == nullptr, fresh ? first : nullptr,
                            stream);
  }
  if (!rc) rc = smem_attribute(fwd_apply, smem);
  const dim3 slice_grid(dm.streams(), (dm.D + kSlice - 1) / kSlice);
  const dim3 group_grid(dm.streams(), (dm.C * dm.W + kGroupWarps - 1) / kGroupWarps);
  const RowBlock rb = row_block(dm.D, VEC, std::max(dm.W, dm.R), kForwardGatherParts);
  const dim3 gather_grid(dm.streams(), dm.C, 2);
  // The chunk steps: gather, apply the inverse, write (with packed sequences the gathers pick each row's bank, and
  // the write kernel stores the last segment's groups and stamps their rows; with a fresh output bank the gathers
  // and the write read a row from the input until its first write).
  const auto steps = [&](auto gather, auto write, auto seg) {
    if (!rc) rc = smem_attribute(gather, rb.smem);
    for (int64_t c = 0; c < dm.NC && !rc; ++c) {
      rc = launch(pdl, gather, gather_grid, rb.threads, rb.smem, stream, dm, p1, static_cast<const T*>(bank), c,
                  rows, seg, links);
      if (!rc)
        rc = launch(pdl, fwd_apply, slice_grid, dim3(tile_threads(dm.C, tile)), smem, stream, dm, p1, io, c, rows);
      if (!rc) rc = write(c);
    }
  };
  if (!segments) {
    const OwnerLaunch ol = owner_launch(dm, 1, dm.W);
    const auto write = [&](int64_t c) {
      const ForwardIO& wio = write_io(c);
      const bool coded = wio.snapshot && wio.snapshot_dtype != SnapshotDtype::kBank;
      return launch(pdl, coded ? fwd_write_kernel<VEC, T, true> : fwd_write_kernel<VEC, T, false>, ol.grid, ol.block,
                    ol.smem, stream, dm, p1, wio, fresh ? input : static_cast<const T*>(bank), bank, c, rows,
                    group_tables.at(dm, c), write_links(c));
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
    return launch(pdl, fwd_write_packed_kernel<VEC, T>, group_grid, dim3(kGroupWarps * 32), 0, stream, dm, p1,
                  write_io(c), bank, c, rows, group_tables.at(dm, c), sv, write_links(c));
  }, sv);
  return rc;
}


}  // namespace

template <typename BankT>
int forward_cuda(const StepDims& dm, const StepPhase1& p1, const ForwardIO& io, const BankT* bank_in,
                 BankT* bank_out, float* workspace, CUstream_st* stream, const StepSegments* segments,
                 const SlabCarry* slab) {
  using T = typename Device<BankT>::type;
  const T* input = reinterpret_cast<const T*>(bank_in);
  T* bank = reinterpret_cast<T*>(bank_out);
  if (dm.streams() == 0 || dm.K == 0 || dm.D == 0) return 0;
  if (dm.NC == 0 || dm.C == 0) return copy_whole(dm, input, bank, stream);  // no steps: the result is the input
  switch (vec_of(dm.D)) {
    case 8: return forward_loop<8>(dm, p1, io, input, bank, workspace, stream, segments, slab);
    case 4: return forward_loop<4>(dm, p1, io, input, bank, workspace, stream, segments, slab);
    default: return forward_loop<1>(dm, p1, io, input, bank, workspace, stream, segments, slab);
  }
}

template int forward_cuda<float>(const StepDims&, const StepPhase1&, const ForwardIO&, const float*, float*,
                                 float*, CUstream_st*, const StepSegments*, const SlabCarry*);
template int forward_cuda<bf16>(const StepDims&, const StepPhase1&, const ForwardIO&, const bf16*, bf16*, float*,
                                CUstream_st*, const StepSegments*, const SlabCarry*);

}  // namespace sdm
