// The CUDA backward chunk loop, backward_cuda (kernels/chunk_steps.h; docs/MATH.md "Backward of a chunk";
// docs/DESIGN.md "Backward steps"): the math of cpu.cc laid out for the GPU, chunks in reverse.
//
//   per chunk, in reverse (in batches of table_chunks chunks, du in a ring of a batch's):
//     dy part           (the batch's first: chunk, stream, 32-column slice): du = Minv^T QK^T dy  backward_dense.cuh
//     GWR               (stream, token): gwr = sum_n w dS1[s] (gradient rows)                    backward_rows.cuh
//     apply the inverse (stream, slice): du += Minv^T gwr, dG = -beta du                         backward_dense.cuh
//     Phase A           (stream, token; a warp per write group): dcpe, dw, dk_eff, the gradient
//                       row (S0 through the links from the snapshot or the input bank)           backward_rows.cuh
//     read side         (stream, token; a warp per read group): dS0 += q_w dy, dq_w              backward_rows.cuh
//     dots              (the batch's last: chunk, stream, pair of tiles of 64 token rows): dA, dQK,
//                       dbeta's shares, dv = beta du                                             backward_dense.cuh
//   dbeta               (unit, token row): the shares added                                      backward_dense.cuh
//
// With packed sequences Phase A and the read side are packed.cuh's. The gradient bank is float32 or, for bfloat16
// banks, bfloat16 (GT): its rows are read into float32 and rounded once where a kernel writes them.
#include <cuda_runtime.h>

#include <utility>

#include "kernels/chunk_steps/backward_dense.cuh"
#include "kernels/chunk_steps/backward_rows.cuh"
#include "kernels/chunk_steps/launch.cuh"
#include "kernels/chunk_steps/packed.cuh"

