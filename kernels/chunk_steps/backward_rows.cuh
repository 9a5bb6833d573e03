// The backward's row kernels (docs/MATH.md "Backward of a chunk": GWR, Phase A and the read side), one launch each
// per chunk, in that order: the gather of the written rows' gradients (bwd_gwr_kernel), Phase A on the write
// groups (bwd_phase_a_kernel: the gradient rows and the dots on S0) and the read side (bwd_read_side_kernel). S0,
// a row as it was before the chunk, comes through its group's link from the snapshot or the input bank
// (snapshot.cuh with_s0_source): the backward keeps no bank. With packed sequences Phase A and the read side are
// packed.cuh's.
#ifndef JAX_SDM_KERNELS_CHUNK_STEPS_BACKWARD_ROWS_CUH_
#define JAX_SDM_KERNELS_CHUNK_STEPS_BACKWARD_ROWS_CUH_

#include "kernels/chunk_steps/device.cuh"
#include "kernels/chunk_steps/fresh.cuh"
#include "kernels/chunk_steps/groups.cuh"
#include "kernels/chunk_steps/rows.cuh"
#include "kernels/chunk_steps/snapshot.cuh"

namespace sdm {
namespace {

constexpr int kInlineEntries = 2;   // Phase A handles groups of up to this many entries in one pass over the row

// GWR, gwr_t = sum_n w[t, n] dS1[s_{t,n}], one block per (stream, token); Phase A computes dw. With packed
// sequences (kPacked, `local` the tokens' segments) only the chunk's last segment's writes were stored: the other
// tokens' rows are zero (and their dw stays 0). With a fresh result (kFresh) each lane's gradient row comes from the
// result or the input, by its tag (`w_tag`, lane_tags_kernel).
template <int VEC, typename GT, bool kPacked, bool kFresh>
__global__ void __launch_bounds__(kRowThreadsCap, kRowBlocksPerSM)
    bwd_gwr_kernel(StepDims dm, StepPhase1 p1, const GT* __restrict__ dbank, const GT* dbank_in, const int32_t* w_tag,
                   int64_t c, BackRows rows, const int32_t* local) {
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

// dcpe = <dS1, S0>, dw = <delta_e, dS1>, dk_eff = <dG_e, S0> (entry e's outputs at base + e; S0 a source of
// walk_two_sources).
template <int VEC, typename GT, typename Src>
__device__ __forceinline__ void phase_a_dots(const GT* drow, const Src& s0, const float* delta, const float* dG,
                                             const int32_t* order, int32_t lo, int32_t hi, int64_t W, int64_t D,
                                             int lane, const BackwardIO& io, int64_t base, int64_t e0) {
  const float dcpe = source_dot<VEC>(s0, drow, D, lane);
  if (lane == 0) io.dcpe[e0] = dcpe;
  for (int32_t k = lo; k < hi; ++k) {
    const int32_t e = order[k];
    const float dw = warp_dot<VEC>(delta + (e / W) * D, drow, D, lane);
    const float dk = source_dot<VEC>(s0, dG + (e / W) * D, D, lane);
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

// Phase A's and the read side's ring: a warp's groups as items of a batch of both rows (GroupBatches), each copied
// into a slot of a ring of kTwoRowDepth in shared memory (after the token's staged vectors) kTwoRowDepth - 1 items
// ahead of the one the warp works on, across groups: without it a warp has one batch of its group in flight (a
// D of 2,048 is two batches), and none of its next group until the last batch is used. An item's segments take up
// to kTwoRowRingLaneBytes of both rows a lane, so that with the staged vectors two blocks still fit an SM (at D
// 2,048 and bfloat16 rows, 5 slots of 2 KB a warp: 83 KB a block for the rings). A slot holds the item
// (RingItem, stored by lane 0: the warp that reads it keeps no second walk of the groups in its registers), a coded
// S0's scale, the gradient rows' segments ([kSegs][32] of kGradRaw bytes), then S0's ([kSegs][32] of kS0Raw: the
// input bank's row, the snapshot's in the bank's dtype, or its codes). Where some segment is no whole number of
// cp.async's pieces (copies_async: bfloat16 at VEC 1 or int4 codes at VEC 4 and below) the kernels walk their rows
// where they are (walk_two_sources).
constexpr int kTwoRowDepth = 5;
constexpr int kTwoRowRingLaneBytes = 64;

// An item of the ring as its slot holds it: the group's fields (Group's), the batch's first column past the lane's,
// and what the item is (flags).
struct alignas(16) RingItem {
  enum : uint32_t { kAny = 1, kFromInput = 2, kWhole = 4, kRowDone = 8 };
  int32_t slot, lo, hi, first, link, b;
  uint32_t flags;
  float scale;  // a coded S0's, copied asynchronously
  // The item's group, as the warp of lane `lane` of stream s and unit u takes it.
  __device__ __forceinline__ Group group(int64_t s, int64_t u, int lane) const {
    Group gr;
    gr.s = s;
    gr.u = u;
    gr.g = link;
    gr.lane = lane;
    gr.lo = lo;
    gr.hi = hi;
    gr.slot = slot;
    gr.first = first;
    gr.from_input = (flags & kFromInput) != 0;
    return gr;
  }
};

template <int VEC, typename T, typename GT, SnapshotDtype kSnap>
struct TwoRowRing {
  using Grad = RowSource<VEC, GT>;
  using Input = RowSource<VEC, T>;
  using Snap = typename SnapshotSourceOf<VEC, T, kSnap>::type;
  static constexpr int kGradRaw = Grad::kRaw;
  static constexpr int kS0Raw = Input::kRaw > Snap::kRaw ? Input::kRaw : Snap::kRaw;
  static constexpr bool kOn = copies_async(kGradRaw) && copies_async(Input::kRaw) && copies_async(Snap::kRaw);
  static constexpr int kSegs = segs_for(kTwoRowRingLaneBytes, kGradRaw + kS0Raw);
  static constexpr int64_t kBatch = kSegs * 32 * VEC;
  static constexpr int kGradAt = static_cast<int>(sizeof(RingItem));  // the gradient rows' segments in a slot
  static constexpr int kS0At = kGradAt + kSegs * 32 * kGradRaw;        // S0's
  static constexpr int kSlotBytes = kS0At + kSegs * 32 * kS0Raw;
  static_assert(kSlotBytes % 16 == 0, "slots stay 16-byte aligned");
  // The dynamic shared memory a block's rings take.
  static constexpr size_t bytes() { return kOn ? static_cast<size_t>(kOwnerWarps) * kTwoRowDepth * kSlotBytes : 0; }
};

// The group loop of Phase A and the read side with their ring (TwoRowRing::kOn): for each group the warp takes,
// start(group) before its first batch, segment(group, d, gradient columns, S0 columns, vector columns) for every
// segment of the lane in increasing column order d (the order of walk_two_sources, and so the same sums), and
// finish(group) after its last; a group of more than kInlineEntries entries instead goes to whole(group, S0 source)
// with its rows where they are. grad_row(group) is where the group's gradient row is read; S0 through the group's
// link (with_s0_source). The token's vectors `vecs` are staged as for_owned_groups stages them.
template <int VEC, typename T, typename GT, SnapshotDtype kSnap, int NV, typename V, typename GradRow,
          typename Start, typename Segment, typename Finish, typename Whole>
__device__ __forceinline__ void two_row_ring(const BackwardIO& io, const StepDims& dm, int64_t s, int64_t u,
                                             const GroupEntry* table, int64_t lanes, const V* const (&vecs)[NV],
                                             float* staged, const T* in_rows, GradRow grad_row, Start start,
                                             Segment segment, Finish finish, Whole whole) {
  using R = TwoRowRing<VEC, T, GT, kSnap>;
  const int64_t D = dm.D;
  GroupBatches<R::kBatch> ahead(dm, s, u, table, lanes, kInlineEntries);  // the next item to copy
  const int lane = ahead.group().lane;
  const int64_t d0 = static_cast<int64_t>(lane) * VEC;
  uint8_t* ring = reinterpret_cast<uint8_t*>(staged + owner_staged_floats(NV, D)) +
                  static_cast<int64_t>(threadIdx.x / 32) * kTwoRowDepth * R::kSlotBytes;
  int issued = 0;
  // Copies the item `ahead` into its slot (a lane its own segments; lane 0 the item and the scale), then moves
  // `ahead` on; every call commits one group of copies, empty for a whole group and past the last item (whose
  // RingItem says so).
  const auto issue = [&]() {
    uint8_t* slot = ring + (issued % kTwoRowDepth) * R::kSlotBytes;
    RingItem* item = reinterpret_cast<RingItem*>(slot);
    const Group& g = ahead.group();
    const int32_t link = static_cast<int32_t>(g.g);
    if (lane == 0) {
      const uint32_t flags = !ahead.any ? 0u
                             : RingItem::kAny | (g.from_input ? RingItem::kFromInput : 0u) |
                                   (ahead.whole() ? RingItem::kWhole : 0u) |
                                   (ahead.row_done(D) ? RingItem::kRowDone : 0u);
      // Field by field: `scale` is the asynchronous copy's alone (a store to it could land after the copy).
      item->slot = g.slot;
      item->lo = g.lo;
      item->hi = g.hi;
      item->first = g.first;
      item->link = link;
      item->b = static_cast<int32_t>(ahead.b);
      item->flags = flags;
    }
    if (ahead.any) {
      if (!ahead.whole()) {
        const GT* grow = grad_row(g);
        with_s0_source<VEC, T, kSnap>(io, dm, link, in_rows + g.slot * D, [&](const auto& s0) {
          constexpr int kRaw = std::decay_t<decltype(s0)>::kRaw;
#pragma unroll
          for (int k = 0; k < R::kSegs; ++k) {
            const int64_t d = d0 + ahead.b + k * 32 * VEC;
            if (d >= D) break;
            copy_bytes_async<R::kGradRaw>(slot + R::kGradAt + (k * 32 + lane) * R::kGradRaw, grow + d);
            copy_bytes_async<kRaw>(slot + R::kS0At + (k * 32 + lane) * R::kS0Raw, s0.raw(d));
          }
        });
        if constexpr (snapshot_scaled(kSnap))
          if (link >= 0 && lane == 0) copy_bytes_async<4>(&item->scale, io.snapshot_scale + link);
      }
      ahead.next(D);
    }
    __pipeline_commit();
    ++issued;
  };
#pragma unroll
  for (int k = 0; k < kTwoRowDepth - 1; ++k) issue();
  with_staged_vectors(dm, vecs, staged, [&](const auto& pre) {  // its wait covers the items issued so far
    for (int n = 0;; ++n) {
      __syncwarp();  // the warp is done with the slot that issue() refills (item n - 1's)
      issue();       // item n + kTwoRowDepth - 1
      __pipeline_wait_prior(kTwoRowDepth - 1);
      __syncwarp();  // item n's RingItem and scale (lane 0's), visible to the warp
      const uint8_t* slot = ring + (n % kTwoRowDepth) * R::kSlotBytes;
      const RingItem it = *reinterpret_cast<const RingItem*>(slot);
      if (!(it.flags & RingItem::kAny)) break;
      const Group gr = it.group(s, u, lane);
      if (it.flags & RingItem::kWhole) {
        with_s0_source<VEC, T, kSnap>(io, dm, it.link, in_rows + gr.slot * D, [&](const auto& s0) { whole(gr, s0); });
        continue;
      }
      if (it.b == 0) start(gr);
      with_ring_s0_source<VEC, T, kSnap>(it.link, it.scale, [&](const auto& s0) {
        // A segment at a time: its operands come from shared memory, and unrolled, the loads of every segment's
        // (the staged vectors' included) are hoisted and Phase A spills.
#pragma unroll 1
        for (int k = 0; k < R::kSegs; ++k) {
          const int64_t d = d0 + it.b + k * 32 * VEC;
          if (d >= D) break;
          typename R::Grad::ColsT ds;
          typename std::decay_t<decltype(s0)>::ColsT sv;
          typename R::Grad{nullptr}.load_raw(slot + R::kGradAt + (k * 32 + lane) * R::kGradRaw, ds);
          s0.load_raw(slot + R::kS0At + (k * 32 + lane) * R::kS0Raw, sv);
          float p[NV][VEC];
#pragma unroll
          for (int i = 0; i < NV; ++i) load_cols<VEC>(pre[i] + d, p[i]);
          segment(gr, d, ds, sv, p);
        }
      });
      if (it.flags & RingItem::kRowDone) finish(gr);
    }
  });
}

// The group loop of Phase A and the read side (two_row_ring's arguments): through the ring where TwoRowRing::kOn,
// else a group at a time (for_owned_groups: a batch of a group's rows in flight, walk_two_sources), the rows of a
// warp's next group asked into L2 when it starts a group (prefetch_l2_row), so that they come from L2 then.
template <int VEC, typename T, typename GT, SnapshotDtype kSnap, int NV, typename V, typename GradRow,
          typename Start, typename Segment, typename Finish, typename Whole>
__device__ __forceinline__ void for_two_row_groups(const BackwardIO& io, const StepDims& dm, int64_t s, int64_t u,
                                                   const GroupEntry* table, int64_t lanes,
                                                   const V* const (&vecs)[NV], float* staged, const T* in_rows,
                                                   GradRow grad_row, Start start, Segment segment, Finish finish,
                                                   Whole whole) {
  const int64_t D = dm.D;
  if constexpr (TwoRowRing<VEC, T, GT, kSnap>::kOn) {
    two_row_ring<VEC, T, GT, kSnap>(io, dm, s, u, table, lanes, vecs, staged, in_rows, grad_row, start, segment,
                                    finish, whole);
  } else {
    const auto ahead = [&](const Group& next) {
      prefetch_l2_row(grad_row(next), D * static_cast<int64_t>(sizeof(GT)), next.lane);
      prefetch_s0<T, kSnap>(io, dm, static_cast<int32_t>(next.g), in_rows + next.slot * D, next.lane);
    };
    for_owned_groups(dm, s, u, table, lanes, vecs, staged, ahead, [&](const Group& gr, const auto& pre) {
      with_s0_source<VEC, T, kSnap>(io, dm, static_cast<int32_t>(gr.g), in_rows + gr.slot * D, [&](const auto& s0) {
        if (gr.hi - gr.lo > kInlineEntries) return whole(gr, s0);
        start(gr);
        walk_two_sources<VEC>(RowSource<VEC, GT>{grad_row(gr)}, s0, pre, D, gr.lane,
                              [&](int64_t d, const Cols<VEC, GT>& ds, const auto& sv, const auto& first) {
                                segment(gr, d, ds, sv, first);
                              });
        finish(gr);
      });
    });
  }
}

// Phase A, one block per (stream, token) whose warps take the write groups the token heads: per group the dots
// dcpe, dw and dk_eff on the row before the chunk's write (S0, through the group's link: the backward's group tables
// carry it as the group's `g`) and the gradient row dS0 = cpe dS1 + sum k_eff dG. `input` is the forward's input
// bank; kSnap the snapshot's dtype (a kernel for each: with_s0_source). Its rows come through the ring
// (two_row_ring) where TwoRowRing::kOn, else a group at a time (for_owned_groups, walk_two_sources).
template <int VEC, typename T, typename GT, SnapshotDtype kSnap>
__global__ void __launch_bounds__(kOwnerWarps * 32, kOwnerBlocksPerSM)
    bwd_phase_a_kernel(StepDims dm, StepPhase1 p1, BackwardIO io, const T* __restrict__ input,
                       GT* __restrict__ dbank, const GT* dbank_in, const GT* zero_row, int64_t c, BackRows rows,
                       GroupTables tables) {
  chain_start();
  extern __shared__ __align__(16) float staged[];
  const int64_t C = dm.C, W = dm.W, D = dm.D, K = dm.K, s = blockIdx.x, u = unit_of(dm, s, c);
  const float* delta = io.delta + u * C * D;
  const float* dG = rows.dG + s * C * D;
  const float* const vecs[2] = {delta, dG};
  const T* in_rows = input + dm.input_stream(s) * K * D;
  const int32_t* order = p1.w_order + u * C * W;
  const float* k_eff = p1.k_eff + u * C * W;
  // dS1 is read where fresh_source has it (the input's row until a fresh result's first write), dS0 stored at drow.
  const auto grad_row = [&](const Group& gr) { return fresh_source(gr, dbank_in, dbank, zero_row, (s * K + gr.slot) * D); };
  const auto drow = [&](const Group& gr) { return dbank + (s * K + gr.slot) * D; };
  // A long group (rare): the dots first, then the gradient row.
  const auto whole = [&](const Group& gr, const auto& s0) {
    const GT* dsrc = grad_row(gr);
    const int64_t e0 = u * C * W + gr.first;
    const float cpe = p1.cpe[e0];
    phase_a_dots<VEC>(dsrc, s0, delta, dG, order, gr.lo, gr.hi, W, D, gr.lane, io, u * C * W, e0);
    for (int64_t d = static_cast<int64_t>(gr.lane) * VEC; d < D; d += 32 * VEC) {
      float acc[VEC];
      load_cols<VEC>(dsrc + d, acc);
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc[i] *= cpe;
      group_add<VEC>(order, gr.lo, gr.hi, k_eff, dG + d, W, D, acc);
      store_cols<VEC>(drow(gr) + d, acc);
    }
  };
  // Other groups in one pass over the row, a segment at a time in increasing column order: the dots (as per-lane
  // partial sums, reduced in the fixed xor tree afterwards: warp_dot's order) and the gradient row. The first
  // entry's delta and dG are the block's token's (`first`).
  float cpe, p_cpe, p_w[kInlineEntries], p_k[kInlineEntries];
  const auto start = [&](const Group& gr) {
    cpe = p1.cpe[u * C * W + gr.first];
    p_cpe = 0.f;
#pragma unroll
    for (int j = 0; j < kInlineEntries; ++j) p_w[j] = p_k[j] = 0.f;
  };
  const auto segment = [&](const Group& gr, int64_t d, const Cols<VEC, GT>& ds, const auto& sv,
                           const float (&first)[2][VEC]) {
    const int32_t n = gr.hi - gr.lo;
    float acc[VEC];
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      p_cpe += ds[i] * sv[i];
      acc[i] = cpe * ds[i];
    }
#pragma unroll
    for (int j = 0; j < kInlineEntries; ++j) {
      if (j >= n) break;
      const int32_t e = j == 0 ? gr.first : order[gr.lo + j];
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
    store_cols<VEC>(drow(gr) + d, acc);
  };
  const auto finish = [&](const Group& gr) {
    const float dcpe = warp_sum(p_cpe);
    if (gr.lane == 0) io.dcpe[u * C * W + gr.first] = dcpe;
#pragma unroll
    for (int j = 0; j < kInlineEntries; ++j) {
      if (j >= gr.hi - gr.lo) break;
      const float dw = warp_sum(p_w[j]), dk = warp_sum(p_k[j]);
      if (gr.lane == 0) {
        io.dw[u * C * W + order[gr.lo + j]] = dw;
        io.dk_eff[u * C * W + order[gr.lo + j]] = dk;
      }
    }
  };
  for_two_row_groups<VEC, T, GT, kSnap>(io, dm, s, u, tables.w, W, vecs, staged, in_rows, grad_row, start, segment,
                                        finish, whole);
}

// The read side, after Phase A, one block per (stream, token) whose warps take the read groups the token heads:
// dq_w = <dy, S0[s]> per entry and the gradient row dS0 += sum q_w dy, S0 through the group's link (the group's
// `g` in the backward's tables) as in Phase A, and its rows through the ring where TwoRowRing::kOn as there.
template <int VEC, typename T, typename GT, SnapshotDtype kSnap>
__global__ void __launch_bounds__(kOwnerWarps * 32, kOwnerBlocksPerSM)
    bwd_read_side_kernel(StepDims dm, StepPhase1 p1, BackwardIO io, const T* __restrict__ input,
                         GT* __restrict__ dbank, const GT* dbank_in, const GT* zero_row, int64_t c,
                         GroupTables tables) {
  chain_start();
  extern __shared__ __align__(16) float staged[];
  const int64_t C = dm.C, R = dm.R, D = dm.D, K = dm.K, s = blockIdx.x, u = unit_of(dm, s, c);
  const T* dy = static_cast<const T*>(io.dy) + u * C * D;
  const T* const vecs[1] = {dy};
  const T* in_rows = input + dm.input_stream(s) * K * D;
  const int32_t* order = p1.r_order + u * C * R;
  const float* q_w = p1.q_w + u * C * R;
  const auto grad_row = [&](const Group& gr) { return fresh_source(gr, dbank_in, dbank, zero_row, (s * K + gr.slot) * D); };
  const auto drow = [&](const Group& gr) { return dbank + (s * K + gr.slot) * D; };
  const auto whole = [&](const Group& gr, const auto& row) {
    for (int32_t k = gr.lo; k < gr.hi; ++k) {
      const int32_t r = order[k];
      const float dq = source_dot<VEC>(row, dy + (r / R) * D, D, gr.lane);
      if (gr.lane == 0) io.dq_w[u * C * R + r] = dq;
    }
    const GT* dsrc = grad_row(gr);
    for (int64_t d = static_cast<int64_t>(gr.lane) * VEC; d < D; d += 32 * VEC) {
      float acc[VEC];
      load_cols<VEC>(dsrc + d, acc);
      for (int32_t k = gr.lo; k < gr.hi; ++k) {
        const int32_t r = order[k];
        float x[VEC];
        load_cols<VEC>(dy + (r / R) * D + d, x);
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[i] += q_w[r] * x[i];
      }
      store_cols<VEC>(drow(gr) + d, acc);
    }
  };
  // Other groups in one pass over the row, a segment at a time: dq_w as per-lane partials (warp_dot's order) and
  // the gradient row += q_w dy, the first entry's dy the block's token's (`first`).
  float p_q[kInlineEntries];
  const auto start = [&](const Group&) {
#pragma unroll
    for (int j = 0; j < kInlineEntries; ++j) p_q[j] = 0.f;
  };
  const auto segment = [&](const Group& gr, int64_t d, const Cols<VEC, GT>& ds, const auto& x,
                           const float (&first)[1][VEC]) {
    const int32_t n = gr.hi - gr.lo;
    float acc[VEC];
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[i] = ds[i];
#pragma unroll
    for (int j = 0; j < kInlineEntries; ++j) {
      if (j >= n) break;
      const int32_t r = j == 0 ? gr.first : order[gr.lo + j];
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
    store_cols<VEC>(drow(gr) + d, acc);
  };
  const auto finish = [&](const Group& gr) {
#pragma unroll
    for (int j = 0; j < kInlineEntries; ++j) {
      if (j >= gr.hi - gr.lo) break;
      const float dq = warp_sum(p_q[j]);
      if (gr.lane == 0) io.dq_w[u * C * R + order[gr.lo + j]] = dq;
    }
  };
  for_two_row_groups<VEC, T, GT, kSnap>(io, dm, s, u, tables.r, R, vecs, staged, in_rows, grad_row, start, segment,
                                        finish, whole);
}

}  // namespace
}  // namespace sdm

#endif  // JAX_SDM_KERNELS_CHUNK_STEPS_BACKWARD_ROWS_CUH_
