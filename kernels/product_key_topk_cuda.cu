// The product-key top-k on the GPU (kernels/product_key_topk.h): one warp per row, kWarps rows per block, no
// barrier but the warp's own; for few rows, a block per row whose warps select the factors side by side; for many
// rows of two short bfloat16 factors, a thread per row (product_key_topk_thread_kernel). A warp's selection (a
// factor's top m_f of n_f, then the top k of the C candidates): kernels/product_key_topk_warp.cuh.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/bf16_cuda.cuh"
#include "kernels/product_key_topk.h"
#include "kernels/product_key_topk_warp.cuh"

namespace sdm {
namespace {

using namespace topk_warp;

constexpr int kWarps = 4;  // rows per block
constexpr int kThreads = 32 * kWarps;
constexpr int64_t kSharedBytes = 48 * 1024;  // the default dynamic shared memory limit (no opt-in needed)
constexpr int kBwdTile = 2048;              // gradient columns a warp accumulates at once
// The forward takes a block per row (product_key_topk_split_kernel) for at most kSplitRows rows of 2 to
// kSplitMaxFactors factors, else a warp per row.
constexpr int64_t kSplitRows = 512;
constexpr int kSplitMaxFactors = 8;

// A warp's row (one per warp, kWarps per block) and its part of the block's dynamic shared memory.
struct WarpRow {
  int64_t row;
  int lane;
  unsigned char* shared;
};
__device__ __forceinline__ WarpRow warp_row(int64_t bytes_per_warp) {
  extern __shared__ __align__(16) unsigned char shared[];
  const int warp = static_cast<int>(threadIdx.x >> 5);
  return WarpRow{static_cast<int64_t>(blockIdx.x) * kWarps + warp, static_cast<int>(threadIdx.x & 31),
                 shared + warp * bytes_per_warp};
}

// Shared memory of one warp: its sort buffer, then the row's top lists (tops entries).
int64_t warp_bytes(const ProductKeyDims& d) { return 8 * sort_slots(d) + 8 * int64_t{d.tops}; }

// One warp per row, in three instances by the longest list whose keys stay in registers (kMaxE a lane: 256, 512 or
// 1024 elements; longer lists recompute theirs): the keys' registers bound the kernel's, so the instances for
// shorter lists keep more warps on an SM. Blocks an SM, with no spill: warp_blocks_per_sm.
__host__ __device__ constexpr int warp_blocks_per_sm(int max_e) { return max_e <= 8 ? 10 : max_e <= 16 ? 6 : 5; }
template <typename T, int kMaxE>
__global__ void __launch_bounds__(kThreads, warp_blocks_per_sm(kMaxE))
    product_key_topk_kernel(ProductKeyDims d, const T* __restrict__ x, const int32_t* __restrict__ table,
                            float* __restrict__ scores, int32_t* __restrict__ ids, int64_t bytes_per_warp) {
  const WarpRow w = warp_row(bytes_per_warp);
  if (w.row >= d.rows) return;
  uint64_t* buf = reinterpret_cast<uint64_t*>(w.shared);
  Top* tops = reinterpret_cast<Top*>(buf + sort_slots(d));
  const T* xr = x + w.row * d.width;
  for (int f = 0; f < d.F; ++f) select_factor<false, kMaxE>(d, xr, f, buf, tops, w.lane);
  select_slots<false, kMaxE>(d, tops, table, buf, scores + w.row * d.k, ids + w.row * d.k, w.lane);
}

// A block per row, warp f selecting factor f, then warp 0 the slots: for few rows (a decode step's), where one warp
// a row leaves the GPU idle and the row's latency is the call's. Shared memory: F sort buffers, then the top lists.
// Its few blocks leave registers plenty: the keys' loads are all in flight together (Keys, kTogether).
template <typename T>
__global__ void __launch_bounds__(32 * kSplitMaxFactors, 1)
    product_key_topk_split_kernel(ProductKeyDims d, const T* __restrict__ x, const int32_t* __restrict__ table,
                                  float* __restrict__ scores, int32_t* __restrict__ ids) {
  extern __shared__ __align__(16) unsigned char shared[];
  const int64_t row = blockIdx.x;
  const int warp = static_cast<int>(threadIdx.x >> 5);
  const int lane = static_cast<int>(threadIdx.x & 31);
  uint64_t* bufs = reinterpret_cast<uint64_t*>(shared);
  Top* tops = reinterpret_cast<Top*>(bufs + d.F * sort_slots(d));
  select_factor<true, 32>(d, x + row * d.width, warp, bufs + warp * sort_slots(d), tops, lane);
  __syncthreads();
  if (warp == 0) select_slots<true, 32>(d, tops, table, bufs, scores + row * d.k, ids + row * d.k, lane);
}

// A thread per row, for many rows of two bfloat16 factors of at most kThreadMaxN entries and k <= 64 (the layer's
// addressing at short factors): a warp's network sorts cost a warp instruction per row where a thread's cost one per
// 32 rows. Two instances by the longest top list, kTop = 32 or 64 (k <= kTop). Per factor, the 32-entry blocks of
// narrow composites are sorted in registers and merged into the running top kTop (a bitonic merge: the larger of
// L[kTop - 32 + j] and B[31 - j], then log2(kTop) half-cleaners); the top lists go to shared memory as (bfloat16
// bits, index). The k slots then come from a merge of 2s lists of candidates, s = floor(sqrt(k)): row i < s holds
// (i, j), j ascending, and column j < s holds (i, j), i ascending from s, each cut at the table's bound
// (i + 1)(j + 1) <= k (every candidate has min(i, j) < s, since (s + 1)^2 > k). Each step emits the largest head by
// (order key, then rank tuple) and advances its list. Each list is in the slots' order (score, then rank tuple), so
// the k emitted are the candidates' top k in order, as the CPU kernel ranks them, provided a list's sums never
// increase along it. They do not only where an infinity meets one of the other sign (+inf + -inf is NaN, below every
// number): a row whose top lists hold both ranks the table's candidates instead, one pass over them per slot.
constexpr int kThreadMaxN = 256;         // entries of a factor
constexpr int kThreadMaxK = 64;          // k (the longer instance's top lists)
constexpr int kThreadBlockWords = 8192;  // a block's shared memory (32 KiB): its rows' two top lists of kTop words

// Whether the thread-per-row kernels (forward for 16-bit scores, backward for both) take the call's rows: many rows
// of two factors of at most kThreadMaxN entries, k <= kThreadMaxK.
inline bool thread_per_row(const ProductKeyDims& d) {
  return d.rows > kSplitRows && d.F == 2 && d.k <= kThreadMaxK && d.n[0] <= kThreadMaxN && d.n[1] <= kThreadMaxN;
}
// floor(sqrt(k)) for k >= 1: the merge's s (every candidate (i, j) of the table has min(i, j) < s).
__host__ __device__ constexpr int floor_sqrt(int k) {
  int s = 1;
  while ((s + 1) * (s + 1) <= k) ++s;
  return s;
}

template <int kTop>
__host__ __device__ constexpr int thread_rows() {  // rows (threads) per block: 128 for kTop 32, 64 for kTop 64
  return kThreadBlockWords / (2 * kTop);
}

__device__ __forceinline__ void ce_desc(uint32_t& a, uint32_t& b) {  // a the larger after
  const uint32_t hi = a > b ? a : b;
  b = a > b ? b : a;
  a = hi;
}

// v[0, N) sorted descending (a bitonic network, every index a constant; N a power of two).
template <int N>
__device__ __forceinline__ void thread_sort(uint32_t (&v)[N]) {
#pragma unroll
  for (int size = 2; size <= N; size <<= 1) {
#pragma unroll
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
#pragma unroll
      for (int i = 0; i < N; ++i) {
        const int j = i ^ stride;
        if (j <= i) continue;
        if ((i & size) == 0) {
          ce_desc(v[i], v[j]);
        } else {
          ce_desc(v[j], v[i]);
        }
      }
    }
  }
}

// The top kTop of the descending lists top [kTop] and b [32] into top, descending: the pairs top[kTop - 32 + j],
// b[31 - j] keep their larger (the top kTop of the two, a bitonic sequence), then the half-cleaners sort it.
template <int kTop>
__device__ __forceinline__ void thread_merge(uint32_t (&top)[kTop], const uint32_t (&b)[32]) {
#pragma unroll
  for (int j = 0; j < 32; ++j) top[kTop - 32 + j] = top[kTop - 32 + j] > b[31 - j] ? top[kTop - 32 + j] : b[31 - j];
#pragma unroll
  for (int stride = kTop / 2; stride > 0; stride >>= 1) {
#pragma unroll
    for (int i = 0; i < kTop; ++i)
      if ((i & stride) == 0) ce_desc(top[i], top[i + stride]);
  }
}

// A merge key: the sum's order key with NaN (0) moved to 1, so that 0 marks an exhausted list.
__device__ __forceinline__ uint32_t merge_key(float s) {
  const uint32_t key = order_key(s);
  return key == 0u ? 1u : key;
}
__device__ __forceinline__ float entry_score(uint32_t entry) {
  return float_of_bf16_bits(static_cast<uint16_t>(entry >> 16));
}
__device__ __forceinline__ int32_t entry_index(uint32_t entry) { return static_cast<int32_t>(entry & 0xffffu); }

// A narrow composite's bfloat16 bits, from its key's top 16 bits (order_key's inverse there). Zero is ambiguous
// (-0 and +0 share a key) and NaN is not kept (its sums are NaN, written as the one canonical NaN): the caller reads
// a zero's bits back from the row.
__device__ __forceinline__ uint16_t composite_bf16_bits(uint32_t c) {
  const uint32_t top = c >> 16;
  return static_cast<uint16_t>(top & 0x8000u ? top & 0x7fffu : ~top & 0xffffu);
}
constexpr uint32_t kZeroKeyTop = 0x8000u;  // order_key(+0) >> 16

// The entries e0 + 8 q + [0, 8) (q < 4) of the rows of a lane pair (lanes 2 p and 2 p + 1: rows xa, xb) into the
// calling lane's h[q][8]: each 32-byte sector is loaded once, half by each lane of the pair, and the halves swapped
// with a shuffle (a lane loading its own row's 64 bytes alone would load each sector twice: shared memory leaves
// L1 little room, so the second load misses). Every lane of the warp calls it; xa, xb 16-byte aligned, n % 8 == 0.
__device__ __forceinline__ void pair_load_chunk(const uint16_t* xa, const uint16_t* xb, int e0, int n, bool odd,
                                                uint16_t (&h)[4][8]) {
#pragma unroll
  for (int sector = 0; sector < 2; ++sector) {
    const int q = 2 * sector + (odd ? 1 : 0);  // this lane's half of the sector
    const bool in = e0 + 8 * q < n;
    const uint4 zero{0u, 0u, 0u, 0u};
    const uint4 va = in ? *reinterpret_cast<const uint4*>(xa + e0 + 8 * q) : zero;
    const uint4 vb = in ? *reinterpret_cast<const uint4*>(xb + e0 + 8 * q) : zero;
    const uint4 keep = odd ? vb : va, send = odd ? va : vb;
    const uint4 got{static_cast<unsigned>(__shfl_xor_sync(~0u, static_cast<int>(send.x), 1)),
                    static_cast<unsigned>(__shfl_xor_sync(~0u, static_cast<int>(send.y), 1)),
                    static_cast<unsigned>(__shfl_xor_sync(~0u, static_cast<int>(send.z), 1)),
                    static_cast<unsigned>(__shfl_xor_sync(~0u, static_cast<int>(send.w), 1))};
    const uint4 lo = odd ? got : keep, hi = odd ? keep : got;  // the sector's halves q = 2 sector, 2 sector + 1
    const unsigned w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
    for (int t = 0; t < 16; ++t) h[2 * sector + t / 8][t % 8] = static_cast<uint16_t>(w[t / 2] >> (16 * (t % 2)));
  }
}

// Factor f's top m_f of the thread's row (raw bfloat16 bits xf[0, n)) into its list in shared memory (entry r at
// list[r * rows]); returns the list's infinities: bit 0 a +inf, bit 1 a -inf. Every lane of the warp calls it;
// where `paired`, the rows of the lane pair are xa and xb (the calling lane's is xf, the odd lane's xb) and each
// chunk is loaded by pair_load_chunk.
template <int kTop>
__device__ unsigned thread_factor(const uint16_t* __restrict__ xf, const uint16_t* xa, const uint16_t* xb,
                                  bool paired, bool odd, int n, int m, uint32_t* list) {
  uint32_t top[kTop];
  for (int e0 = 0; e0 < n; e0 += 32) {
    uint16_t h[4][8];
    if (paired) {
      pair_load_chunk(xa, xb, e0, n, odd, h);
    } else {
#pragma unroll
      for (int t = 0; t < 32; ++t) h[t / 8][t % 8] = e0 + t < n ? xf[e0 + t] : uint16_t{0};
    }
    uint32_t b[32];
#pragma unroll
    for (int t = 0; t < 32; ++t) {
      const int e = e0 + t;
      b[t] = e < n ? Composite<uint32_t>::make(order_key(float_of_bf16_bits(h[t / 8][t % 8])), static_cast<uint32_t>(e))
                   : 0u;
    }
    thread_sort(b);
    if (e0 == 0) {
#pragma unroll
      for (int j = 0; j < kTop; ++j) top[j] = j < 32 ? b[j] : 0u;  // 0: below every element
    } else {
      thread_merge<kTop>(top, b);
    }
  }
  constexpr int rows = thread_rows<kTop>();
  unsigned inf = 0;
#pragma unroll
  for (int r = 0; r < kTop; ++r) {
    if (r >= m) break;
    const uint32_t e = Composite<uint32_t>::position(top[r]);
    const uint16_t bits = top[r] >> 16 == kZeroKeyTop ? xf[e] : composite_bf16_bits(top[r]);
    inf |= bits == 0x7f80u ? 1u : bits == 0xff80u ? 2u : 0u;
    list[r * rows] = static_cast<uint32_t>(bits) << 16 | e;
  }
  return inf;
}

template <int kTop>
__global__ void __launch_bounds__(thread_rows<kTop>(), kTop == 32 ? 6 : 3)
    product_key_topk_thread_kernel(ProductKeyDims d, const uint16_t* __restrict__ x,
                                   const int32_t* __restrict__ table, float* __restrict__ scores,
                                   int32_t* __restrict__ ids) {
  constexpr int rows = thread_rows<kTop>();
  extern __shared__ __align__(16) unsigned char shared[];
  // A block's rows past d.rows still load (their pair's last row) and sort with their warp: the loads shuffle.
  const int64_t row = static_cast<int64_t>(blockIdx.x) * rows + threadIdx.x;
  const int64_t last = d.rows - 1;
  const bool odd = (threadIdx.x & 1u) != 0;  // rows is even: row and threadIdx.x share their parity
  const int64_t row_a = (row & ~int64_t{1}) < last ? (row & ~int64_t{1}) : last;
  const int64_t row_b = (row | 1) < last ? (row | 1) : last;
  uint32_t* a = reinterpret_cast<uint32_t*>(shared) + threadIdx.x;  // a[r * rows]: factor 0's rank r
  uint32_t* b = a + kTop * rows;                                     // factor 1's
  unsigned inf[2];
#pragma unroll
  for (int f = 0; f < 2; ++f) {
    const uint16_t* xa = x + row_a * d.width + d.x_offset[f];
    const uint16_t* xb = x + row_b * d.width + d.x_offset[f];
    // 16-byte loads where every row's factor is aligned (the same for all rows: the width a multiple of 8).
    const bool paired = (reinterpret_cast<uintptr_t>(x + d.x_offset[f]) & 15u) == 0 && (d.width & 7) == 0 &&
                        (d.n[f] & 7) == 0;
    inf[f] = thread_factor<kTop>(odd ? xb : xa, xa, xb, paired, odd, d.n[f], d.m[f], f == 0 ? a : b);
  }
  if (row >= d.rows) return;
  float* sr = scores + row * d.k;
  int32_t* ir = ids + row * d.k;
  const int m0 = d.m[0], m1 = d.m[1], k = d.k, n1 = d.n[1];
  auto score_of = [&](int i, int j) { return canonical_score(entry_score(a[i * rows]) + entry_score(b[j * rows])); };
  auto id_of = [&](int i, int j) { return entry_index(a[i * rows]) * n1 + entry_index(b[j * rows]); };
  // A candidate (i, j) as one integer whose descending order is the slots' (composite: the merge key, then the
  // smaller rank tuple; i, j < 256); 0 for none.
  auto head_of = [&](int i, int j) {
    return composite(merge_key(entry_score(a[i * rows]) + entry_score(b[j * rows])),
                     static_cast<uint32_t>(i << 8 | j));
  };
  if (((inf[0] & 1u) && (inf[1] & 2u)) || ((inf[0] & 2u) && (inf[1] & 1u))) {
    // Sums that do not fall along a list: per slot, the best candidate of the table below the one emitted last
    // (composites (key, table position): distinct, the CPU kernel's order).
    uint64_t last_emitted = ~uint64_t{0};
    for (int out = 0; out < k; ++out) {
      uint64_t best = 0;
      int best_c = 0;
      for (int c = 0; c < d.C; ++c) {
        const uint32_t ea = a[__ldg(table + c) * rows], eb = b[__ldg(table + d.C + c) * rows];
        const uint64_t comp = composite(order_key(entry_score(ea) + entry_score(eb)), static_cast<uint32_t>(c));
        if (comp < last_emitted && comp > best) {
          best = comp;
          best_c = c;
        }
      }
      const int i = __ldg(table + best_c), j = __ldg(table + d.C + best_c);
      sr[out] = score_of(i, j);
      ir[out] = id_of(i, j);
      last_emitted = best;
    }
    return;
  }
  // The merge: head[l], list l's next candidate (0: exhausted); lists 0 .. s - 1 the rows, s .. 2s - 1 the columns.
  constexpr int kLists = 2 * floor_sqrt(kTop);  // the most lists an instance keeps
  const int s = floor_sqrt(k);
  uint64_t head[kLists];
#pragma unroll
  for (int l = 0; l < kLists; ++l) {
    const int i = l < s ? l : s, j = l < s ? 0 : l - s;  // the list's first candidate
    const bool open = l < 2 * s && i < m0 && j < m1 && (i + 1) * (j + 1) <= k;
    head[l] = open ? head_of(i, j) : 0u;
  }
  // Four slots a step, written with 16-byte stores where the row allows (k a multiple of 4).
  const bool vec_out = (k & 3) == 0 && (reinterpret_cast<uintptr_t>(sr) & 15u) == 0 &&
                       (reinterpret_cast<uintptr_t>(ir) & 15u) == 0;
  for (int out0 = 0; out0 < k; out0 += 4) {
    float sv[4];
    int32_t iv[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      if (out0 + u >= k) break;
      uint64_t best = head[0];
      int bl = 0;
#pragma unroll
      for (int l = 1; l < kLists; ++l) {
        const bool more = head[l] > best;
        best = more ? head[l] : best;
        bl = more ? l : bl;
      }
      const int pos = static_cast<int>(composite_pos(best));
      const int i = pos >> 8, j = pos & 0xff;
      sv[u] = score_of(i, j);
      iv[u] = id_of(i, j);
      if (!vec_out) {
        sr[out0 + u] = sv[u];
        ir[out0 + u] = iv[u];
      }
      // The list's next candidate: a row advances j, a column i.
      const int i1 = bl < s ? i : i + 1, j1 = bl < s ? j + 1 : j;
      const uint64_t h1 = i1 < m0 && j1 < m1 && (i1 + 1) * (j1 + 1) <= k ? head_of(i1, j1) : 0u;
#pragma unroll
      for (int l = 0; l < kLists; ++l) head[l] = l == bl ? h1 : head[l];
    }
    if (vec_out) {
      *reinterpret_cast<float4*>(sr + out0) = make_float4(sv[0], sv[1], sv[2], sv[3]);
      *reinterpret_cast<int4*>(ir + out0) = make_int4(iv[0], iv[1], iv[2], iv[3]);
    }
  }
}

// Shared memory of a backward warp: dscores and ids [k], the tile, then (indexed) the factor indices [F, k].
__host__ __device__ inline int64_t bwd_warp_bytes(const ProductKeyDims& d, bool indexed) {
  const int64_t tile = d.width < kBwdTile ? d.width : kBwdTile;
  return 8 * int64_t{d.k} + 4 * tile + (indexed ? 4 * int64_t{d.F} * d.k : 0);
}

// Slot `slot`'s index in factor f, or -1 for an id outside [0, slots) (it contributes nothing).
__device__ __forceinline__ int32_t factor_index_of(const ProductKeyDims& d, int32_t slot, int f) {
  if (slot < 0 || slot >= d.slots) return -1;
  return static_cast<int32_t>(static_cast<uint32_t>(slot) / d.weight[f] % static_cast<uint32_t>(d.n[f]));
}

// The backward, one warp per row: the row's dscores and ids in shared memory, then per tile of kBwdTile columns
// lane f adds the cotangents of factor f into the tile in selection order (one writer per column), and the warp
// writes the tile out. Where shared memory holds them (bwd_warp_bytes), the slots' factor indices [F, k] are
// computed first, by all lanes at once (lane j's divisions for its slots), so that lane f's serial walk over the
// slots only loads, compares and adds.
template <typename T>
__global__ void __launch_bounds__(kThreads, 1)
    product_key_topk_bwd_kernel(ProductKeyDims d, const float* __restrict__ dscores, const int32_t* __restrict__ ids,
                                T* __restrict__ dx, int64_t bytes_per_warp) {
  const WarpRow w = warp_row(bytes_per_warp);
  const int64_t row = w.row;
  const int lane = w.lane;
  if (row >= d.rows) return;
  const int tile = d.width < kBwdTile ? d.width : kBwdTile;
  float* ds = reinterpret_cast<float*>(w.shared);
  int32_t* id = reinterpret_cast<int32_t*>(ds + d.k);
  float* acc = reinterpret_cast<float*>(id + d.k);
  int32_t* factor_index = reinterpret_cast<int32_t*>(acc + tile);  // [F, k]: -1 for an id outside [0, slots)
  const bool indexed = bytes_per_warp >= bwd_warp_bytes(d, true);
  for (int j = lane; j < d.k; j += 32) {
    ds[j] = dscores[row * d.k + j];
    const int32_t slot = ids[row * d.k + j];
    id[j] = slot;
    if (indexed)
      for (int f = 0; f < d.F; ++f) factor_index[f * d.k + j] = factor_index_of(d, slot, f);
  }
  T* out = dx + row * d.width;
  for (int c0 = 0; c0 < d.width; c0 += tile) {
    const int len = d.width - c0 < tile ? d.width - c0 : tile;
    for (int i = lane; i < len; i += 32) acc[i] = 0.0f;
    __syncwarp();
    for (int f = lane; f < d.F; f += 32) {
      const int lo = d.x_offset[f] - c0;  // the factor's columns in the tile: [lo, lo + n_f) within [0, len)
      if (lo >= len || lo + d.n[f] <= 0) continue;
      for (int j = 0; j < d.k; ++j) {
        const int32_t i = indexed ? factor_index[f * d.k + j] : factor_index_of(d, id[j], f);
        const int col = lo + i;
        if (i >= 0 && col >= 0 && col < len) acc[col] += ds[j];
      }
    }
    __syncwarp();
    for (int i = lane; i < len; i += 32) out[c0 + i] = from_f(acc[i], out);
    __syncwarp();
  }
}

// The backward, a thread per row, for many rows of two factors of at most kThreadMaxN entries and k <= kTop (the
// layer's addressing, as in the forward; float32 or bfloat16): a warp's serial walk over the slots costs a chain of
// shared-memory round trips per slot, a thread's sort about ten compare-exchanges per slot. Per factor, the k keys
// ~(i << 8 | j) (factor index i, slot j; 0 for an id outside [0, slots)) sorted descending in registers, so in
// (i, j) order; then one pass adds each run of equal i in slot order from +0. The row's dscores wait in shared memory
// (slot j of thread t at [j][t]: no bank conflict whatever j). With lists of 32, where the row's factors are whole
// 16-byte groups, the pass writes each group once (16-byte stores, zeros between the runs: global stores of a few
// bytes each cost as much as whole ones); elsewhere the row is zeroed first and each run's sum stored alone.
constexpr int kBwdThreadRows = 128;
template <int kTop, typename T>
__global__ void __launch_bounds__(kBwdThreadRows, kTop == 32 ? 6 : 3)
    product_key_topk_bwd_thread_kernel(ProductKeyDims d, const float* __restrict__ dscores,
                                       const int32_t* __restrict__ ids, T* __restrict__ dx) {
  __shared__ float ds[kTop * kBwdThreadRows];
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kBwdThreadRows + threadIdx.x;
  if (row >= d.rows) return;
  const float* dsr = dscores + row * d.k;
  const int32_t* ir = ids + row * d.k;
  float* dst = ds + threadIdx.x;  // dst[j * kBwdThreadRows]: slot j's cotangent
  T* out = dx + row * d.width;
  const uint32_t n1 = static_cast<uint32_t>(d.n[1]);
  const bool vec_in = (d.k & 3) == 0 && (reinterpret_cast<uintptr_t>(dsr) & 15u) == 0 &&
                      (reinterpret_cast<uintptr_t>(ir) & 15u) == 0;
  uint32_t key[2][kTop];  // factor f's keys
#pragma unroll
  for (int j0 = 0; j0 < kTop; j0 += 4) {
    int32_t slot[4] = {-1, -1, -1, -1};
    if (vec_in && j0 < d.k) {
      const int4 iv = *reinterpret_cast<const int4*>(ir + j0);
      const float4 dv = *reinterpret_cast<const float4*>(dsr + j0);
      slot[0] = iv.x, slot[1] = iv.y, slot[2] = iv.z, slot[3] = iv.w;
      dst[(j0 + 0) * kBwdThreadRows] = dv.x, dst[(j0 + 1) * kBwdThreadRows] = dv.y;
      dst[(j0 + 2) * kBwdThreadRows] = dv.z, dst[(j0 + 3) * kBwdThreadRows] = dv.w;
    } else if (!vec_in) {
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        if (j0 + t >= d.k) break;
        slot[t] = ir[j0 + t];
        dst[(j0 + t) * kBwdThreadRows] = dsr[j0 + t];
      }
    }
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      const int j = j0 + t;
      const bool valid = slot[t] >= 0 && slot[t] < d.slots;
      const uint32_t i0 = static_cast<uint32_t>(slot[t]) / n1, i1 = static_cast<uint32_t>(slot[t]) - i0 * n1;
      key[0][j] = valid ? ~(i0 << 8 | j) : 0u;
      key[1][j] = valid ? ~(i1 << 8 | j) : 0u;
    }
  }
  constexpr int kVec = 16 / sizeof(T);  // elements a 16-byte store
  // The group walk (each 16-byte group of the row written once) for the lists of 32. The lists of 64 zero the row
  // first, then store each run's sum alone: there the group walk's selects at every run's end cost more than the
  // sectors they save. The zeroing takes 16-byte stores where the row allows: one a sector, not eight.
  const bool aligned = (reinterpret_cast<uintptr_t>(out) & 15u) == 0;
  const bool vec_out = kTop <= 32 && aligned && d.width == d.n[0] + d.n[1] && d.x_offset[1] == d.n[0] &&
                       d.n[0] % kVec == 0 && d.n[1] % kVec == 0;
  if (kTop > 32 && aligned && d.width % kVec == 0) {
    const uint4 zeros{0u, 0u, 0u, 0u};
    for (int c = 0; c < d.width; c += kVec) *reinterpret_cast<uint4*>(out + c) = zeros;
  } else if (!vec_out) {
    for (int c = 0; c < d.width; ++c) out[c] = from_f(0.0f, out);
  }
