// The triangular products of the dense kernels (docs/MATH.md "Chunked form": apply the inverse, Delta = M^{-1} u
// and Y = Q0 + QK Delta; "Backward of a chunk": the readings' and the inverse's adjoints, M^{-T} and QK^T): one
// block per stream (or unit) and kSlice-column slice, the unit's C x C matrices staged in shared memory where they
// fit. Every output is one sum over k ascending whatever the tiling, so the tiling does not change the results.
#ifndef JAX_SDM_KERNELS_CHUNK_STEPS_DENSE_CUH_
#define JAX_SDM_KERNELS_CHUNK_STEPS_DENSE_CUH_

#include <algorithm>
#include <type_traits>

#include "kernels/chunk_steps/device.cuh"

namespace sdm {
namespace {

constexpr int kSlice = 32;              // columns per block of the dense kernels
constexpr int kDenseThreadsMax = 1024;  // threads per block of the dense kernels: one per tile

constexpr int kQuads = kSlice / 4;  // 4-column quads per row of a slice

// Rows of the dense kernels' shared-memory slices: C rounded up to whole 4-row tiles.
__host__ __device__ inline int tile_rows(int64_t C) { return static_cast<int>((C + 3) / 4 * 4); }

// A dense kernel reads the unit's C x C matrices from shared memory when they fit next to its slices ("staged"),
// else from global memory through L1. Staged, a block issues every load it needs at its start as asynchronous
// copies and waits once, instead of waiting on serial rounds of global loads (the slice, then each matrix, then the
// epilogue's rows) with one block of a few warps per SM to hide them. The in-loop kernels are staged up to
// C = kStagedLoopMaxC where the device allows a block the shared memory (the forward's: 67 KB at C = 64, 199 KB at
// C = 128, within the 227 KB of sm_90); the dy part (all chunks in one launch, throughput-bound with several
// blocks per SM) up to kStagedDyMaxC. Host-side (dense_staged in launch.cuh).
constexpr int kStagedLoopMaxC = 128, kStagedDyMaxC = 64;

// Row stride of a staged matrix: 16-byte rows, and 4 floats of padding that spread a tile's rows over the banks.
__host__ __device__ inline int matrix_stride(int64_t C) { return tile_rows(C) + 4; }

// Loads of the products: plain loads (shared memory, staged) or the read-only path (global memory).
template <bool kShared>
__device__ __forceinline__ float load_m(const float* p) {
  if constexpr (kShared) return *p;
  else return __ldg(p);
}
template <bool kShared>
__device__ __forceinline__ float4 load_m4(const float* p) {
  if constexpr (kShared) return *reinterpret_cast<const float4*>(p);
  else return __ldg(reinterpret_cast<const float4*>(p));
}

// n = 1, 2 or 4 consecutive floats of M from p (aligned to n floats) in one load.
template <bool kShared, int n>
__device__ __forceinline__ void load_run(const float* p, float (&out)[n]) {
  if constexpr (n == 4) {
    const float4 t = load_m4<kShared>(p);
    out[0] = t.x, out[1] = t.y, out[2] = t.z, out[3] = t.w;
  } else if constexpr (n == 2) {
    const float2 t = kShared ? *reinterpret_cast<const float2*>(p) : __ldg(reinterpret_cast<const float2*>(p));
    out[0] = t.x, out[1] = t.y;
  } else {
    static_assert(n == 1, "1, 2 or 4 floats");
    out[0] = load_m<kShared>(p);
  }
}

// Stage the lower triangle of the unit's C x C matrix M into Ms [tile_rows(C), matrix_stride(C)], asynchronously:
// the quads of columns [c0, c0 + 4) with c0 <= r of each row r (zeros past C). tri_tile reads no other cell (it
// reads M[r, k] for k <= r, rows past C as row C - 1), so the copy moves half the matrix's bytes; the cells above
// the quads stay unwritten. A warp takes a row at a time, lane l its quads l, l + 32, ...: no division of a runtime
// index per quad (ncu: the per-quad division was a quarter of the forward kernel's instructions at C = 128).
__device__ __forceinline__ void stage_matrix_async(const float* M, int C, float* Ms) {
  const int ms = matrix_stride(C), lane = threadIdx.x % 32, warps = blockDim.x / 32;
  for (int r = threadIdx.x / 32; r < tile_rows(C); r += warps)
    for (int c0 = 4 * lane; c0 <= r; c0 += 4 * 32)
      copy_quad_async(Ms + r * ms + c0, M + r * C + c0, r < C ? C - c0 : 0, C % 4 == 0);
}

// Stage columns [d0, d0 + kSlice) of C rows of D floats into out [tile_rows(C), kSlice] (zeros past C and D),
// asynchronously.
__device__ __forceinline__ void stage_slice_async(const float* rows, int C, int64_t D, int64_t d0, float* out) {
  for (int idx = threadIdx.x; idx < tile_rows(C) * kQuads; idx += blockDim.x) {
    const int t = idx / kQuads;
    const int64_t d = d0 + 4 * (idx % kQuads);
    const int n = t < C && d < D ? static_cast<int>(D - d < 4 ? D - d : 4) : 0;
    copy_quad_async(out + 4 * idx, rows + t * D + d, n, D % 4 == 0);
  }
}



// The dense kernels' operands that are not staged in shared memory (the unit's C x C matrices, float32 rows of the
// slice read after the first product) are asked into L1 when a block starts: their first touch would otherwise be
// a serial chain of cache misses inside the products, and with one block of a few warps per SM nothing hides it.
__device__ __forceinline__ void prefetch_l1(const float* p) { asm volatile("prefetch.global.L1 [%0];" ::"l"(p)); }

__device__ __forceinline__ void prefetch_matrix(const float* M, int C) {
  for (int i = threadIdx.x * 32; i < C * C; i += blockDim.x * 32) prefetch_l1(M + i);  // 128-byte lines
}

// Columns [d0, d0 + kSlice) of C rows of D floats (a line at each end of a row's columns).
__device__ __forceinline__ void prefetch_slice(const float* rows, int C, int64_t D, int64_t d0) {
  const int64_t last = min(d0 + kSlice, D) - 1;
  for (int t = threadIdx.x; t < C; t += blockDim.x) {
    prefetch_l1(rows + t * D + d0);
    prefetch_l1(rows + t * D + last);
  }
}

// Stage a [tile_rows(C), kSlice] slice in shared memory: row t < C, quad q is quad(t, q), rows past C are zero.
template <typename Quad>
__device__ __forceinline__ void stage_quads(int C, float* out, Quad quad) {
  const int n = tile_rows(C) * kQuads;
#pragma unroll 4
  for (int idx = threadIdx.x; idx < n; idx += blockDim.x) {
    const int t = idx / kQuads;
    reinterpret_cast<float4*>(out)[idx] = t < C ? quad(t, idx % kQuads) : make_float4(0.f, 0.f, 0.f, 0.f);
  }
}

// stage_slice_async for rows of the bank's dtype T: float32 asynchronously, bfloat16 widened on the way (cp.async
// copies bytes as they are), its loads issued at once.
template <typename T>
__device__ __forceinline__ void stage_slice(const T* rows, int C, int64_t D, int64_t d0, float* out) {
  if constexpr (std::is_same_v<T, float>)
    stage_slice_async(rows, C, D, d0, out);
  else
    stage_quads(C, out, [&](int t, int q) { return load_quad(rows + t * D, d0 + 4 * q, D); });
}

// Rows per tile of the dense kernels' products. Unstaged, and in the dy part (one launch with many blocks per SM,
// throughput-bound): 4 x 4 tiles, one 16-byte load of M feeding 16 multiply-adds. The in-loop kernels, staged, run
// one block per SM and want its warps: one row a tile up to C = kLoopOneRowMaxC (512 threads at C = 64, where 4 x 4
// tiles left 4 warps, one per scheduler, issuing about every 4 cycles); above it two rows (512 threads at C = 128:
// each 16-byte load of a slice quad feeds 8 multiply-adds instead of 4, with 16 warps left to hide the loads; four
// rows, 256 threads, were slower: benchmarks/dense_tiles.cu).
constexpr int kLoopOneRowMaxC = 64, kLoopTileRows = 2, kWideTileRows = 4;
inline int dense_tile_rows(int64_t C, bool in_loop, bool staged) {
  if (!staged || !in_loop) return kWideTileRows;
  return C <= kLoopOneRowMaxC ? 1 : kLoopTileRows;
}

// Threads per block of a dense kernel with tiles of `rows` rows: one per tile of a slice, whole warps, at most
// kDenseThreadsMax (more tiles take turns).
inline int tile_threads(int64_t C, int rows) {
  return std::min(kDenseThreadsMax, (tile_rows(C) / rows * kQuads + 31) / 32 * 32);
}

// Threads per block of a dense kernel (in the loop or the dy part; staged or not).
inline int dense_threads(int64_t C, bool in_loop, bool staged) {
  return tile_threads(C, dense_tile_rows(C, in_loop, staged));
}

// The instance of an in-loop dense kernel for chunk size C: kernel(staged, rows) for the tile rows
// dense_tile_rows gives, among the three instances that it can give.
template <typename Pick>
auto loop_dense_kernel(int64_t C, bool staged, Pick kernel) {
  if (!staged) return kernel(std::false_type{}, std::integral_constant<int, kWideTileRows>{});
  return dense_tile_rows(C, true, true) == 1 ? kernel(std::true_type{}, std::integral_constant<int, 1>{})
                                             : kernel(std::true_type{}, std::integral_constant<int, kLoopTileRows>{});
}

// body(r0, q) for every tile (rows r0 .. r0 + kRows - 1, quad q) of a slice, one tile per thread and turn. A warp
// takes 32 consecutive tiles, a group of tile rows. The triangular products' work grows with the row (or shrinks,
// transposed), and a warp's scheduler is warp % 4: when the block takes every tile in one turn in whole units of 8
// warps, the unit's warp 4 i + s takes group s (i = 0) or 7 - s (i = 1) of the unit's 8, so that each scheduler gets
// one short and one long group of each unit, not the unit's longest two (which warp takes a tile does not change
// its sums).
template <int kRows, typename Body>
__device__ __forceinline__ void for_tiles(int C, Body body) {
  const int n = tile_rows(C) / kRows * kQuads;
  if (n == static_cast<int>(blockDim.x) && n % (8 * 32) == 0) {
    const int w = threadIdx.x / 32, j = w % 8;
    const int idx = 32 * (w - j + (j < 4 ? j : 11 - j)) + threadIdx.x % 32;
    body(kRows * (idx / kQuads), idx % kQuads);
    return;
  }
  for (int idx = threadIdx.x; idx < n; idx += blockDim.x) body(kRows * (idx / kQuads), idx % kQuads);
}

// The triangular products of the dense kernels on a [tile_rows(C), kSlice] shared-memory slice `cols`, for the
// tile of rows r = r0 + j (j < kRows: 1, 2 or 4) and columns [4q, 4q + 4), with M's rows `ms` floats
// apart (in shared memory when kStaged, zeros past C; else in global memory, ms = C):
//   lower:      x[j] = sum_{k = 0..r} M[r, k] cols[k]       (k ascending)
//   transposed: x[j] = sum_{k = r..C-1} M[k, r] cols[k]     (k ascending)
// Each column's sum runs in the order of a one-column loop, whatever the tile's shape and however many steps the
// loop loads at a time. Rows past C (the last tile when C % 4 != 0) read M's row C - 1, or staged its
// zero padding; their sums are not used.
template <bool kTransposed, bool kStaged, int kRows>
__device__ __forceinline__ void tri_tile(const float* __restrict__ M, int ms, const float* cols, int r0, int q, int C,
                                         float4 (&x)[kRows]) {
  const bool vec = kStaged || C % 4 == 0;  // rows of M 16-byte aligned, and (global) no tile row past C
  int r[kRows];
#pragma unroll
  for (int j = 0; j < kRows; ++j) {
    r[j] = min(r0 + j, C - 1);
    x[j] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  const float4* c4 = reinterpret_cast<const float4*>(cols) + q;
  auto m = [&](int j, int k) { return load_m<kStaged>(kTransposed ? M + k * ms + r[j] : M + r[j] * ms + k); };
  // Steps k that only some rows of the tile take: transposed k < r0 + kRows - 1 (before), lower k > r0 (after).
  if constexpr (kTransposed) {
    for (int k = r0; k < min(r0 + kRows - 1, C); ++k) {
      const float4 c = c4[k * kQuads];
#pragma unroll
      for (int j = 0; j < kRows; ++j)
        if (k >= r0 + j) fma_quad(x[j], m(j, k), c);
    }
  }
  int k = kTransposed ? r0 + kRows - 1 : 0;
  const int hi = kTransposed ? C : r0 + 1;
  // n steps from k: every load first, then the multiply-adds (the loads of later steps arrive during the first
  // steps' multiply-adds).
  auto steps = [&](auto n_c) {
    constexpr int n = decltype(n_c)::value;
    float4 c[n];
    float mk[n][kRows];  // [step][row]
#pragma unroll
    for (int s = 0; s < n; ++s) c[s] = c4[(k + s) * kQuads];
    if (kTransposed && (kRows == 4 ? vec : kStaged)) {  // rows r0.. of M's row k in one load (r0 % kRows == 0)
#pragma unroll
      for (int s = 0; s < n; ++s) load_run<kStaged>(M + (k + s) * ms + r0, mk[s]);
    } else if (vec && !kTransposed) {
#pragma unroll
      for (int j = 0; j < kRows; ++j)
#pragma unroll
        for (int s = 0; s < n; s += 4) {
          const float4 t = load_m4<kStaged>(M + r[j] * ms + k + s);
          mk[s][j] = t.x, mk[s + 1][j] = t.y, mk[s + 2][j] = t.z, mk[s + 3][j] = t.w;
        }
    } else {
#pragma unroll
      for (int s = 0; s < n; ++s)
#pragma unroll
        for (int j = 0; j < kRows; ++j) mk[s][j] = m(j, k + s);
    }
#pragma unroll
    for (int s = 0; s < n; ++s)
#pragma unroll
      for (int j = 0; j < kRows; ++j) fma_quad(x[j], mk[s][j], c[s]);
    k += n;
  };
  // Staged with one or two rows a tile, 8 steps at a time (ncu at C = 128: with 4, the warps waited on each step
  // group's shared-memory loads more than they issued); then 4, then one.
  if constexpr (kStaged && kRows <= 2)
    while (k + 8 <= hi) steps(std::integral_constant<int, 8>{});
  while (k + 4 <= hi) steps(std::integral_constant<int, 4>{});
  for (; k < hi; ++k) {
    const float4 c = c4[k * kQuads];
#pragma unroll
    for (int j = 0; j < kRows; ++j) fma_quad(x[j], m(j, k), c);
  }
  if constexpr (!kTransposed) {
    for (int k = r0 + 1; k < min(r0 + kRows, C); ++k) {
      const float4 c = c4[k * kQuads];
#pragma unroll
      for (int j = 0; j < kRows; ++j)
        if (k <= r0 + j) fma_quad(x[j], m(j, k), c);
    }
  }
}

}  // namespace
}  // namespace sdm

#endif  // JAX_SDM_KERNELS_CHUNK_STEPS_DENSE_CUH_
