// The backward's dense kernels (docs/MATH.md "Backward of a chunk": the readings, the inverse's adjoint and the
// dots): in the loop, per batch of chunks, the dy part of the adjoint before the batch's first chunk (bwd_dy_kernel:
// du = Minv^T QK^T dy); per chunk its bank-dependent part (bwd_apply_inverse_kernel: du += Minv^T gwr, dG = -beta
// du); after the batch's last chunk dA, dQK, dbeta's shares and dv = beta du (bwd_dots_kernel); after the loop dbeta
// (bwd_dbeta_kernel). du lives in a ring of a batch's chunks (BackRows), not in an array of every chunk (the
// training step's largest after the snapshot and the residuals).
#ifndef JAX_SDM_KERNELS_CHUNK_STEPS_BACKWARD_DENSE_CUH_
#define JAX_SDM_KERNELS_CHUNK_STEPS_BACKWARD_DENSE_CUH_

#include "kernels/chunk_steps/dense.cuh"
#include "kernels/chunk_steps/device.cuh"
#include "kernels/chunk_steps/rows.cuh"

namespace sdm {
namespace {

// A block of a launch over the batch of chunks from c0 (blockIdx.x = k * streams + s: chunk c0 + k, stream s): its
// unit and its chunk's du in the ring (BackRows::du, [chunks, streams, C, D] in the same order).
struct BatchBlock {
  int64_t u;
  float* du;
};
__device__ __forceinline__ BatchBlock batch_block(const StepDims& dm, int64_t c0, const BackRows& rows) {
  const int64_t streams = dm.V * dm.P;
  return {unit_of(dm, blockIdx.x % streams, c0 + blockIdx.x / streams),
          rows.du + static_cast<int64_t>(blockIdx.x) * dm.C * dm.D};
}

// du = Minv^T (QK^T dy), the part of the adjoint that does not depend on the bank, for the batch of chunks from c0
// into its ring (BackRows::du); one block per (chunk of the batch, stream, column slice). Shared memory: the dy and
// QK^T dy slices; staged, QK and Minv. The previous batch's dots kernel, which read the ring, has completed at
// chain_start.
template <typename T, bool kStaged>
__global__ void bwd_dy_kernel(StepDims dm, StepPhase1 p1, BackwardIO io, int64_t c0, BackRows rows) {
  chain_start();
  constexpr int kRows = kWideTileRows;
  extern __shared__ __align__(16) float sh[];
  const int C = static_cast<int>(dm.C), slice = tile_rows(C) * kSlice, ms = kStaged ? matrix_stride(C) : C;
  const int64_t D = dm.D, d0 = static_cast<int64_t>(blockIdx.y) * kSlice;
  const BatchBlock bb = batch_block(dm, c0, rows);
  const int64_t u = bb.u;
  float* du = bb.du;
  float* sdy = sh;
  float* sdd = sdy + slice;
  float* sqk = sdd + slice;
  float* smi = sqk + tile_rows(C) * ms;
  const float* QK = p1.QK + u * C * C;
  const float* minv = p1.minv + u * C * C;
  const T* dy = static_cast<const T*>(io.dy) + u * C * D;
  if constexpr (kStaged) {
    stage_matrix_async(QK, C, sqk);
    stage_matrix_async(minv, C, smi);
    stage_slice(dy, C, D, d0, sdy);  // while the matrices' copies fly
    staged_wait();
  } else {
    prefetch_matrix(QK, C);
    prefetch_matrix(minv, C);
    stage_quads(C, sdy, [&](int t, int q) { return load_quad(dy + t * D, d0 + 4 * q, D); });
    __syncthreads();
  }
  for_tiles<kRows>(C, [&](int r0, int q) {
    float4 x[kRows];
    tri_tile<true, kStaged, kRows>(kStaged ? sqk : QK, ms, sdy, r0, q, C, x);
#pragma unroll
    for (int j = 0; j < kRows; ++j)
      if (r0 + j < C) reinterpret_cast<float4*>(sdd + (r0 + j) * kSlice)[q] = x[j];
  });
  __syncthreads();
  for_tiles<kRows>(C, [&](int r0, int q) {
    float4 x[kRows];
    tri_tile<true, kStaged, kRows>(kStaged ? smi : minv, ms, sdd, r0, q, C, x);
#pragma unroll
    for (int j = 0; j < kRows; ++j)
      if (r0 + j < C) store_quad(du + (r0 + j) * D, d0 + 4 * q, D, x[j]);
  });
}

// Chunk c: du += Minv^T gwr (the bank-dependent part of the inverse's adjoint), dG = -beta du; `rows.du` the
// chunk's place in the ring. Shared memory: the gwr slice; staged, also the du slice and Minv. With kRows =
// kMmaRows (staged) the product on tensor cores (mma_tri_product), each warp adding its tiles into the staged du.
template <bool kStaged, int kRows>
__global__ void bwd_apply_inverse_kernel(StepDims dm, StepPhase1 p1, BackwardIO io, int64_t c, BackRows rows) {
  constexpr bool kMma = kRows == kMmaRows;
  static_assert(!kMma || kStaged, "the tensor-core products read staged operands");
  constexpr int ss = slice_stride(kRows);
  extern __shared__ __align__(16) float sh[];
  const int C = static_cast<int>(dm.C), slice = tile_rows(C) * ss, ms = kStaged ? matrix_stride(C) : C;
  const int64_t D = dm.D;
  const int64_t s = blockIdx.x, d0 = static_cast<int64_t>(blockIdx.y) * kSlice;
  const int64_t u = unit_of(dm, s, c);
  float* sg = sh;
  float* sdu = sg + slice;
  float* smi = sdu + slice;
  const float* minv = p1.minv + u * C * C;
  const float* gwr = rows.gwr + s * C * D;
  float* du = rows.du + s * C * D;
  if constexpr (kStaged) {
    // Minv and du (the dy part's, at least two launches before; only this kernel adds to it) are final before the
    // previous kernel: staged before chain_start waits for the GWR gather, as in fwd_apply_inverse_kernel; gwr after.
    stage_matrix_async<kMma>(minv, C, smi);
    stage_slice_async(du, C, D, d0, sdu, ss);
    chain_start();
    stage_slice_async(gwr, C, D, d0, sg, ss);
    staged_wait();
  } else {
    chain_start();
    prefetch_matrix(minv, C);
    prefetch_slice(du, C, D, d0);
    stage_quads(C, sg, [&](int t, int q) { return load_quad(gwr + t * D, d0 + 4 * q, D); });
    __syncthreads();
  }
  // du's new row r (columns d..d + 3) and dG = -beta du.
  const auto store = [&](int r, int64_t d, float4 y) {
    const float beta = io.beta[u * C + r];
    store_quad(du + r * D, d, D, y);
    store_quad(rows.dG + (s * C + r) * D, d, D, make_float4(-beta * y.x, -beta * y.y, -beta * y.z, -beta * y.w));
  };
  if constexpr (kMma) {
    mma_tri_product<true>(smi, ms, sg, C,
                          [&](int mi, int ni, const float(&acc)[4]) { store_mma_tile<true>(sdu, mi, ni, acc); });
    __syncthreads();
    for (int idx = threadIdx.x; idx < C * kQuads; idx += blockDim.x) {
      const int t = idx / kQuads, q = idx % kQuads;
      store(t, d0 + 4 * q, *reinterpret_cast<const float4*>(sdu + t * ss + 4 * q));
    }
  } else {
    for_tiles<kRows>(C, [&](int r0, int q) {
      float4 x[kRows];
      tri_tile<true, kStaged, kRows>(kStaged ? smi : minv, ms, sg, r0, q, C, x);
      const int64_t d = d0 + 4 * q;
#pragma unroll
      for (int j = 0; j < kRows; ++j) {
        const int r = r0 + j;
        if (r >= C) break;
        const float4 old =
            kStaged ? reinterpret_cast<const float4*>(sdu + r * kSlice)[q] : load_quad(du + r * D, d, D);
        store(r, d, make_float4(old.x + x[j].x, old.y + x[j].y, old.z + x[j].z, old.w + x[j].w));
      }
    });
  }
}

// After the adjoints of the batch of chunks from c0, one block per (chunk of the batch, stream, pair of tiles
// (i0, j0), j0 <= i0, of kDotsTile token rows: blockIdx.y, dots_pair): with a_ij = <du_i, delta_j> and
// q_ij = <dy_i, delta_j>,
//   dA[i, j] = -beta_i a_ij (j < i),  dQK[i, j] = q_ij (j <= i),  0 elsewhere,
//   dbeta_i = <du_i, v_i - G_i> - sum_{j < i} A[i, j] a_ij   (= <du_i, v_i - G_i - (A delta)_i>),
// and dv_i = beta_i du_i (in the bank's dtype, v's). A block per pair of tiles, not per row of tiles, and two teams
// of 256 threads a block splitting the columns: a batch's launch is a quarter of the chunks, and its blocks must still
// fill the GPU with short ones (a block per row of tiles left most SMs idle behind the diagonal rows' two tiles).
// Team k sums the 32-column steps d0 = (2 m + k) kDotsCols; the steps' rows are staged in shared memory transposed
// ([column][row]) and thread (ti, tj) of a team computes the 4 x 4 cells (i0 + 4 ti + r, j0 + 4 tj + c): per column
// three 16-byte loads (4 du, 4 dy, 4 delta) feed 32 products. Each cell is team 0's sum plus team 1's, each over d
// ascending. On the diagonal pair (j0 = i0) each thread also writes dv = beta du of the du element it stages and adds
// its columns' share of <du_i, v_i - G_i>. A pair's share of dbeta_i goes to dbeta_parts ([units, dots_tiles, C], by
// j0's tile): bwd_dbeta_kernel adds a row's shares after the loop. Every sum runs in a fixed order.
constexpr int kDotsCols = 32;                              // columns staged per step
constexpr int kDotsSide = kDotsTile / 4;                   // threads per tile side: 16
constexpr int kDotsTeamThreads = kDotsSide * kDotsSide;    // 256
constexpr int kDotsTeams = 2;
constexpr int kDotsThreads = kDotsTeams * kDotsTeamThreads;
constexpr int kDotsStride = kDotsTile + 4;                 // floats per staged column: 16-byte rows, no bank conflicts
constexpr int kDotsStaged = kDotsTile * kDotsCols / kDotsTeamThreads;  // elements each thread stages per array: 8

// A team's staged columns; after the sums, team 1's cells pass to team 0 through its staging (kDotsExchange floats).
struct DotsStage {
  float du[kDotsCols][kDotsStride], dy[kDotsCols][kDotsStride], delta[kDotsCols][kDotsStride];
  float vg[kDotsCols][kDotsStride];  // v - G on the diagonal pair
};
constexpr int kDotsExchange = 2 * 16 * kDotsTeamThreads;  // a and q, 4 x 4 cells a thread
static_assert(kDotsExchange * sizeof(float) <= sizeof(DotsStage), "team 1's cells pass through its staging");
struct DotsShared {
  DotsStage team[kDotsTeams];
  float red[kDotsTile][kDotsTeams * kDotsSide + 1];  // dbeta's shares by (row, team and tj)
};

// Pair y of a row of tiles' pairs (0, 0), (1, 0), (1, 1), (2, 0), ...: tile rows i0 / kDotsTile and j0 / kDotsTile.
__device__ __forceinline__ void dots_pair(int y, int& it, int& jt) {
  it = 0;
  while ((it + 1) * (it + 2) / 2 <= y) ++it;
  jt = y - it * (it + 1) / 2;
}

template <typename T>  // dy's and dv's dtype, the bank's
__global__ void __launch_bounds__(kDotsThreads, 1)
    bwd_dots_kernel(StepDims dm, StepPhase1 p1, BackwardIO io, int64_t c0, BackRows rows) {
  chain_start();
  const T* dy = static_cast<const T*>(io.dy);
  T* dv = static_cast<T*>(io.dv);
  extern __shared__ __align__(16) float dots_sh[];
  DotsShared& sh = *reinterpret_cast<DotsShared*>(dots_sh);
  const int64_t C = dm.C, D = dm.D;
  const BatchBlock bb = batch_block(dm, c0, rows);
  int it, jt;
  dots_pair(static_cast<int>(blockIdx.y), it, jt);
  const int64_t u = bb.u, i0 = static_cast<int64_t>(it) * kDotsTile, j0 = static_cast<int64_t>(jt) * kDotsTile;
  const bool diag = it == jt;
  const int team = threadIdx.x / kDotsTeamThreads, t = threadIdx.x % kDotsTeamThreads;
  const int ti = t / kDotsSide, tj = t % kDotsSide;
  DotsStage& st = sh.team[team];
  const int64_t base = u * C * D;
  const float* du_rows = bb.du;
  float part[4] = {};  // this thread's shares of dbeta_i, rows i0 + 4 ti + r
  float a[4][4] = {}, q[4][4] = {};
  for (int64_t m0 = 0; m0 < D; m0 += kDotsTeams * kDotsCols) {  // both teams take every step's barriers
    const int64_t d0 = m0 + team * kDotsCols;
    // A warp stages 4 rows x 8 columns per round: 32 bytes of each row from global memory, and its transposed
    // stores (row + 68 column) fall in 32 distinct banks. Columns past D stage zeros.
#pragma unroll 4
    for (int n = 0; n < kDotsStaged; ++n) {
      const int w = n * (kDotsTeamThreads / 32) + t / 32, lane = t % 32;
      const int r = 4 * (w % kDotsSide) + lane % 4, dd = 8 * (w / kDotsSide) + lane / 4;
      const int64_t d = d0 + dd;
      const bool in_i = i0 + r < C && d < D, in_j = j0 + r < C && d < D;
      const int64_t ki = base + (i0 + r) * D + d, kj = base + (j0 + r) * D + d;
      const float du = in_i ? du_rows[(i0 + r) * D + d] : 0.f;
      st.du[dd][r] = du;
      st.dy[dd][r] = in_i ? to_f(dy[ki]) : 0.f;
      st.delta[dd][r] = in_j ? io.delta[kj] : 0.f;
      if (diag) {
        st.vg[dd][r] = in_i ? io.vg[ki] : 0.f;
        if (in_i) from_f(dv + ki, io.beta[u * C + i0 + r] * du);
      }
    }
    __syncthreads();
    if (d0 < D) {
#pragma unroll 4
      for (int dd = 0; dd < kDotsCols; ++dd) {
        const float4 x4 = *reinterpret_cast<const float4*>(&st.du[dd][4 * ti]);
        const float4 z4 = *reinterpret_cast<const float4*>(&st.dy[dd][4 * ti]);
        const float4 l4 = *reinterpret_cast<const float4*>(&st.delta[dd][4 * tj]);
        const float x[4] = {x4.x, x4.y, x4.z, x4.w}, z[4] = {z4.x, z4.y, z4.z, z4.w},
                    l[4] = {l4.x, l4.y, l4.z, l4.w};
#pragma unroll
        for (int r = 0; r < 4; ++r) {
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            a[r][c] += x[r] * l[c];
            q[r][c] += z[r] * l[c];
          }
        }
      }
      if (diag) {
        for (int dd = tj; dd < kDotsCols; dd += kDotsSide) {
#pragma unroll
          for (int r = 0; r < 4; ++r) part[r] += st.du[dd][4 * ti + r] * st.vg[dd][4 * ti + r];
        }
      }
    }
    __syncthreads();
  }
  // Team 1's cells to team 0 (after the last barrier nobody reads the staging).
  float* exchange = &sh.team[1].du[0][0];
  if (team == 1) {
#pragma unroll
    for (int k = 0; k < 16; ++k) {
      exchange[k * kDotsTeamThreads + t] = a[k / 4][k % 4];
      exchange[(16 + k) * kDotsTeamThreads + t] = q[k / 4][k % 4];
    }
  }
  __syncthreads();
  if (team == 0) {
#pragma unroll
    for (int k = 0; k < 16; ++k) {
      a[k / 4][k % 4] += exchange[k * kDotsTeamThreads + t];
      q[k / 4][k % 4] += exchange[(16 + k) * kDotsTeamThreads + t];
    }
    const int64_t jc = j0 + 4 * tj;  // this thread's first column
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int64_t i = i0 + 4 * ti + r;
      if (i >= C) break;
      const float beta_i = io.beta[u * C + i];
      const float* A = p1.A + (u * C + i) * C;
      float da[4], dq[4];
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int64_t j = jc + c;
        da[c] = j < i ? -beta_i * a[r][c] : 0.f;
        dq[c] = j <= i ? q[r][c] : 0.f;
        if (j < i) part[r] -= A[j] * a[r][c];
      }
      float* dA_row = io.dA + (u * C + i) * C;
      float* dQK_row = io.dQK + (u * C + i) * C;
      if (C % 4 == 0 && jc + 3 < C) {  // 16-byte aligned: C and jc are multiples of 4
        *reinterpret_cast<float4*>(dA_row + jc) = make_float4(da[0], da[1], da[2], da[3]);
        *reinterpret_cast<float4*>(dQK_row + jc) = make_float4(dq[0], dq[1], dq[2], dq[3]);
      } else {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          if (jc + c >= C) break;
          dA_row[jc + c] = da[c];
          dQK_row[jc + c] = dq[c];
        }
      }
      if (diag) {  // the tiles past the diagonal: every cell masked
        for (int64_t j = i0 + kDotsTile + tj; j < C; j += kDotsSide) {
          dA_row[j] = 0.f;
          dQK_row[j] = 0.f;
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < 4; ++r) sh.red[4 * ti + r][team * kDotsSide + tj] = part[r];
  __syncthreads();
  if (threadIdx.x < kDotsTile && i0 + threadIdx.x < C) {
    float x = sh.red[threadIdx.x][0];
    for (int k = 1; k < kDotsTeams * kDotsSide; ++k) x += sh.red[threadIdx.x][k];
    rows.dbeta_parts[(u * dots_tiles(dm) + jt) * C + i0 + threadIdx.x] = x;
  }
}

// After the loop: dbeta_i, the shares of row i's pairs of tiles (bwd_dots_kernel) added in j0's order. A thread per
// (unit, row).
__global__ void bwd_dbeta_kernel(StepDims dm, BackwardIO io, BackRows rows) {
  chain_start();
  const int64_t C = dm.C, k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k >= dm.V * dm.NC * dm.P * C) return;
  const int64_t u = k / C, i = k % C, tiles = dots_tiles(dm);
  const float* parts = rows.dbeta_parts + u * tiles * C + i;
  float x = parts[0];
  for (int64_t jt = 1; jt <= i / kDotsTile; ++jt) x += parts[jt * C];
  io.dbeta[k] = x;
}

}  // namespace
}  // namespace sdm

#endif  // JAX_SDM_KERNELS_CHUNK_STEPS_BACKWARD_DENSE_CUH_