#pragma unroll
  for (int f = 0; f < 2; ++f) {
    thread_sort(key[f]);
    T* of = out + d.x_offset[f];
    const int groups = d.n[f] / kVec;
    float group[kVec];  // the group `g` being filled (vec_out): groups below g are written
#pragma unroll
    for (int t = 0; t < kVec; ++t) group[t] = 0.0f;
    int g = 0;
    auto flush_to = [&](int end) {  // write groups [g, end): the one being filled, then zeros
      for (; g < end; ++g) {
        T v[kVec];
#pragma unroll
        for (int t = 0; t < kVec; ++t) {
          v[t] = from_f(group[t], of);
          group[t] = 0.0f;
        }
        *reinterpret_cast<uint4*>(of + g * kVec) = *reinterpret_cast<const uint4*>(v);
      }
    };
    float acc = 0.0f;
#pragma unroll
    for (int p = 0; p < kTop; ++p) {
      const uint32_t kp = ~key[f][p];  // (i << 8 | j); all ones past the valid slots
      if (kp == ~0u) break;
      const uint32_t i = kp >> 8;
      if (p == 0 || (~key[f][p - 1] >> 8) != i) acc = 0.0f;
      acc += dst[(kp & 0xffu) * kBwdThreadRows];
      const uint32_t next = p + 1 < kTop ? ~key[f][p + 1] : ~0u;
      if ((next >> 8) != i) {  // the run of index i ends: its sum
        if (vec_out) {
          flush_to(static_cast<int>(i) / kVec);
#pragma unroll
          for (int t = 0; t < kVec; ++t) group[t] = static_cast<int>(i) % kVec == t ? acc : group[t];
        } else {
          of[i] = from_f(acc, of);
        }
      }
    }
    if (vec_out) flush_to(groups);
  }
}