namespace sdm {
namespace {

template <int VEC, typename T, typename GT>
int backward_loop(const StepDims& dm, const StepPhase1& p1, const BackwardIO& io, const T* input, const GT* dbank_in,
                  GT* dbank, float* workspace, cudaStream_t stream, const StepSegments* segments) {
  const int64_t n = dm.streams() * dm.C * dm.D;
  const BackRows rows{workspace, workspace + n, workspace + backward_du_ring_at(dm),
                      workspace + backward_dbeta_parts_at(dm)};
  const ChunkTables ring(dm, workspace, table_chunks(dm), true);
  const bool pdl = use_pdl();
  const bool dy_staged = dense_staged(dm.C, kStagedDyMaxC, kDySmem);
  const bool staged = dense_staged(dm.C, kStagedLoopMaxC, kBwdApplySmem);
  const bool tensor = dense_staged(dm.C, kStagedLoopMaxC, kBwdApplySmem, slice_stride(kMmaRows));
  const auto bwd_dy = dy_staged ? bwd_dy_kernel<T, true> : bwd_dy_kernel<T, false>;
  const int tile = dense_tile_rows(dm.C, true, staged, tensor);
  const auto bwd_apply = loop_dense_kernel<true>(staged, tile, [](auto kStaged, auto kRows) {
    return bwd_apply_inverse_kernel<kStaged(), kRows()>;
  });
  const size_t dy_smem = kDySmem.bytes(dm.C, dy_staged);
  const size_t apply_smem = kBwdApplySmem.bytes(dm.C, staged, slice_stride(tile));
  const bool by_first = segments == nullptr;
  // A fresh gradient bank: the cotangent's rows are read until the first Phase A or read side (in the loop's
  // order, the last chunk first) that writes them.
  const bool fresh = segments == nullptr && dbank_in != dbank;
  const FreshArrays fa = fresh_arrays_at(dm, ring.end(dm), false);
  const GT* zero_row = reinterpret_cast<const GT*>(fa.zero_row);
  int rc = 0;
  // The gradient banks are per stream whether or not the streams share the input bank.
  const StepDims grads = dm.per_stream();
  if (!fresh) rc = copy_whole(grads, dbank_in, dbank, stream);  // none when dbank_in is dbank
  if (!rc && fresh && dbank_in == nullptr)
    rc = static_cast<int>(cudaMemsetAsync(fa.zero_row, 0, dm.D * sizeof(GT), stream));
  if (!rc && fresh) {
    const TouchMap maps[2] = {{p1.k_idx, dm.W, kPhaseAStep, true, fa.w_tag},
                              {p1.q_idx, dm.R, kReadSideStep, true, nullptr}};
    rc = prepare_fresh<kGVecOf<VEC, GT>>(pdl, grads, maps, fa.first, dbank_in, dbank, stream);
  }
  // The group tables hold ring.chunks chunks (table_unit): the batch of chunk c (c0 = c - c % ring.chunks up to
  // c0 + ring.chunks) is built before the loop reaches its last chunk, the first the loop runs (the last batch's
  // before the loop).
  // Ordering, with PDL (chain_start): a build writes nothing until every kernel launched before it has completed,
  // the previous batch's readers (the only ones of the places it reuses) included: the memset (by first entry) is no
  // PDL launch and starts after them, and each table kernel writes after its chain_start. The batch's readers
  // (Phase A, the read side, the packed group kernels) come after both table kernels and after GWR and the adjoint
  // of the batch's first chunk, at least three launches after the last table kernel: they find its entries even
  // where they load them before their chain_start (when kernel N starts, N - 2 has completed).
  const uint32_t* first = fresh ? fa.first : nullptr;
  const TableMap table_maps[2] = {{p1.w_order, p1.w_group, p1.k_idx, dm.W, kPhaseAStep, io.link_k},
                                  {p1.r_order, p1.r_group, p1.q_idx, dm.R, kReadSideStep, io.link_q}};
  const auto build_batch = [&](int64_t c) {
    const int64_t c0 = c - c % ring.chunks;
    return build_group_tables(pdl, dm, ring, table_maps, c0, std::min(c0 + ring.chunks, dm.NC), by_first, first,
                              stream);
  };
  if (!rc) rc = build_batch(dm.NC - 1);
  if (!rc) rc = smem_attribute(bwd_dy, dy_smem);
  if (!rc) rc = smem_attribute(bwd_apply, apply_smem);
  if (!rc) rc = smem_attribute(bwd_dots_kernel<T>, sizeof(DotsShared));
  const dim3 row_grid(dm.streams(), dm.C);
  const dim3 slice_grid(dm.streams(), (dm.D + kSlice - 1) / kSlice);
  const dim3 write_grid(dm.streams(), (dm.C * dm.W + kGroupWarps - 1) / kGroupWarps);
  const dim3 read_grid(dm.streams(), (dm.C * dm.R + kGroupWarps - 1) / kGroupWarps);
  const unsigned dots_pairs = static_cast<unsigned>(dots_tiles(dm) * (dots_tiles(dm) + 1) / 2);
  constexpr int kGVec = kGVecOf<VEC, GT>;
  const RowBlock rb = row_block(dm.D, kGVec, dm.W, kGwrGatherParts);
  const auto gwr = segments ? bwd_gwr_kernel<kGVec, GT, true, false>
                   : fresh  ? bwd_gwr_kernel<kGVec, GT, false, true>
                            : bwd_gwr_kernel<kGVec, GT, false, false>;
  if (!rc) rc = smem_attribute(gwr, rb.smem);
  const dim3 group_block(kGroupWarps * 32);
  const OwnerLaunch phase_a = owner_launch(dm, 2, dm.W), read_side = owner_launch(dm, 1, dm.R);
  // Phase A and the read side of the call's snapshot dtype (a kernel for each: snapshot.cuh with_s0_source).
  const auto phase_a_kernel = by_snapshot_dtype(io.snapshot_dtype, [](auto kSnap) {
    return bwd_phase_a_kernel<VEC, T, GT, kSnap()>;
  });
  const auto read_side_kernel = by_snapshot_dtype(io.snapshot_dtype, [](auto kSnap) {
    return bwd_read_side_kernel<VEC, T, GT, kSnap()>;
  });
  SegView<T> sv{};
  if (segments) {
    sv = SegView<T>{segments->local, segments->seg0, static_cast<const T*>(segments->initial), segments->stamp,
                    segments->stamp_snapshot, segments->dinitial};
  }
  for (int64_t c = dm.NC - 1; c >= 0 && !rc; --c) {
    // The batch of chunks c0 .. top, top first: its tables (the last batch's were built before the loop) and its
    // dy part first, its dots after its last chunk.
    const int64_t c0 = c - c % ring.chunks, top = std::min(c0 + ring.chunks, dm.NC) - 1;
    const unsigned batch_blocks = static_cast<unsigned>((top - c0 + 1) * dm.streams());
    if (c == top && c != dm.NC - 1 && (rc = build_batch(c)) != 0) break;
    const GroupTables tables = ring.at(dm, c);
    BackRows chunk_rows = rows;  // du: chunk c's place in the ring
    chunk_rows.du += (c - c0) * n;
    if (c == top)
      rc = launch(pdl, bwd_dy, dim3(batch_blocks, slice_grid.y), dim3(dense_threads(dm.C, false, dy_staged)), dy_smem,
                  stream, dm, p1, io, c0, rows);
    if (!rc)
      rc = launch(pdl, gwr, row_grid, rb.threads, rb.smem, stream, dm, p1, static_cast<const GT*>(dbank), dbank_in,
                  static_cast<const int32_t*>(fa.w_tag), c, rows, sv.local);
    if (!rc)
      rc = launch(pdl, bwd_apply, slice_grid, dim3(tile_threads(dm.C, tile)), apply_smem, stream, dm, p1, io, c,
                  chunk_rows);
    if (segments) {  // Phase A (the stored groups, then the earlier segments' groups) and the read side
      if (!rc)
        rc = launch(pdl, bwd_phase_a_packed_kernel<VEC, T, GT>, write_grid, group_block, 0, stream, dm, p1, io, dbank,
                    c, rows, tables, sv);
      if (!rc)
        rc = launch(pdl, bwd_gathers_packed_kernel<VEC, T, GT, false>, write_grid, group_block, 0, stream, dm, p1,
                    io, dbank, c, rows, tables, sv);
      if (!rc)
        rc = launch(pdl, bwd_gathers_packed_kernel<VEC, T, GT, true>, read_grid, group_block, 0, stream, dm, p1, io,
                    dbank, c, rows, tables, sv);
    } else {
      if (!rc)
        rc = launch(pdl, phase_a_kernel, phase_a.grid, phase_a.block, phase_a.smem, stream, dm, p1, io, input, dbank,
                    dbank_in, zero_row, c, rows, tables);
      if (!rc)
        rc = launch(pdl, read_side_kernel, read_side.grid, read_side.block, read_side.smem, stream, dm, p1, io, input,
                    dbank, dbank_in, zero_row, c, tables);
    }
    if (!rc && c == c0)
      rc = launch(pdl, bwd_dots_kernel<T>, dim3(batch_blocks, dots_pairs), dim3(kDotsThreads), sizeof(DotsShared),
                  stream, dm, p1, io, c0, rows);
  }
  if (!rc) {
    const int64_t threads = 256, cells = dm.units() * dm.C;
    rc = launch(pdl, bwd_dbeta_kernel, dim3(static_cast<unsigned>((cells + threads - 1) / threads)),
                dim3(static_cast<unsigned>(threads)), 0, stream, dm, io, rows);
  }
  return rc;
}


}  // namespace

template <typename BankT, typename GradT>
int backward_cuda(const StepDims& dm, const StepPhase1& p1, const BackwardIO& io, const BankT* bank_in,
                  const GradT* dbank_cot, GradT* dbank_out, float* workspace, CUstream_st* stream,
                  const StepSegments* segments) {
  using T = typename Device<BankT>::type;
  using GT = typename Device<GradT>::type;
  const T* bank = reinterpret_cast<const T*>(bank_in);
  const GT* dbank_in = reinterpret_cast<const GT*>(dbank_cot);
  GT* dbank = reinterpret_cast<GT*>(dbank_out);
  int rc = 0;
  // Entries in no group (out-of-range ids, padding) get zero gradients.
  for (auto [p, n] : {std::pair{io.dk_eff, dm.W}, std::pair{io.dw, dm.W}, std::pair{io.dcpe, dm.W},
                      std::pair{io.dq_w, dm.R}}) {
    if (!rc) rc = static_cast<int>(cudaMemsetAsync(p, 0, dm.units() * dm.C * n * sizeof(float), stream));
  }
  if (dm.streams() == 0 || dm.K == 0 || dm.D == 0 || rc) return rc;
  if (dm.NC == 0 || dm.C == 0) return copy_whole(dm.per_stream(), dbank_in, dbank, stream);  // dbank: the cotangent
  switch (vec_of(dm.D)) {
    case 8: return backward_loop<8>(dm, p1, io, bank, dbank_in, dbank, workspace, stream, segments);
    case 4: return backward_loop<4>(dm, p1, io, bank, dbank_in, dbank, workspace, stream, segments);
    default: return backward_loop<1>(dm, p1, io, bank, dbank_in, dbank, workspace, stream, segments);
  }
}

template int backward_cuda<float, float>(const StepDims&, const StepPhase1&, const BackwardIO&, const float*,
                                         const float*, float*, float*, CUstream_st*, const StepSegments*);
template int backward_cuda<bf16, float>(const StepDims&, const StepPhase1&, const BackwardIO&, const bf16*,
                                        const float*, float*, float*, CUstream_st*, const StepSegments*);
template int backward_cuda<bf16, bf16>(const StepDims&, const StepPhase1&, const BackwardIO&, const bf16*,
                                       const bf16*, bf16*, float*, CUstream_st*, const StepSegments*);

}  // namespace sdm
