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
// kBlocks (the products on tensor cores, C a multiple of 16): each row up to the end of its 16-column diagonal
// block, whose cells past the triangle M holds as zeros (Phase 1's QK, the solve's Minv); every quad then lies
// inside M, so each is one 16-byte copy with no guard.
template <bool kBlocks = false>
__device__ __forceinline__ void stage_matrix_async(const float* M, int C, float* Ms) {
  const int ms = matrix_stride(C), lane = threadIdx.x % 32, warps = blockDim.x / 32;
  for (int r = threadIdx.x / 32; r < tile_rows(C); r += warps)
    for (int c0 = 4 * lane; c0 <= (kBlocks ? r | 15 : r); c0 += 4 * 32) {
      if constexpr (kBlocks) __pipeline_memcpy_async(Ms + r * ms + c0, M + r * C + c0, 16);
      else copy_quad_async(Ms + r * ms + c0, M + r * C + c0, r < C ? C - c0 : 0, C % 4 == 0);
    }
}

// Stage columns [d0, d0 + kSlice) of C rows of D floats into out [tile_rows(C), stride] (zeros past C and D),
// asynchronously.
__device__ __forceinline__ void stage_slice_async(const float* rows, int C, int64_t D, int64_t d0, float* out,
                                                  int stride = kSlice) {
  for (int idx = threadIdx.x; idx < tile_rows(C) * kQuads; idx += blockDim.x) {
    const int t = idx / kQuads, q = idx % kQuads;
    const int64_t d = d0 + 4 * q;
    const int n = t < C && d < D ? static_cast<int>(D - d < 4 ? D - d : 4) : 0;
    copy_quad_async(out + t * stride + 4 * q, rows + t * D + d, n, D % 4 == 0);
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

// Stage a [tile_rows(C), stride] slice in shared memory: row t < C, quad q is quad(t, q), rows past C are zero.
template <typename Quad>
__device__ __forceinline__ void stage_quads(int C, float* out, Quad quad, int stride = kSlice) {
  const int n = tile_rows(C) * kQuads;
#pragma unroll 4
  for (int idx = threadIdx.x; idx < n; idx += blockDim.x) {
    const int t = idx / kQuads, q = idx % kQuads;
    *reinterpret_cast<float4*>(out + t * stride + 4 * q) = t < C ? quad(t, q) : make_float4(0.f, 0.f, 0.f, 0.f);
  }
}

// stage_slice_async for rows of the bank's dtype T: float32 asynchronously, bfloat16 widened on the way (cp.async
// copies bytes as they are), its loads issued at once.
template <typename T>
__device__ __forceinline__ void stage_slice(const T* rows, int C, int64_t D, int64_t d0, float* out,
                                            int stride = kSlice) {
  if constexpr (std::is_same_v<T, float>)
    stage_slice_async(rows, C, D, d0, out, stride);
  else
    stage_quads(C, out, [&](int t, int q) { return load_quad(rows + t * D, d0 + 4 * q, D); }, stride);
}

// Rows per tile of the dense kernels' products. Unstaged, and in the dy part (one launch with many blocks per SM,
// throughput-bound): 4 x 4 tiles, one 16-byte load of M feeding 16 multiply-adds. The in-loop kernels, staged, run
// one block per SM and want its warps: one row a tile up to C = kLoopOneRowMaxC (512 threads at C = 64, where 4 x 4
// tiles left 4 warps, one per scheduler, issuing about every 4 cycles); above it two rows (512 threads at C = 128:
// each 16-byte load of a slice quad feeds 8 multiply-adds instead of 4, with 16 warps left to hide the loads; four
// rows, 256 threads, were slower: benchmarks/dense_tiles.cu).
// kMmaRows: the products on tensor cores instead (mma_tri_product: a warp's tile is 16 rows by 8 columns), for the
// kernels that have that instance (`tensor`: the in-loop ones), staged with C a multiple of 16.
constexpr int kLoopOneRowMaxC = 64, kLoopTileRows = 2, kWideTileRows = 4, kMmaRows = 16;
inline int dense_tile_rows(int64_t C, bool in_loop, bool staged, bool tensor = false) {
  if (!staged || !in_loop) return kWideTileRows;
  if (tensor && C % kMmaRows == 0) return kMmaRows;
  return C <= kLoopOneRowMaxC ? 1 : kLoopTileRows;
}

// Threads per block of a dense kernel with tiles of `rows` rows: one per tile of a slice, whole warps, at most
// kDenseThreadsMax (more tiles take turns); on tensor cores a warp per pair of m-tiles and n-tile, for the staging
// (mma_tri_product's products keep half of them busy, each with two n-tiles).
inline int tile_threads(int64_t C, int rows) {
  if (rows == kMmaRows) return 32 * static_cast<int>((C / kMmaRows + 1) / 2) * (kSlice / 8);
  return std::min(kDenseThreadsMax, (tile_rows(C) / rows * kQuads + 31) / 32 * 32);
}

// Threads per block of a dense kernel (in the loop or the dy part; staged or not).
inline int dense_threads(int64_t C, bool in_loop, bool staged) {
  return tile_threads(C, dense_tile_rows(C, in_loop, staged));
}

// Floats per row of a kernel's shared-memory slices: kSlice, or on tensor cores kSlice + 8 (mma_tri_product).
__host__ __device__ constexpr int slice_stride(int rows) { return rows == kMmaRows ? kSlice + 8 : kSlice; }

// The instance of an in-loop dense kernel: kernel(staged, rows) for the tile rows `rows` (dense_tile_rows), among
// the instances that it can give (kMmaRows only with kTensor).
template <bool kTensor = false, typename Pick>
auto loop_dense_kernel(bool staged, int rows, Pick kernel) {
  if (!staged) return kernel(std::false_type{}, std::integral_constant<int, kWideTileRows>{});
  if constexpr (kTensor)
    if (rows == kMmaRows) return kernel(std::true_type{}, std::integral_constant<int, kMmaRows>{});
  return rows == 1 ? kernel(std::true_type{}, std::integral_constant<int, 1>{})
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

// The triangular products on tensor cores (sm_80 and later): mma.sync m16n8k8 with tf32 operands, a 16 x 8 tile of
// M times an 8 x 8 tile of the slice a step. Each float32 operand x splits into a tf32 head h = tf32(x) and a tail
// x - h (exact in float32), and a step adds the tail products l_a h_b and h_a l_b and the heads' h_a h_b
// ("3xTF32": what is dropped, l_a l_b and the tails' bits below tf32, is about 2^-20 of each product, near float32's
// rounding). The tensor core reads a tail's tf32 bits (its low 13 bits dropped), so the tails go in as they are.
// The heads' and the tails' products add into separate accumulators, summed at the end, and a warp takes two
// output tiles side by side (and a second pair where it has two m-tiles): four to eight independent chains of
// products, so a warp waits less on each product's latency.
// The sums' order is the tensor core's and these accumulators': the bits are not the FFMA tiles', and the results
// agree with them (and with the CPU kernels) to float32 rounding, not bit for bit; every launch of the same inputs
// gives the same bits.
// Fragments (PTX ISA, m16n8k8 .tf32), lane = 4 g + t: A rows g and g + 8, columns t and t + 4; B rows t and t + 4,
// column g; the result rows g and g + 8, columns 2 t and 2 t + 1. Slices are kSlice + 8 floats a row: the B loads'
// rows t = 0 .. 3 then fall in different banks (with kSlice they would share one); M's rows, matrix_stride(C)
// floats apart (4 or 20 mod 32), put the lower product's A lanes in 32 different banks (not the transposed's).
// tf32_of: x truncated to tf32, its 13 low bits cleared: one instruction. The tail is then below one tf32 place of
// x (half of one when rounded), and what the tensor core drops of it twice as large, about 2^-20 of x.
__device__ __forceinline__ uint32_t tf32_of(float x) { return __float_as_uint(x) & 0xffffe000u; }

__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Heads h and tails l of n float32 values.
template <int n>
__device__ __forceinline__ void split_tf32(const float (&x)[n], uint32_t (&h)[n], uint32_t (&l)[n]) {
#pragma unroll
  for (int i = 0; i < n; ++i) {
    h[i] = tf32_of(x[i]);
    l[i] = __float_as_uint(x[i] - __uint_as_float(h[i]));
  }
}

// One output tile's accumulators: the heads' and the tails' products apart.
struct MmaSums {
  float heads[4] = {}, tails[4] = {};
  __device__ __forceinline__ void sum(float (&acc)[4]) const {
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[i] = heads[i] + tails[i];
  }
};

// The heads h and tails l of a B fragment.
struct SplitB { uint32_t h[2], l[2]; };

// One step (8 of k) of an m-tile against two n-tiles: its A fragment from a (A's element (i, j) at
// a[i a_row + j a_col]), split once, times each n-tile's split B fragment b[n], into sums[n].
__device__ __forceinline__ void mma_step2(const float* a, int a_row, int a_col, const SplitB (&b)[2],
                                          MmaSums (&sums)[2]) {
  const float af[4] = {a[0], a[8 * a_row], a[4 * a_col], a[8 * a_row + 4 * a_col]};
  uint32_t ah[4], al[4];
  split_tf32(af, ah, al);
#pragma unroll
  for (int n = 0; n < 2; ++n) {
    mma_tf32(sums[n].tails, al, b[n].h);
    mma_tf32(sums[n].tails, ah, b[n].l);
    mma_tf32(sums[n].heads, ah, b[n].h);
  }
}

// A triangular product on tensor cores over staged operands, C = 16 mt rows (tile_threads' warps), S is
// [C, slice_stride(kMmaRows)]:
//   lower:      out = M S,   M[r, k] for k <= r: m-tile m (rows 16 m .. 16 m + 15) takes k < 16 m + 16
//   transposed: out = M^T S, M[k, r] for k >= r: m-tile m takes k >= 16 m
// out(mi, ni, acc) takes each 16 x 8 output tile (n-tile ni: columns 8 ni .. 8 ni + 7). The diagonal blocks read
// M's cells past the triangle, zeros as staged (stage_matrix_async with kBlocks). A warp (of the first
// (mt + 1) / 2 * kSlice / 16: 8 at C 128) takes the n-tiles 2 p and 2 p + 1 and the m-tiles i and mt - 1 - i,
// one long and one short, so that the triangle's work is even over the warps; each A fragment's split serves both
// n-tiles, and where the m-tiles' k overlap, each B fragment's split serves both m-tiles. (With a warp per n-tile,
// all 16 warps at work, each split twice as often: slower, dense_tiles at C 128 on an H100.)
template <bool kTransposed, typename Out>
__device__ __forceinline__ void mma_tri_product(const float* M, int ms, const float* S, int C, Out out) {
  constexpr int ss = slice_stride(kMmaRows), np = kSlice / 16;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int a_row = kTransposed ? 1 : ms, a_col = kTransposed ? ms : 1;
  const int mt = C / kMmaRows, units = (mt + 1) / 2 * np;
  for (int unit = threadIdx.x / 32; unit < units; unit += blockDim.x / 32) {
    const int i = unit / np, p = unit % np, j = mt - 1 - i;
    // The long tile l and the short one sm (none where i = j, the middle of an odd mt): l takes k in [r0, r1), sm
    // in [s0, s1), a part of it.
    const int l = kTransposed ? i : j, sm = kTransposed ? j : i;
    const int r0 = kTransposed ? 16 * l : 0, r1 = kTransposed ? C : 16 * l + 16;
    const int s0 = kTransposed ? 16 * sm : 0, s1 = kTransposed ? C : 16 * sm + 16;
    const float* b = S + t * ss + 16 * p + g;
    const float* al = M + (16 * l + g) * a_row + t * a_col;
    const float* as = M + (16 * sm + g) * a_row + t * a_col;
    MmaSums long_sums[2], short_sums[2];
    const auto turns = [&](int from, int to, auto both) {
      for (int k = from; k < to; k += 8) {
        const float* bk = b + k * ss;
        SplitB sb[2];
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          const float bf[2] = {bk[8 * n], bk[4 * ss + 8 * n]};
          split_tf32(bf, sb[n].h, sb[n].l);
        }
        mma_step2(al + k * a_col, a_row, a_col, sb, long_sums);
        if constexpr (decltype(both)::value) mma_step2(as + k * a_col, a_row, a_col, sb, short_sums);
      }
    };
    if (i == j) {
      turns(r0, r1, std::false_type{});
    } else {
      turns(s0, s1, std::true_type{});
      if constexpr (kTransposed) turns(r0, s0, std::false_type{});
      else turns(s1, r1, std::false_type{});
    }
    float acc[4];
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      long_sums[n].sum(acc);
      out(l, 2 * p + n, acc);
      if (i != j) {
        short_sums[n].sum(acc);
        out(sm, 2 * p + n, acc);
      }
    }
  }
}

// A result tile of mma_tri_product (acc) into a [C, slice_stride(kMmaRows)] shared-memory slice, or with kAdd added
// to what the slice holds there (out + acc: the tile is the warp's alone).
template <bool kAdd = false>
__device__ __forceinline__ void store_mma_tile(float* out, int mi, int ni, const float (&acc)[4]) {
  constexpr int ss = slice_stride(kMmaRows);
  const int lane = threadIdx.x % 32, r = 16 * mi + lane / 4, col = 8 * ni + 2 * (lane % 4);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float2& o = *reinterpret_cast<float2*>(out + (r + 8 * h) * ss + col);
    o = kAdd ? make_float2(o.x + acc[2 * h], o.y + acc[2 * h + 1]) : make_float2(acc[2 * h], acc[2 * h + 1]);
  }
}

}  // namespace
}  // namespace sdm

#endif  // JAX_SDM_KERNELS_CHUNK_STEPS_DENSE_CUH_