template <typename Kernel, typename... Args>
int launch(Kernel kernel, const ProductKeyDims& d, int64_t bytes_per_warp, cudaStream_t stream, Args... args) {
  if (d.rows <= 0) return static_cast<int>(cudaSuccess);
  const int64_t blocks = (d.rows + kWarps - 1) / kWarps;
  if (kWarps * bytes_per_warp > kSharedBytes || blocks > 0x7fffffff) return static_cast<int>(cudaErrorInvalidValue);
  kernel<<<static_cast<unsigned>(blocks), kThreads, kWarps * bytes_per_warp, stream>>>(d, args..., bytes_per_warp);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

template <typename T>
int product_key_topk_cuda(const ProductKeyDims& d, const T* x, const int32_t* table, float* scores, int32_t* ids,
                          CUstream_st* stream) {
  using D = typename Device<T>::type;
  const D* xd = reinterpret_cast<const D*>(x);
  const int64_t split_bytes = 8 * (d.F * sort_slots(d) + int64_t{d.tops});  // F sort buffers: may not fit
  if (d.rows > 0 && d.rows <= kSplitRows && d.F >= 2 && d.F <= kSplitMaxFactors && split_bytes <= kSharedBytes) {
    product_key_topk_split_kernel<D><<<static_cast<unsigned>(d.rows), 32 * d.F, split_bytes, stream>>>(d, xd, table,
                                                                                                        scores, ids);
    return static_cast<int>(cudaGetLastError());
  }
  if constexpr (sizeof(T) == 2) {
    if (thread_per_row(d)) {
      const bool wide = d.k > 32;
      const auto kernel = wide ? product_key_topk_thread_kernel<64> : product_key_topk_thread_kernel<32>;
      const int rows = wide ? thread_rows<64>() : thread_rows<32>();
      const int64_t blocks = (d.rows + rows - 1) / rows;
      if (blocks > 0x7fffffff) return static_cast<int>(cudaErrorInvalidValue);
      kernel<<<static_cast<unsigned>(blocks), rows, 4 * kThreadBlockWords, stream>>>(
          d, reinterpret_cast<const uint16_t*>(x), table, scores, ids);
      return static_cast<int>(cudaGetLastError());
    }
  }
  // The longest list a row selects from: the factors, then (F > 1) the candidates.
  int32_t longest = d.F > 1 ? d.C : 0;
  for (int f = 0; f < d.F; ++f) longest = d.n[f] > longest ? d.n[f] : longest;
  const auto kernel = longest <= 32 * 8    ? product_key_topk_kernel<D, 8>
                      : longest <= 32 * 16 ? product_key_topk_kernel<D, 16>
                                           : product_key_topk_kernel<D, 32>;
  return launch(kernel, d, warp_bytes(d), stream, xd, table, scores, ids);
}

template <typename T>
int product_key_topk_bwd_cuda(const ProductKeyDims& d, const float* dscores, const int32_t* ids, T* dx,
                              CUstream_st* stream) {
  using D = typename Device<T>::type;
  if (thread_per_row(d)) {
    const auto kernel =
        d.k > 32 ? product_key_topk_bwd_thread_kernel<64, D> : product_key_topk_bwd_thread_kernel<32, D>;
    const int64_t blocks = (d.rows + kBwdThreadRows - 1) / kBwdThreadRows;
    if (blocks > 0x7fffffff) return static_cast<int>(cudaErrorInvalidValue);
    kernel<<<static_cast<unsigned>(blocks), kBwdThreadRows, 0, stream>>>(d, dscores, ids, reinterpret_cast<D*>(dx));
    return static_cast<int>(cudaGetLastError());
  }
  const int64_t indexed_bytes = bwd_warp_bytes(d, true);  // the factor indices where they fit
  const int64_t bytes = kWarps * indexed_bytes <= kSharedBytes ? indexed_bytes : bwd_warp_bytes(d, false);
  return launch(product_key_topk_bwd_kernel<D>, d, bytes, stream, dscores, ids, reinterpret_cast<D*>(dx));
}

template int product_key_topk_cuda<float>(const ProductKeyDims&, const float*, const int32_t*, float*, int32_t*,
                                          CUstream_st*);
template int product_key_topk_cuda<bf16>(const ProductKeyDims&, const bf16*, const int32_t*, float*, int32_t*,
                                         CUstream_st*);
template int product_key_topk_bwd_cuda<float>(const ProductKeyDims&, const float*, const int32_t*, float*,
                                              CUstream_st*);
template int product_key_topk_bwd_cuda<bf16>(const ProductKeyDims&, const float*, const int32_t*, bf16*,
                                             CUstream_st*);

}  // namespace sdm
