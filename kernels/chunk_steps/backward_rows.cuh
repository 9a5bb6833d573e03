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

// Phase A, blocks per (stream, token) whose warps take the write groups the token heads (for_owned_groups): per
// group the dots dcpe, dw and dk_eff on the row before the chunk's write (S0, through the group's link: the
// backward's group tables carry it as the group's `g`) and the gradient row dS0 = cpe dS1 + sum k_eff dG. `input`
// is the forward's input bank; kSnap the snapshot's dtype (a kernel for each: with_s0_source).
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
  for_owned_groups(dm, s, u, tables.w, W, vecs, staged, [&](const Group& gr, const float* const (&pre)[2]) {
    const int lane = gr.lane;
    const int32_t lo = gr.lo, hi = gr.hi, slot = gr.slot;
    const int32_t* order = p1.w_order + u * C * W;
    // dS1 is read at dsrc (the input's row until a fresh result's first write) and stored as a last use (copy_cols'
    // kLastUse; a long group reads the row several times, plainly): GWR gathered the rows a kernel earlier, in the
    // token order Phase A takes them.
    GT* drow = dbank + (s * K + slot) * D;
    const GT* dsrc = fresh_source(gr, dbank_in, dbank, zero_row, (s * K + slot) * D);
    const int64_t e0 = u * C * W + gr.first;
    const float cpe = p1.cpe[e0];
    const float* k_eff = p1.k_eff + u * C * W;
    with_s0_source<VEC, T, kSnap>(io, dm, static_cast<int32_t>(gr.g), in_rows + slot * D, [&](const auto& s0) {
      if (hi - lo > kInlineEntries) {  // long groups (rare): the dots first, then the gradient row
        phase_a_dots<VEC>(dsrc, s0, delta, dG, order, lo, hi, W, D, lane, io, u * C * W, e0);
        for (int64_t d = static_cast<int64_t>(lane) * VEC; d < D; d += 32 * VEC) {
          float acc[VEC];
          load_cols<VEC>(dsrc + d, acc);
#pragma unroll
          for (int i = 0; i < VEC; ++i) acc[i] *= cpe;
          group_add<VEC>(order, lo, hi, k_eff, dG + d, W, D, acc);
          store_cols<VEC, GT, true>(drow + d, acc);
        }
        return;
      }
      // One pass over the row, in batches of segments per lane loaded before the first is used: the dots (as
      // per-lane partial sums over the lane's columns in increasing order, reduced in the fixed xor tree afterwards:
      // warp_dot's order) and the gradient row. The first entry's delta and dG are the block's token's.
      const int32_t n = hi - lo;
      float p_cpe = 0.f, p_w[kInlineEntries] = {}, p_k[kInlineEntries] = {};
      walk_two_sources<VEC>(RowSource<VEC, GT, true>{dsrc}, s0, pre, D, lane,
                            [&](int64_t d, const Cols<VEC, GT>& ds, const auto& sv, const float (&first)[2][VEC]) {
        float acc[VEC];
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          p_cpe += ds[i] * sv[i];
          acc[i] = cpe * ds[i];
        }
#pragma unroll
        for (int j = 0; j < kInlineEntries; ++j) {
          if (j >= n) break;
          const int32_t e = j == 0 ? gr.first : order[lo + j];
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
        store_cols<VEC, GT, true>(drow + d, acc);
      });
      const float dcpe = warp_sum(p_cpe);
      if (lane == 0) io.dcpe[e0] = dcpe;
#pragma unroll
      for (int j = 0; j < kInlineEntries; ++j) {
        if (j >= n) break;
        const float dw = warp_sum(p_w[j]), dk = warp_sum(p_k[j]);
        if (lane == 0) {
          io.dw[u * C * W + order[lo + j]] = dw;
          io.dk_eff[u * C * W + order[lo + j]] = dk;
        }
      }
    });
  });
}

// The read side, after Phase A, blocks per (stream, token) whose warps take the read groups the token heads:
// dq_w = <dy, S0[s]> per entry and the gradient row dS0 += sum q_w dy, S0 through the group's link (the group's
// `g` in the backward's tables) as in Phase A.
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
  for_owned_groups(dm, s, u, tables.r, R, vecs, staged, [&](const Group& gr, const auto& pre) {
    const int lane = gr.lane;
    const int32_t lo = gr.lo, hi = gr.hi, slot = gr.slot;
    const int32_t* order = p1.r_order + u * C * R;
    GT* drow = dbank + (s * K + slot) * D;  // read at dsrc, as in Phase A
    const GT* dsrc = fresh_source(gr, dbank_in, dbank, zero_row, (s * K + slot) * D);
    const float* q_w = p1.q_w + u * C * R;
    with_s0_source<VEC, T, kSnap>(io, dm, static_cast<int32_t>(gr.g), in_rows + slot * D, [&](const auto& row) {
      if (hi - lo > kInlineEntries) {
        for (int32_t k = lo; k < hi; ++k) {
          const int32_t r = order[k];
          const float dq = source_dot<VEC>(row, dy + (r / R) * D, D, lane);
          if (lane == 0) io.dq_w[u * C * R + r] = dq;
        }
        for (int64_t d = static_cast<int64_t>(lane) * VEC; d < D; d += 32 * VEC) {
          float acc[VEC];
          load_cols<VEC>(dsrc + d, acc);
          for (int32_t k = lo; k < hi; ++k) {
            const int32_t r = order[k];
            float x[VEC];
            load_cols<VEC>(dy + (r / R) * D + d, x);
#pragma unroll
            for (int i = 0; i < VEC; ++i) acc[i] += q_w[r] * x[i];
          }
          store_cols<VEC>(drow + d, acc);
        }
        return;
      }
      // One pass over the row in batches of segments per lane (row and gradient row loaded before the first is
      // used): dq_w as per-lane partials (warp_dot's order) and the gradient row += q_w dy, the first entry's dy the
      // block's token's.
      const int32_t n = hi - lo;
      float p_q[kInlineEntries] = {};
      walk_two_sources<VEC>(row, RowSource<VEC, GT>{dsrc}, pre, D, lane,
                            [&](int64_t d, const auto& x, const Cols<VEC, GT>& ds, const float (&first)[1][VEC]) {
        float acc[VEC];
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[i] = ds[i];
#pragma unroll
        for (int j = 0; j < kInlineEntries; ++j) {
          if (j >= n) break;
          const int32_t r = j == 0 ? gr.first : order[lo + j];
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
        store_cols<VEC>(drow + d, acc);
      });
#pragma unroll
      for (int j = 0; j < kInlineEntries; ++j) {
        if (j >= n) break;
        const float dq = warp_sum(p_q[j]);
        if (lane == 0) io.dq_w[u * C * R + order[lo + j]] = dq;
      }
    });
  });
}

}  // namespace
}  // namespace sdm

#endif  // JAX_SDM_KERNELS_CHUNK_STEPS_BACKWARD_ROWS_CUH_
