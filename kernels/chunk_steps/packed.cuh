// The group kernels of the chunk steps with packed sequences (docs/DESIGN.md "Packed sequences"): the forward
// write (docs/MATH.md "The forward chunk step") and the backward's Phase A and read side (docs/MATH.md "Backward of
// a chunk"), each row taken as of its segment's start. The gathers (forward.cuh, backward_rows.cuh) serve packed sequences
// through their row sources (rows.cuh).
//
// Phase 1 ran on virtual slots (slot + K * local), so a group holds the entries of one slot and one segment of the
// chunk, and the unit's group table is sorted by (local, slot). The forward stores only the last segment's groups
// (one per slot: one writer per row); the backward's earlier-segment groups and the read side can meet a row several
// times per chunk (once per segment), so one warp takes all of a slot's groups, in segment order (the CPU loops'
// order).
#ifndef JAX_SDM_KERNELS_CHUNK_STEPS_PACKED_CUH_
#define JAX_SDM_KERNELS_CHUNK_STEPS_PACKED_CUH_

#include "kernels/chunk_steps/backward_rows.cuh"
#include "kernels/chunk_steps/device.cuh"
#include "kernels/chunk_steps/groups.cuh"
#include "kernels/chunk_steps/rows.cuh"
#include "kernels/chunk_steps/snapshot.cuh"

namespace sdm {
namespace {

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
// entry x (sorted order), out[x] = <vecs_x, S0> (S0 a source of walk_two_sources), and target += sum coef[x] vecs_x,
// where vecs_x is the row of D floats of x's token ((x / lanes) * D): dy and q_w for reads, dG and k_eff for writes.
template <int VEC, typename V, typename Src, typename GT>
__device__ __forceinline__ void gathers_gradient(const GroupEntry& e, const int32_t* order, const V* vecs,
                                                 const float* coef, int64_t lanes, int64_t D, int lane, const Src& s0,
                                                 GT* target, float* out) {
  for (int32_t k = e.lo; k < e.hi; ++k) {
    const int32_t x = order[k];
    const float dot = source_dot<VEC>(s0, vecs + (x / lanes) * D, D, lane);
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
// as at its segment's start (the working row if current, else the initial bank's); the snapshot keeps the written
// row and the stamp snapshot the row's stamp before; the row is then stamped seg0 + last, and the slot's latest
// write (`latest`, the links' table: null without residuals) moves to the group's entry.
template <int VEC, typename T>
__global__ void __launch_bounds__(kGroupWarps * 32, kGroupBlocksPerSM)
    fwd_write_packed_kernel(StepDims dm, StepPhase1 p1, ForwardIO io, T* __restrict__ bank, int64_t c,
                            ChunkRows rows, GroupTables tables, SegView<T> sg, int32_t* latest) {
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
  T* snap = snapshot_row<T>(io, dm, u, g);
  const int32_t* order = p1.w_order + u * C * W;
  const float cpe = p1.cpe[u * C * W + gr.first];
  const float* delta = rows.delta + rows.at(dm, u, s);
  for (int64_t d = static_cast<int64_t>(gr.lane) * VEC; d < D; d += 32 * VEC) {
    float acc[VEC];
    load_cols<VEC>(old + d, acc);
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[i] *= cpe;
    group_add<VEC>(order, gr.lo, gr.hi, p1.w + u * C * W, delta + d, W, D, acc);
    store_cols<VEC>(row + d, acc);
    if (snap) snapshot_store_cols<VEC>(snap + d, acc);
  }
  __syncwarp();  // every lane has read the stamp, and the written row is visible to the warp
  snapshot_store_row<VEC>(io, dm, u, g, static_cast<const T*>(row), gr.lane);  // a coded snapshot
  if (gr.lane == 0) {
    if (sg.stamp_snapshot) sg.stamp_snapshot[u * C * W + g] = stamp;
    sg.stamp[s * K + gr.slot] = sg.seg0[u] + last;
    if (latest) latest[s * K + gr.slot] = static_cast<int32_t>(dm.snapshot_entry(u, g));
  }
}

// Phase A with packed sequences, the stored groups (the chunk's last segment; one per slot): restore the stamp,
// take the dots on the row as at the segment's start (S0 through the group's link if current, else the initial
// bank's row), send cpe dS1 + sum k_eff dG to the row's gradient if current, else to the initial bank's (the row's
// gradient is then 0: the write replaced a row it did not read).
template <int VEC, typename T, typename GT>
__global__ void __launch_bounds__(kGroupWarps * 32, kGroupBlocksPerSM)
    bwd_phase_a_packed_kernel(StepDims dm, StepPhase1 p1, BackwardIO io, GT* __restrict__ dbank, int64_t c,
                              BackRows rows, GroupTables tables, SegView<T> sg) {
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
  const int32_t* order = p1.w_order + u * C * W;
  const int64_t e0 = u * C * W + gr.first;
  const float cpe = p1.cpe[e0];
  const float* delta = io.delta + u * C * D;
  const float* dG = rows.dG + s * C * D;
  const int32_t link = current ? io.link_k[e0] : -1;
  with_any_s0_source<VEC>(io, dm, link, sg.initial + at, [&](const auto& s0) {
    phase_a_dots<VEC>(drow, s0, delta, dG, order, gr.lo, gr.hi, W, D, lane, io, u * C * W, e0);
  });
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
  }
  if (lane == 0) sg.stamp[s * K + gr.slot] = stamp;
}

// With packed sequences, the groups that add only their gathers' gradient, after Phase A's stored groups (on the
// restored stamps): kRead false, Phase A's groups of the chunk's earlier segments (not stored): dk_eff
// and sum k_eff dG; kRead true, the read side: dq_w and sum q_w dy. Each goes to the row's gradient if current,
// else to the initial bank's, with the dots on the row as at its segment's start; a slot's groups in segment
// order, by one warp (slot_chain).
template <int VEC, typename T, typename GT, bool kRead>
__global__ void __launch_bounds__(kGroupWarps * 32, kGroupBlocksPerSM)
    bwd_gathers_packed_kernel(StepDims dm, StepPhase1 p1, BackwardIO io, GT* __restrict__ dbank, int64_t c,
                              BackRows rows, GroupTables tables, SegView<T> sg) {
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
    const int32_t link = current ? (kRead ? io.link_q : io.link_k)[u * n + e.first] : -1;
    with_any_s0_source<VEC>(io, dm, link, sg.initial + at, [&](const auto& s0) {
      gathers_gradient<VEC>(e, order, vecs, coef, lanes, D, gr.lane, s0,
                            (current ? dbank : static_cast<GT*>(sg.dinitial)) + at, out);
    });
  });
}


}  // namespace
}  // namespace sdm

#endif  // JAX_SDM_KERNELS_CHUNK_STEPS_PACKED_CUH_
