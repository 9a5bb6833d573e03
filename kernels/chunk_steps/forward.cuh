// The kernels of the forward chunk step (docs/MATH.md "The forward chunk step"), one launch each per
// chunk: the gathers G and Q0 (fwd_gather_kernel), applying the inverse (fwd_apply_inverse_kernel: u, Delta, Y),
// and the write with its snapshot (fwd_write_kernel; with packed sequences packed.cuh's).
#ifndef JAX_SDM_KERNELS_CHUNK_STEPS_FORWARD_CUH_
#define JAX_SDM_KERNELS_CHUNK_STEPS_FORWARD_CUH_

#include "kernels/chunk_steps/dense.cuh"
#include "kernels/chunk_steps/device.cuh"
#include "kernels/chunk_steps/fresh.cuh"
#include "kernels/chunk_steps/groups.cuh"
#include "kernels/chunk_steps/rows.cuh"
#include "kernels/chunk_steps/snapshot.cuh"

namespace sdm {
namespace {

// The forward's links (ForwardIO::link_k, link_q; null without residuals) and their table `last` ([streams, K]):
// each slot's latest stored write, as its snapshot entry (-1: none yet). A chunk's gather records its lanes' links
// from the table before the chunk's write kernel moves the table to the chunk's writes.
struct Links {
  int32_t* last;
  int32_t* k;
  int32_t* q;
};

// The links of one side's lanes of token t (unit u, stream s): ids `idx`, `lanes` of them, into `out`.
__device__ __forceinline__ void record_links(const StepDims& dm, const int32_t* last, const int32_t* idx,
                                             int64_t lanes, int32_t* out) {
  for (int64_t k = threadIdx.y * blockDim.x + threadIdx.x; k < lanes; k += blockDim.x * blockDim.y) {
    const int32_t id = idx[k];
    out[k] = id >= 0 && id < dm.K ? last[id] : -1;
  }
}

// One block per (stream, token, side): side 1 gathers the write lanes' G row, side 0 the read lanes' Q0 row (two
// blocks rather than one doing both in turn: twice the rows in flight per chunk), each recording its lanes' links.
// The write lanes' rows are the ones the write kernel reads again after the inverse, and a grid's blocks start in
// order of blockIdx.z last: gathered second, they are the latest rows in L2 when the write starts (a chunk's rows of
// either side are more than L2 holds at the paper's shape: 64 MiB a side).
// Seg is NoSegments; SegView<T> with packed sequences (each lane's row from the working or the initial bank); or
// FreshView<T> for a fresh output bank (each lane's row from the result or the input bank, by its tag).
template <int VEC, typename T, typename Seg>
__global__ void __launch_bounds__(kRowThreadsCap, kRowBlocksPerSM)
    fwd_gather_kernel(StepDims dm, StepPhase1 p1, const T* __restrict__ bank, int64_t c, ChunkRows rows, Seg sg,
                      Links links) {
  chain_start();
  extern __shared__ float partial[];
  const int64_t s = blockIdx.x, t = blockIdx.y;
  const int64_t u = unit_of(dm, s, c);
  const T* S = bank + s * dm.K * dm.D;
  if (links.k) {
    const bool w_side = blockIdx.z == 1;
    const int64_t lanes = w_side ? dm.W : dm.R, at = (u * dm.C + t) * lanes;
    record_links(dm, links.last + s * dm.K, (w_side ? p1.k_idx : p1.q_idx) + at, lanes,
                 (w_side ? links.k : links.q) + at);
  }
  const auto side = [&](auto row_of, const int32_t* w_ids, const int32_t* r_ids) {
    if (blockIdx.z == 1) {
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
    side(FreshRows<T>{S, sg.input + dm.input_stream(s) * dm.K * dm.D, dm.D}, sg.w_tag, sg.r_tag);
  } else {
    side(BankRows<T>{S, dm.K, dm.D}, p1.k_idx, p1.q_idx);
  }
}

// Apply the inverse: u = beta (v - G), delta = Minv u, y = Q0 + QK delta (v and y in the bank's dtype T, widened
// on load and rounded once on store). One block per (stream, kSlice-column slice), one thread per tile (kRows
// rows, 4 columns: dense_tile_rows) and turn, or with kRows = kMmaRows (staged) the products on tensor cores, a
// warp per pair of 16 x 8 tiles (mma_tri_product). Shared memory: u and delta slices; staged, also the G and Q0
// slices and Minv, QK.
template <typename T, bool kStaged, int kRows>
__global__ void fwd_apply_inverse_kernel(StepDims dm, StepPhase1 p1, ForwardIO io, int64_t c, ChunkRows rows) {
  constexpr bool kMma = kRows == kMmaRows;
  static_assert(!kMma || kStaged, "the tensor-core products read staged operands");
  constexpr int ss = slice_stride(kRows);
  extern __shared__ __align__(16) float sh[];
  const int C = static_cast<int>(dm.C), slice = tile_rows(C) * ss, ms = kStaged ? matrix_stride(C) : C;
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
  const T* v = static_cast<const T*>(io.v) + u * C * D;
  T* y = static_cast<T*>(io.y) + u * C * D;
  const float* beta = io.beta + u * C;
  const float* minv = p1.minv + u * C * C;
  const float* QK = p1.QK + u * C * C;
  const float* Q0 = rows.Q0 + s * C * D;
  if constexpr (kStaged) {
    // Minv, QK and v were final before the chunk loop began: their copies are issued before chain_start waits for
    // the gather (see chain_start), so they overlap its end; G and Q0 after.
    stage_matrix_async<kMma>(minv, C, smi);
    stage_matrix_async<kMma>(QK, C, sqk);
    stage_slice(v, C, D, d0, su, ss);
    chain_start();
    stage_slice_async(G, C, D, d0, sG, ss);
    stage_slice_async(Q0, C, D, d0, sq0, ss);
    staged_wait();
    for (int idx = threadIdx.x; idx < tile_rows(C) * kQuads; idx += blockDim.x) {  // u = beta (v - G), in place of v
      const int t = idx / kQuads, at = t * ss + 4 * (idx % kQuads);
      const float b = t < C ? beta[t] : 0.f;
      float4& x = *reinterpret_cast<float4*>(su + at);
      const float4 g = *reinterpret_cast<const float4*>(sG + at);
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
  if constexpr (kMma) {
    // Each product's tiles into shared memory (delta, then QK delta in place of G), then a pass that stores the
    // slice's quads (coalesced, through store_quad's guards at D): out(t, q, the product's quad).
    const auto product = [&](const float* M, const float* S, float* P, auto out) {
      mma_tri_product<false>(M, ms, S, C,
                             [&](int mi, int ni, const float(&acc)[4]) { store_mma_tile(P, mi, ni, acc); });
      __syncthreads();
      for (int idx = threadIdx.x; idx < C * kQuads; idx += blockDim.x) {
        const int t = idx / kQuads, q = idx % kQuads;
        out(t, q, *reinterpret_cast<const float4*>(P + t * ss + 4 * q));
      }
    };
    product(smi, su, sdelta, [&](int t, int q, float4 x) { store_quad(delta + t * D, d0 + 4 * q, D, x); });
    product(sqk, sdelta, sG, [&](int t, int q, float4 x) {
      const float4 q0 = *reinterpret_cast<const float4*>(sq0 + t * ss + 4 * q);
      store_quad(y + t * D, d0 + 4 * q, D, make_float4(x.x + q0.x, x.y + q0.y, x.z + q0.z, x.w + q0.w));
    });
  } else {
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
        store_quad(y + (r0 + j) * D, d, D,
                   make_float4(x[j].x + q0.x, x[j].y + q0.y, x[j].z + q0.z, x[j].w + q0.w));
      }
    });
  }
}

// The forward write of one group, the columns of one batch of S segments per lane from d0 (x: the row's segments,
// loaded): row = cpe * S0 + sum over the group's entries (sorted order) of w[e] * delta[t_e], the first entry's
// delta the block's token's (pre); then, in the bank's dtype, the snapshot of the written row.
template <bool kCoded, int VEC, int S, typename T>
__device__ __forceinline__ void write_batch(const StepDims& dm, const StepPhase1& p1, const ForwardIO& io, T* bank,
                                            const float* delta, const float* pre, const Group& gr, int64_t d0,
                                            const Cols<VEC, T> (&x)[S]) {
  const int64_t C = dm.C, W = dm.W, D = dm.D, u = gr.u;
  constexpr int64_t kStep = 32 * VEC;
  T* row = bank + (gr.s * dm.K + gr.slot) * D;
  T* snap = snapshot_row<T, kCoded ? SnapshotKernel::kCoded : SnapshotKernel::kBank>(io, dm, u, gr.g);
  const float* w = p1.w + u * C * W;
  const float cpe = p1.cpe[u * C * W + gr.first], w0 = w[gr.first];
#pragma unroll
  for (int k = 0; k < S; ++k) {
    const int64_t d = d0 + k * kStep;
    if (d >= D) break;
    float dl[VEC], acc[VEC];
    load_cols<VEC>(pre + d, dl);
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[i] = __fmaf_rn(w0, dl[i], cpe * x[k][i]);
    group_add<VEC>(p1.w_order + u * C * W, gr.lo + 1, gr.hi, w, delta + d, W, D, acc);
    // Streamed (see load_batch<true> in fwd_write_kernel), except where the coded snapshot reads the row back.
    store_cols<VEC, T, !kCoded>(row + d, acc);
    if (snap) snapshot_store_cols<VEC>(snap + d, acc);  // the written row, the same roundings
  }
}

// After a group's row is written (by the whole warp): a coded snapshot of it (the warp reads the row back: its
// scale needs the whole row's largest magnitude), and the slot's latest write moved to the group's entry.
template <bool kCoded, int VEC, typename T>
__device__ __forceinline__ void after_write(const StepDims& dm, const ForwardIO& io, const T* bank, const Group& gr,
                                            int32_t* last) {
  if constexpr (kCoded) {
    __syncwarp();  // the row's columns, stored by every lane, visible to the warp
    snapshot_store_row<VEC>(io, dm, gr.u, gr.g, bank + (gr.s * dm.K + gr.slot) * dm.D, gr.lane);
  }
  if (last && gr.lane == 0) last[gr.s * dm.K + gr.slot] = static_cast<int32_t>(dm.snapshot_entry(gr.u, gr.g));
}

// `input` is the input bank of a fresh output bank (the rows of groups from_input are read there), else `bank`;
// `last` the links' table (Links; null without residuals). kCoded: the snapshot has another dtype than the bank's
// (a kernel of its own, so that the bank-dtype one keeps its registers).
template <int VEC, typename T, bool kCoded>
__global__ void __launch_bounds__(kOwnerWarps * 32, kOwnerBlocksPerSM)
    fwd_write_kernel(StepDims dm, StepPhase1 p1, ForwardIO io, const T* input, T* __restrict__ bank, int64_t c,
                     ChunkRows rows, GroupTables tables, int32_t* last) {
  extern __shared__ __align__(16) float staged[];
  const int64_t D = dm.D, s = blockIdx.x, u = unit_of(dm, s, c);
  constexpr int S = segs_for(kWriteLaneBytes, VEC * static_cast<int>(sizeof(T)));
  const int64_t in_s = dm.input_stream(s);
  const auto row_of = [&](const Group& gr) {
    return gr.from_input ? input + (in_s * dm.K + gr.slot) * D : bank + (s * dm.K + gr.slot) * D;
  };
  const float* delta = rows.delta + rows.at(dm, u, s);
  const float* const vecs[1] = {delta};
  const float* pre[1];
  // The group table and the rows this kernel reads were final before the kernel it follows (applying the
  // inverse) started, which waited for the gather, which waited for the previous chunk's write: the table rows and
  // the first group's first batch are loaded before chain_start waits for its predecessor, so those loads overlap
  // its end; delta after.
  // The rows are loaded and stored as last uses (copy_cols' kLastUse; the stores plainly where the coded snapshot
  // reads the row back): the gather read them a kernel earlier, in the token order this kernel takes them.
  // The warp's items are its groups' batches of S segments a lane (a row of D columns is ceil(D / kBatch) of them),
  // in order: the next item's batch (the row's next one, or the next group's first) is loaded before this one's is
  // written, so that a batch is always in flight, whether a row takes one batch or several.
  constexpr int64_t kBatch = S * 32 * VEC;
  OwnedGroups owned(dm, s, u, tables.w, dm.W);
  const int64_t d0 = static_cast<int64_t>(owned.gr.lane) * VEC;
  const bool any = owned.next();
  Group cur = owned.gr;
  int64_t b = 0;  // the item's first column, past d0 (the same for the whole warp)
  Cols<VEC, T> x[S];
  if (any) load_batch<true>(row_of(cur), d0, D, x);
  chain_start();
  stage_token(D, vecs, staged, pre);
  if (!any) return;
  for (;;) {
    const bool row_done = b + kBatch >= D;
    const bool more = !row_done || owned.next();
    const Group next = row_done ? owned.gr : cur;
    const int64_t next_b = row_done ? 0 : b + kBatch;
    Cols<VEC, T> y[S];
    if (more) load_batch<true>(row_of(next), d0 + next_b, D, y);
    write_batch<kCoded, VEC>(dm, p1, io, bank, delta, pre[0], cur, d0 + b, x);
    if (row_done) after_write<kCoded, VEC>(dm, io, bank, cur, last);
    if (!more) break;
    cur = next;
    b = next_b;
#pragma unroll
    for (int k = 0; k < S; ++k) x[k] = y[k];
  }
}

}  // namespace
}  // namespace sdm

#endif  // JAX_SDM_KERNELS_CHUNK_STEPS_FORWARD_CUH_
