// Phase 1 and its backward on the GPU (docs/DESIGN.md "Phase 1", "Phase-1 backward"; docs/MATH.md "Phase 1",
// "Backward of a chunk"). The same arrays as kernels/phase1_cpu.cc, the same sums in the same order where it
// matters (segmented scans, run sums, the per-run pair gradients), so the two agree to float32 rounding (exp may
// differ in the last bit, and the cells of A / QK add their per-slot terms in another order).
//
// One thread block of kThreads threads per unit (grid-stride over the units). An entry is named by its sequence
// number seq = t * (W + R) + lane (write lanes 0..W-1, then read lanes W..W+R-1). Per unit:
//  1. Sort: slot_of[seq] is the entry's slot (-1 when invalid); the valid seqs are compacted in seq order and
//     sorted by slot with a stable LSD radix sort (8-bit digits, ceil(bits(K - 1) / 8) passes; per pass each
//     warp ranks a contiguous slice 32 entries at a time by ballots, the per-(digit, warp) counts are scanned in
//     (digit, warp) order). Stable from seq order, so the order is (slot, token, write-before-read, lane): the
//     stable order of MATH.md "Phase 1". No barrier per compare-exchange as a bitonic sort has.
//  2. A *group* is the sorted entries of one slot, a *run* a maximal block of them of one token and kind. A
//     write run is a first occurrence (its head) followed by the repeats of that slot in that token; log_k is
//     constant over it, and so is log_q over a read run. One thread per group walks it in sorted order, as the
//     CPU does (inclusive prefix of the gates, the exclusive suffix for rex by its own backward walk), and
//     records per entry seq: link[seq] = the seq of the nearest earlier write head of its group (-1: none) for a
//     run head, -2 - (its head's seq) for any other entry; run_sum[head seq] = the sum of its run's weights in
//     lane order. The links chain a head to all earlier write heads of its group, nearest first, with no search.
//     The weights k_eff, w, q_w follow from the stored log values and rex in seq order (coalesced).
//  3. Forward pairs: one warp per token row i of A and QK. The lanes look up the row's heads (write lanes, then
//     read lanes, in lane order) in parallel; the heads with earlier write heads then walk their links one lane
//     at a time, in lane order, adding K_a K_b exp(X_ab) to the warp's copy of the row in shared memory: one
//     writer per row and a fixed order of every cell's terms. X_ab = L_a - L_b is summed directly, from a down
//     to b, over the gates of the write heads after b, never taken as a difference of log values: that would
//     give -inf - -inf = NaN for a gate of -inf and cancel every digit of the small part next to a gate of
//     -1e30.
//     Backward pairs: one thread per run head accumulates the gradient of its run's weight sum and log value
//     over the pairs it is part of: first the earlier write heads along its links, nearest first (as the later
//     run), then, for a write head, the later heads of its group in sorted order (as the earlier write run): the
//     CPU's accumulation order (the exponents of the second kind are summed from b up to a, the CPU's from a
//     down to b: they may differ in the last bit).
//  4. Backward entries, in seq order (coalesced): dk_val / dq_val, the log and rex gradients of each entry (the
//     group starts are marked in the sorted list first, which frees slot_of for the runs' weight gradients).
//     Backward gates: one thread per group: the total's gradient and the prefix sums of the rex gradients
//     (forward walk), the suffix sums of the log gradients and dx (backward walk).
// Integer maps (orders, group offsets, repeats) come from ranks by ballots over each warp's contiguous slice of
// the sorted list, the warps' counts scanned in warp order: exact, and no bank conflicts.
//
// Scratch (per unit, int32 / float32 arrays sized from the shapes only, kernels/phase1.h
// phase1_cuda_scratch_bytes): a per-warp area (radix counters, then the rows of A / QK being summed), slot_of,
// two sort buffers (the second then holds the links), run_sum and, in the backward, the runs' log gradients. In
// dynamic shared memory when it fits kPhase1CudaSharedBytes; else the run arrays, the least used, in a global
// workspace (one slice per block) and the rest in shared memory when that fits (chunk 128 at W = R = 64: the
// sort and its walks from global memory took 2.5x as long); else all of it in the workspace. The same kernel
// code serves all three (a template argument, Phase1ScratchPlace, picks the base pointers). 1024 threads per
// block: one block per SM either way at the anchor shapes (shared memory), and the walks are latency-bound, so
// more warps per block hide more of it. tests/cuda_emu runs these kernels on the CPU against the CPU kernels.
//
// Every sum runs in an order fixed by the input, every output element has one writer, no atomics: the results
// are bitwise reproducible. Built with -fmad=false (CMakeLists.txt) to round like the CPU kernel.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/phase1.h"

namespace sdm {
namespace {

constexpr int kWarps = static_cast<int>(kPhase1CudaWarps);
constexpr int kThreads = 32 * kWarps;
constexpr unsigned kFull = 0xffffffffu;
// The link of an entry that is not a run head is -2 - (its head's seq): at most -2.
__device__ __forceinline__ bool is_head(int link) { return link >= -1; }
__device__ __forceinline__ int head_of(int seq, int link) { return is_head(link) ? seq : -2 - link; }
// The backward marks the sorted positions that start a group in their seq's bit 30 (seq < 2^22).
constexpr int kGroupStart = 1 << 30;
constexpr int kSeqMask = kGroupStart - 1;

// Per-unit sizes (all below 2^31: E <= kPhase1CudaMaxEntries).
struct Shape {
  int C, W, R, S, E, CW, CR;
  int passes;   // radix passes of 8 bits over the slots: ceil(bits(K - 1) / 8)
  float inv_S;  // 1 / S rounded to float (0 when S = 0): seq / S by one multiply and a correction
  int64_t K;
};

// An entry, decoded from its seq.
struct Ent {
  int t;  // token
  bool write;
  int id;  // t * W + n (write) or t * R + m (read)
};

// seq / S: seq < 2^23 is exact in float and the product is within 0.5 of the quotient (two roundings of
// relative 2^-24 each on a value below 2^22), so the truncation is off by at most one, which one step fixes.
__device__ __forceinline__ Ent decode(int seq, const Shape& s) {
  Ent e;
  e.t = static_cast<int>(static_cast<float>(seq) * s.inv_S);
  int lane = seq - e.t * s.S;
  if (lane < 0) {
    --e.t;
    lane += s.S;
  } else if (lane >= s.S) {
    ++e.t;
    lane -= s.S;
  }
  e.write = lane < s.W;
  e.id = e.write ? e.t * s.W + lane : e.t * s.R + (lane - s.W);
  return e;
}

// exp in double, rounded once to float: almost always the correctly rounded value, like the CPU kernel's
// std::exp on float (glibc, < 0.51 ulp), where CUDA's expf may be 2 ulp off. Phase 1 is a small part of the
// work; this keeps the CUDA and CPU kernels within a few float32 roundings of each other.
__device__ __forceinline__ float exp_f(float x) { return static_cast<float>(exp(static_cast<double>(x))); }

__device__ __forceinline__ bool valid_slot(int32_t slot, int64_t K) { return slot >= 0 && slot < K; }

// Block-wide exclusive scan of up to 4 int counters in thread order. All threads must call it. `sh` holds
// 32 * 4 ints of shared memory. Returns the exclusive prefix in `off` and the block totals in `tot`.
template <int kN>
__device__ __forceinline__ void block_scan(const int (&v)[kN], int (&off)[kN], int (&tot)[kN], int* sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
  int incl[kN];
#pragma unroll
  for (int c = 0; c < kN; ++c) {
    int x = v[c];
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(kFull, x, o);
      if (lane >= o) x += y;
    }
    incl[c] = x;
    if (lane == 31) sh[warp * 4 + c] = x;
  }
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int c = 0; c < kN; ++c) {
      int x = lane < n_warps ? sh[lane * 4 + c] : 0;
      for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(kFull, x, o);
        if (lane >= o) x += y;
      }
      if (lane < n_warps) sh[lane * 4 + c] = x;
    }
  }
  __syncthreads();
#pragma unroll
  for (int c = 0; c < kN; ++c) {
    off[c] = (warp > 0 ? sh[(warp - 1) * 4 + c] : 0) + incl[c] - v[c];
    tot[c] = sh[(n_warps - 1) * 4 + c];
  }
  __syncthreads();  // sh is reused by the next scan
}

// This warp's contiguous slice [beg, end) of [0, n), a multiple of 32 long (but the last).
__device__ __forceinline__ void warp_slice(int n, int& beg, int& end) {
  const int per = ((n + kWarps - 1) / kWarps + 31) & ~31;
  beg = min(n, static_cast<int>(threadIdx.x >> 5) * per);
  end = min(n, beg + per);
}

// Ranks in position order of the positions q in [0, n) flagged by `flags(q, f)` (f[c] = 1: counted by counter c),
// one rank sequence per counter: each warp takes its slice 32 positions at a time (consecutive lanes read
// consecutive positions: no bank conflicts) and ranks them by ballots; the warps' counts are scanned in warp
// order. Then `emit(q, f, rank, tot)` for every position. All threads must call it. Returns the counts in `tot`.
template <int kN, typename Flags, typename Emit>
__device__ __forceinline__ void ordered_ranks(int n, int* scan_sh, int (&tot)[kN], Flags flags, Emit emit) {
  const int lane = threadIdx.x & 31;
  const unsigned lower_lanes = (1u << lane) - 1u;
  int beg, end;
  warp_slice(n, beg, end);
  int cnt[kN], off[kN];
#pragma unroll
  for (int c = 0; c < kN; ++c) cnt[c] = 0;
  for (int b = beg; b < end; b += 32) {
    int f[kN] = {};
    if (b + lane < end) flags(b + lane, f);
#pragma unroll
    for (int c = 0; c < kN; ++c) cnt[c] += __popc(__ballot_sync(kFull, f[c] != 0));
  }
#pragma unroll
  for (int c = 0; c < kN; ++c) cnt[c] = lane == 0 ? cnt[c] : 0;
  block_scan<kN>(cnt, off, tot, scan_sh);
#pragma unroll
  for (int c = 0; c < kN; ++c) off[c] = __shfl_sync(kFull, off[c], 0);
  for (int b = beg; b < end; b += 32) {
    int f[kN] = {}, rank[kN];
    if (b + lane < end) flags(b + lane, f);
#pragma unroll
    for (int c = 0; c < kN; ++c) {
      const unsigned m = __ballot_sync(kFull, f[c] != 0);
      rank[c] = off[c] + __popc(m & lower_lanes);
      off[c] += __popc(m);
    }
    if (b + lane < end) emit(b + lane, f, rank, tot);
  }
}

// Hint: bring [p, p + n) into L1 (kL1) or L2, one line per thread and step.
template <bool kL1>
__device__ __forceinline__ void prefetch(const float* p, int64_t n) {
#ifdef __CUDA_ARCH__
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t o = static_cast<int64_t>(threadIdx.x) * 128; o < n * 4; o += static_cast<int64_t>(blockDim.x) * 128) {
    if (kL1) {
      asm volatile("prefetch.global.L1 [%0];" ::"l"(c + o));
    } else {
      asm volatile("prefetch.global.L2 [%0];" ::"l"(c + o));
    }
  }
#endif
}

// For every entry seq in [0, E), in seq order over the threads (coalesced): v = load(seq), then store(seq, v).
// Each thread loads kBatch entries before it stores any, so that their loads are in flight together (a store
// may alias a later load, which would otherwise keep the compiler from moving the loads up).
template <int kBatch, typename Load, typename Store>
__device__ __forceinline__ void for_each_entry(int E, Load load, Store store) {
  for (int q0 = threadIdx.x; q0 < E; q0 += kBatch * blockDim.x) {
    decltype(load(0)) v[kBatch];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      if (q0 + k * static_cast<int>(blockDim.x) < E) v[k] = load(q0 + k * blockDim.x);
    }
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      if (q0 + k * static_cast<int>(blockDim.x) < E) store(q0 + k * blockDim.x, v[k]);
    }
  }
}

// The scratch of one unit (kernels/phase1.h phase1_cuda_scratch_bytes: keep the two in sync).
struct Scratch {
  int* warp_area;  // kWarps * max(256, 2C): radix counters, then each warp's rows of A and QK
  int* slot_of;    // [E] slot of each entry, -1 when invalid
  int* buf0;       // [E] the sort's buffers; after it, the sorted seqs and the links
  int* buf1;       // [E]
  float* run_sum;  // [E] the run's weight sum, at its head's seq
  float* run_dlog; // [E] backward: the gradient of the run's log value, at its head's seq
};

// The scratch of this block: `shared` is the dynamic shared memory, `global` the block's workspace slice.
template <int kPlace>
__device__ __forceinline__ Scratch carve(unsigned char* shared, unsigned char* global, const Shape& s) {
  int* p = reinterpret_cast<int*>(kPlace == kScratchGlobal ? global : shared);
  Scratch sc;
  sc.warp_area = p;
  p += kWarps * max(256, 2 * s.C);
  sc.slot_of = p;
  p += s.E;
  sc.buf0 = p;
  p += s.E;
  sc.buf1 = p;
  p += s.E;
  if (kPlace == kScratchRunsGlobal) p = reinterpret_cast<int*>(global);
  sc.run_sum = reinterpret_cast<float*>(p);
  p += s.E;
  sc.run_dlog = reinterpret_cast<float*>(p);
  return sc;
}

// The active lanes whose 8-bit digit equals this lane's (meaningful for an active lane): one ballot per bit, which
// costs a fixed 9 votes where __match_any_sync's cost is not documented.
__device__ __forceinline__ unsigned same_digit_lanes(unsigned d, bool active) {
  unsigned peers = __ballot_sync(kFull, active);
#pragma unroll
  for (int bit = 0; bit < 8; ++bit) {
    const unsigned ones = __ballot_sync(kFull, (d >> bit) & 1u);
    peers &= (d >> bit) & 1u ? ones : ~ones;
  }
  return peers;
}

// One stable pass of the radix sort: the n seqs of `in`, ordered by the 8-bit digit of their slot at `shift`,
// into `out`. Warp w ranks the contiguous slice [w * L, (w + 1) * L) of `in`, 32 entries at a time in order:
// lanes with equal digits find each other by ballots, the lowest one updates the warp's count of that digit (no
// atomics). All threads must call it; ends synchronised.
__device__ void radix_pass(const int* in, int* out, int n, const int* slot_of, int shift, int* counts,
                           int* scan_sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int* own = counts + warp * 256;
  for (int d = lane; d < 256; d += 32) own[d] = 0;
  __syncwarp();
  int beg, end;
  warp_slice(n, beg, end);
  const unsigned lower_lanes = (1u << lane) - 1u;
  // Counts per digit.
  for (int b = beg; b < end; b += 32) {
    const int q = b + lane;
    const bool active = q < end;
    const unsigned d = active ? (static_cast<unsigned>(slot_of[in[q]]) >> shift) & 255u : 0u;
    const unsigned peers = same_digit_lanes(d, active);
    if (active && lane == __ffs(peers) - 1) own[d] += __popc(peers);
    __syncwarp();
  }
  __syncthreads();
  // Start of each (digit, warp) in the output: the counts scanned in (digit, warp) order.
  int digit_total[1] = {0};
  if (threadIdx.x < 256) {
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const int c = counts[w * 256 + threadIdx.x];
      counts[w * 256 + threadIdx.x] = digit_total[0];
      digit_total[0] += c;
    }
  }
  int digit_start[1], total[1];
  block_scan<1>(digit_total, digit_start, total, scan_sh);
  if (threadIdx.x < 256) {
#pragma unroll
    for (int w = 0; w < kWarps; ++w) counts[w * 256 + threadIdx.x] += digit_start[0];
  }
  __syncthreads();
  // Scatter, in the same order as the counting.
  for (int b = beg; b < end; b += 32) {
    const int q = b + lane;
    const bool active = q < end;
    const int seq = active ? in[q] : 0;
    const unsigned d = active ? (static_cast<unsigned>(slot_of[seq]) >> shift) & 255u : 0u;
    const unsigned peers = same_digit_lanes(d, active);
    const int first = active ? own[d] : 0;
    __syncwarp();
    if (active && lane == __ffs(peers) - 1) own[d] = first + __popc(peers);
    __syncwarp();
    if (active) out[first + __popc(peers & lower_lanes)] = seq;
  }
  __syncthreads();
}

// Step 1: slot_of, the valid seqs sorted (returned in `sorted`, the other sort buffer in `spare`), and their
// count (block-wide). `on_invalid(is_write, id)` is called once for each invalid entry. Ends synchronised.
template <typename OnInvalid>
__device__ int sort_unit(const Scratch& sc, const int32_t* ki, const int32_t* qi, const Shape& s, int* scan_sh,
                         int*& sorted, int*& spare, OnInvalid on_invalid) {
  struct Slot {
    Ent e;
    int32_t slot;
  };
  for_each_entry<4>(
      s.E,
      [&](int q) {
        const Ent e = decode(q, s);
        return Slot{e, e.write ? ki[e.id] : qi[e.id]};
      },
      [&](int q, const Slot& v) {
        const bool ok = valid_slot(v.slot, s.K);
        sc.slot_of[q] = ok ? v.slot : -1;
        if (!ok) on_invalid(v.e.write, v.e.id);
      });
  __syncthreads();
  // Compact the valid seqs in seq order.
  int tot[1];
  ordered_ranks<1>(
      s.E, scan_sh, tot, [&](int q, int(&f)[1]) { f[0] = sc.slot_of[q] >= 0; },
      [&](int q, const int(&f)[1], const int(&rank)[1], const int(&)[1]) {
        if (f[0]) sc.buf0[rank[0]] = q;
      });
  __syncthreads();
  const int n = tot[0];
  sorted = sc.buf0;
  spare = sc.buf1;
  for (int pass = 0; pass < s.passes; ++pass) {
    radix_pass(sorted, spare, n, sc.slot_of, 8 * pass, sc.warp_area, scan_sh);
    int* const t = sorted;
    sorted = spare;
    spare = t;
  }
  return n;
}

// Step 2's walk of the group starting at sorted position p (n valid entries): links and run sums as in the
// header comment; `on_entry(e, head, weight)` is called for each entry in sorted order (head: it starts a run).
// Returns the group's end.
template <typename OnEntry>
__device__ __forceinline__ int walk_runs(int p, int n, const int* sorted, const int* slot_of, int* link,
                                         float* run_sum, const float* k_val, const float* q_val, const Shape& s,
                                         OnEntry on_entry) {
  const int slot = slot_of[sorted[p]];
  int head = -1, last_write = -1;
  float sum = 0.0f;
  Ent prev{};
  int end = p;
  for (; end < n; ++end) {
    const int seq = sorted[end];
    if (end > p && slot_of[seq] != slot) break;
    const Ent e = decode(seq, s);
    const bool is_head = end == p || e.t != prev.t || e.write != prev.write;
    const float val = e.write ? k_val[e.id] : q_val[e.id];
    if (is_head) {
      if (head >= 0) run_sum[head] = sum;
      head = seq;
      sum = val;
      link[seq] = last_write;
      if (e.write) last_write = seq;
    } else {
      sum += val;
      link[seq] = -2 - head;
    }
    on_entry(e, is_head, val);
    prev = e;
  }
  if (head >= 0) run_sum[head] = sum;
  return end;
}

// Whether sorted position p starts a group.
__device__ __forceinline__ bool group_start(int p, const int* sorted, const int* slot_of) {
  return p == 0 || slot_of[sorted[p - 1]] != slot_of[sorted[p]];
}

// ---------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------

template <int kPlace>
__global__ void __launch_bounds__(kThreads, 1)
    phase1_fwd_kernel(Phase1Arrays all, Shape s, int64_t N, unsigned char* workspace, int64_t slice_bytes) {
  extern __shared__ __align__(16) unsigned char dyn_smem[];
  __shared__ int scan_sh[32 * 4];
  const Scratch sc = carve<kPlace>(dyn_smem, workspace + static_cast<int64_t>(blockIdx.x) * slice_bytes, s);
  const int* slot_of = sc.slot_of;
  float* run_sum = sc.run_sum;

  const int C = s.C, W = s.W, S = s.S, CW = s.CW, CR = s.CR;
  const int tid = threadIdx.x, T = blockDim.x;
  const int lane = tid & 31, warp = tid >> 5;

  for (int64_t u = blockIdx.x; u < N; u += gridDim.x) {
    const Phase1Arrays a = all.unit(u, C, W, s.R);
    // The inputs that steps 2 and 3 gather in sorted order.
    prefetch<true>(a.k_val, CW);
    prefetch<true>(a.x, CW);
    prefetch<true>(a.q_val, CR);

    // 1. Sorted seqs; the values of invalid entries.
    int *sorted, *link;
    const int n = sort_unit(sc, a.k_idx, a.q_idx, s, scan_sh, sorted, link, [&](bool write, int id) {
      if (write) {
        a.log_k[id] = 0.0f;
        a.rex[id] = 0.0f;
        a.cpe[id] = 1.0f;
        a.k_eff[id] = 0.0f;
        a.w[id] = 0.0f;
      } else {
        a.log_q[id] = 0.0f;
        a.q_w[id] = 0.0f;
      }
    });

    // Orders and repeats, ranked over the sorted list. The slot of each ordered entry is parked in `link`
    // (free until step 2) for the group offsets.
    int n_w, n_r;
    {
      int tot[3];  // writes, reads, repeats
      ordered_ranks<3>(
          n, scan_sh, tot,
          [&](int q, int(&f)[3]) {
            const int seq = sorted[q];
            const Ent e = decode(seq, s);
            f[0] = e.write;
            f[1] = !e.write;
            if (e.write && q > 0) {
              const int prev = sorted[q - 1];
              const Ent pe = decode(prev, s);
              f[2] = pe.write && pe.t == e.t && slot_of[prev] == slot_of[seq];
            }
          },
          [&](int q, const int(&f)[3], const int(&rank)[3], const int(&count)[3]) {
            const int seq = sorted[q];
            const Ent e = decode(seq, s);
            if (f[0]) {
              link[rank[0]] = slot_of[seq];
              a.w_order[rank[0]] = e.id;
            } else {
              link[count[0] + rank[1]] = slot_of[seq];
              a.r_order[rank[1]] = e.id;
            }
          });
      n_w = tot[0];
      n_r = tot[1];
      if (tid == 0) *a.repeats = tot[2];
      for (int c = n_w + tid; c < CW; c += T) a.w_order[c] = -1;
      for (int c = n_r + tid; c < CR; c += T) a.r_order[c] = -1;
    }
    __syncthreads();

    // Group offsets: a write (read) group starts where the slot of the ordered entries changes; the writes'
    // slots are link[0, n_w), the reads' link[n_w, n).
    {
      int tot[2];
      ordered_ranks<2>(
          n, scan_sh, tot,
          [&](int c, int(&f)[2]) {
            const bool starts = c == 0 || c == n_w || link[c - 1] != link[c];
            f[0] = c < n_w && starts;
            f[1] = c >= n_w && starts;
          },
          [&](int c, const int(&f)[2], const int(&rank)[2], const int(&)[2]) {
            if (f[0]) a.w_group[rank[0]] = c;
            if (f[1]) a.r_group[rank[1]] = c - n_w;
          });
      for (int g = tot[0] + tid; g <= CW; g += T) a.w_group[g] = n_w;
      for (int g = tot[1] + tid; g <= CR; g += T) a.r_group[g] = n_r;
    }
    __syncthreads();  // `link` is overwritten next

    // 2. Group walks, one thread per group: log values, links and run sums; then rex and cpe.
    for (int p = tid; p < n; p += T) {
      if (!group_start(p, sorted, slot_of)) continue;
      float run = 0.0f;
      const int end = walk_runs(p, n, sorted, slot_of, link, run_sum, a.k_val, a.q_val, s,
                                [&](const Ent& e, bool head, float) {
                                  if (e.write) {
                                    run += head ? a.x[e.id] : 0.0f;
                                    a.log_k[e.id] = run;
                                  } else {
                                    a.log_q[e.id] = run;
                                  }
                                });
      const float decay = exp_f(run);
      float suffix = 0.0f;
      for (int q = end - 1; q >= p; --q) {
        const int seq = sorted[q];
        const Ent e = decode(seq, s);
        if (!e.write) continue;
        a.rex[e.id] = suffix;
        a.cpe[e.id] = decay;
        suffix += is_head(link[seq]) ? a.x[e.id] : 0.0f;
      }
    }
    __syncthreads();

    // The weights, in seq order (coalesced), from the log values and rex just written (visible to the block
    // after the barrier).
    struct Weight {
      Ent e;
      float val, log, rex;  // rex: writes only
    };
    for_each_entry<4>(
        s.E,
        [&](int seq) {
          Weight v{decode(seq, s), 0.0f, 0.0f, 0.0f};
          if (slot_of[seq] >= 0) {
            v.val = v.e.write ? a.k_val[v.e.id] : a.q_val[v.e.id];
            v.log = v.e.write ? a.log_k[v.e.id] : a.log_q[v.e.id];
            if (v.e.write) v.rex = a.rex[v.e.id];
          }
          return v;
        },
        [&](int seq, const Weight& v) {
          if (slot_of[seq] < 0) return;
          if (v.e.write) {
            a.k_eff[v.e.id] = v.val * exp_f(v.log);
            a.w[v.e.id] = v.val * exp_f(v.rex);
          } else {
            a.q_w[v.e.id] = v.val * exp_f(v.log);
          }
        });

    // 3. Pair sums, one warp per token row i, summed in the warp's copy of the row: its write heads (lanes
    //    ascending) meet the earlier write heads of their group (A, j < i), then its read heads (QK, j <= i).
    float* row_a = reinterpret_cast<float*>(sc.warp_area) + static_cast<int64_t>(warp) * 2 * C;
    float* row_qk = row_a + C;
    for (int i = warp; i < C; i += kWarps) {
      for (int j = lane; j < C; j += 32) {
        row_a[j] = 0.0f;
        row_qk[j] = 0.0f;
      }
      __syncwarp();
      for (int l0 = 0; l0 < S; l0 += 32) {
        const int l = l0 + lane, seq = i * S + l;
        const bool pairs = l < S && slot_of[seq] >= 0 && link[seq] >= 0;
        for (unsigned m = __ballot_sync(kFull, pairs); m != 0; m &= m - 1) {
          if (lane == __ffs(m) - 1) {
            const bool write = l < W;
            float* row = write ? row_a : row_qk;
            const float as = run_sum[seq];
            float x = write ? a.x[i * W + l] : 0.0f;
            for (int b = link[seq]; b >= 0; b = link[b]) {
              const Ent eb = decode(b, s);
              row[eb.t] += as * run_sum[b] * exp_f(x);
              x += a.x[eb.id];
            }
          }
          __syncwarp();
        }
      }
      for (int j = lane; j < C; j += 32) {
        a.A[static_cast<int64_t>(i) * C + j] = row_a[j];
        a.QK[static_cast<int64_t>(i) * C + j] = row_qk[j];
      }
      __syncwarp();
    }
    __syncthreads();  // the scratch is reused by the next unit
  }
}

// ---------------------------------------------------------------------------
// Backward
// ---------------------------------------------------------------------------

template <int kPlace>
__global__ void __launch_bounds__(kThreads, 1)
    phase1_bwd_kernel(Phase1GradArrays all, Shape s, int64_t N, unsigned char* workspace, int64_t slice_bytes) {
  extern __shared__ __align__(16) unsigned char dyn_smem[];
  __shared__ int scan_sh[32 * 4];
  const Scratch sc = carve<kPlace>(dyn_smem, workspace + static_cast<int64_t>(blockIdx.x) * slice_bytes, s);
  const int* slot_of = sc.slot_of;
  float* run_sum = sc.run_sum;
  float* run_dlog = sc.run_dlog;

  const int C = s.C;
  const int tid = threadIdx.x, T = blockDim.x;

  for (int64_t u = blockIdx.x; u < N; u += gridDim.x) {
    const Phase1GradArrays a = all.unit(u, C, s.W, s.R);
    // What steps 2 to 4 gather in sorted order: the inputs of the walks in L1, the rest in L2.
    prefetch<true>(a.k_val, s.CW);
    prefetch<true>(a.q_val, s.CR);
    prefetch<true>(a.x, s.CW);
    for (const float* p : {a.log_k, a.rex, a.cpe, a.dk_eff, a.dw, a.dcpe}) prefetch<false>(p, s.CW);
    for (const float* p : {a.log_q, a.dq_w}) prefetch<false>(p, s.CR);
    prefetch<false>(a.dA, static_cast<int64_t>(C) * C);
    prefetch<false>(a.dQK, static_cast<int64_t>(C) * C);

    // 1. Sorted seqs; invalid entries get zero gradients.
    int *sorted, *link;
    const int n = sort_unit(sc, a.k_idx, a.q_idx, s, scan_sh, sorted, link, [&](bool write, int id) {
      if (write) {
        a.dk_val[id] = 0.0f;
        a.dx[id] = 0.0f;
      } else {
        a.dq_val[id] = 0.0f;
      }
    });

    // 2. Links and run sums, one thread per group.
    for (int p = tid; p < n; p += T) {
      if (group_start(p, sorted, slot_of)) {
        walk_runs(p, n, sorted, slot_of, link, run_sum, a.k_val, a.q_val, s, [](const Ent&, bool, float) {});
      }
    }
    __syncthreads();

    // The group starts, marked in `sorted` (kGroupStart): slot_of is free from here on and holds the runs'
    // weight gradients (at their heads' seqs). Every thread runs the same number of rounds (barriers).
    for (int q0 = 0; q0 < n; q0 += T) {
      const int q = q0 + tid;
      const bool start = q < n && (q == 0 || slot_of[sorted[q - 1] & kSeqMask] != slot_of[sorted[q]]);
      __syncthreads();
      if (start) sorted[q] |= kGroupStart;
      __syncthreads();
    }
    float* run_dsum = reinterpret_cast<float*>(sc.slot_of);

    // 3. Pair gradients, one thread per run head: the gradients of its run's weight sum (run_dsum) and log value
    //    (run_dlog). Pair (a later run, b earlier write run), cotangent c: ce = c exp(X_ab) (X_ab = L_a - L_b,
    //    summed), d sum_a += ce sum_b, d sum_b += ce sum_a, d L_a += ce sum_a sum_b, d L_b -= ce sum_a sum_b.
    for (int p = tid; p < n; p += T) {
      const int seq = sorted[p] & kSeqMask;
      if (!is_head(link[seq])) continue;
      const Ent e = decode(seq, s);
      const float as = run_sum[seq];
      const float* c_row = (e.write ? a.dA : a.dQK) + static_cast<int64_t>(e.t) * C;
      float dsum = 0.0f, dlog = 0.0f;
      // As the later run: the earlier write heads of the group, nearest first.
      float x = e.write ? a.x[e.id] : 0.0f;
      for (int b = link[seq]; b >= 0; b = link[b]) {
        const Ent eb = decode(b, s);
        const float bs = run_sum[b];
        const float ce = c_row[eb.t] * exp_f(x);
        dsum += ce * bs;
        dlog += ce * as * bs;
        x += a.x[eb.id];
      }
      if (e.write) {
        // As the earlier write run: the later heads of the group (writes and reads) in sorted order.
        float x_later = 0.0f;  // the gates of the write heads after this one, up to the later run
        for (int q = p + 1; q < n; ++q) {
          const int marked = sorted[q];
          if (marked & kGroupStart) break;
          const int later = marked & kSeqMask;
          if (!is_head(link[later])) continue;
          const Ent el = decode(later, s);
          const float a_sum = run_sum[later];
          if (el.write) x_later += a.x[el.id];
          const float* dm = el.write ? a.dA : a.dQK;
          const float ce = dm[static_cast<int64_t>(el.t) * C + e.t] * exp_f(x_later);
          dsum += ce * a_sum;
          dlog -= ce * a_sum * as;
        }
      }
      run_dsum[seq] = dsum;
      run_dlog[seq] = dlog;
    }
    __syncthreads();

    // 4. Per entry, in seq order (coalesced; validity from the ids, slot_of now holds run_dsum): the weight
    //    gradient (through k_eff and w, or q_w, plus its run's pair part), its log gradient (plus its run's, at
    //    the head) in place of run_dlog, and a write's rex gradient (in run_sum, free after step 3).
    float* drex = run_sum;
    struct EntryGrad {
      Ent e;
      bool valid;
      int link;
      float dsum, val, log, dlog_w, rex, dw;  // (dk_eff, log_k, k_val, rex, dw) or (dq_w, log_q, q_val)
    };
    for_each_entry<2>(
        s.E,
        [&](int seq) {
          EntryGrad v{};
          v.e = decode(seq, s);
          v.valid = valid_slot(v.e.write ? a.k_idx[v.e.id] : a.q_idx[v.e.id], s.K);
          if (v.valid) {
            v.link = link[seq];
            v.dsum = run_dsum[head_of(seq, v.link)];
            const int id = v.e.id;
            v.val = v.e.write ? a.k_val[id] : a.q_val[id];
            v.log = v.e.write ? a.log_k[id] : a.log_q[id];
            v.dlog_w = v.e.write ? a.dk_eff[id] : a.dq_w[id];
            if (v.e.write) {
              v.rex = a.rex[id];
              v.dw = a.dw[id];
            }
          }
          return v;
        },
        [&](int seq, const EntryGrad& v) {
          if (!v.valid) return;
          const float el = exp_f(v.log);
          float dl;
          if (v.e.write) {
            const float er = exp_f(v.rex);
            a.dk_val[v.e.id] = v.dlog_w * el + v.dw * er + v.dsum;
            dl = v.dlog_w * (v.val * el);
            drex[seq] = v.dw * (v.val * er);
          } else {
            a.dq_val[v.e.id] = v.dlog_w * el + v.dsum;
            dl = v.dlog_w * (v.val * el);
          }
          run_dlog[seq] = is_head(v.link) ? dl + run_dlog[seq] : dl;
        });
    __syncthreads();

    // 5. Gates, one thread per group. Forward walk: the group total's gradient, and each write's exclusive prefix
    //    of the rex gradients in place of its own. Backward walk: the suffix sums of the log gradients, and dx of
    //    a head = (suffix from it) + (prefix before it) + (total); repeats get 0.
    for (int p = tid; p < n; p += T) {
      if (!(sorted[p] & kGroupStart)) continue;
      float dtotal = 0.0f, prefix = 0.0f;
      int end = p;
      for (; end < n; ++end) {
        const int marked = sorted[end];
        if (end > p && (marked & kGroupStart)) break;
        const int seq = marked & kSeqMask;
        const Ent e = decode(seq, s);
        if (e.write) {
          dtotal += a.dcpe[e.id] * a.cpe[e.id];
          const float own = drex[seq];
          drex[seq] = prefix;
          prefix += own;
        }
      }
      float suffix = 0.0f;
      for (int q = end - 1; q >= p; --q) {
        const int seq = sorted[q] & kSeqMask;
        suffix += run_dlog[seq];
        const Ent e = decode(seq, s);
        if (e.write) a.dx[e.id] = is_head(link[seq]) ? suffix + drex[seq] + dtotal : 0.0f;
      }
    }
    __syncthreads();  // the scratch is reused by the next unit
  }
}

// ---------------------------------------------------------------------------
// Launch
// ---------------------------------------------------------------------------

Shape make_shape(const Phase1Dims& d) {
  Shape s;
  s.C = static_cast<int>(d.C);
  s.W = static_cast<int>(d.W);
  s.R = static_cast<int>(d.R);
  s.S = static_cast<int>(d.lanes());
  s.E = static_cast<int>(d.entries());
  s.CW = static_cast<int>(d.C * d.W);
  s.CR = static_cast<int>(d.C * d.R);
  s.K = d.K;
  s.inv_S = s.S > 0 ? 1.0f / static_cast<float>(s.S) : 0.0f;
  int bits = 0;  // of the largest valid slot, K - 1
  for (int64_t v = d.K - 1; v > 0; v >>= 1) ++bits;
  s.passes = (bits + 7) / 8;
  return s;
}

bool fits(int64_t N, int64_t C, int64_t W, int64_t R) {
  return N >= 0 && C >= 0 && W >= 0 && R >= 0 && C * (W + R) <= kPhase1CudaMaxEntries &&
         C <= kPhase1CudaMaxEntries;
}

// Launches the kernel for the scratch's place (kernels/phase1.h phase1_cuda_scratch_place), from the shapes:
// one block per unit with all of it in shared memory, else at most kPhase1CudaGlobalBlocks blocks with a
// workspace slice each.
template <typename Args>
int launch(void (*const (&kernels)[3])(Args, Shape, int64_t, unsigned char*, int64_t), const Args& args,
           const Shape& s, int64_t N, bool backward, void* workspace, int64_t workspace_bytes, cudaStream_t stream) {
  const Phase1ScratchPlace place = phase1_cuda_scratch_place(s.C, s.W, s.R, backward);
  const auto kernel = kernels[place];
  const int64_t smem = place == kScratchShared      ? phase1_cuda_scratch_bytes(s.C, s.W, s.R, backward)
                       : place == kScratchRunsGlobal ? phase1_cuda_base_bytes(s.C, s.W, s.R)
                                                     : 0;
  const int64_t slice = phase1_cuda_slice_bytes(s.C, s.W, s.R, backward);
  const int64_t blocks = place == kScratchShared ? std::min<int64_t>(N, int64_t{1} << 30)
                                                 : std::min<int64_t>(N, kPhase1CudaGlobalBlocks);
  if (slice > 0 && (workspace == nullptr || workspace_bytes < blocks * slice ||
                    reinterpret_cast<uintptr_t>(workspace) % 16 != 0)) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  if (smem > 0) {
    // Dynamic plus static shared memory may pass 48 KB even when the scratch alone does not: always raise the
    // limit to the scratch (idempotent).
    const cudaError_t e =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (e != cudaSuccess) return static_cast<int>(e);
  }
  kernel<<<static_cast<unsigned>(blocks), kThreads, static_cast<size_t>(smem), stream>>>(
      args, s, N, static_cast<unsigned char*>(workspace), slice);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int phase1_cuda(const Phase1Arrays& a, const Phase1Dims& d, void* workspace, int64_t workspace_bytes,
                CUstream_st* stream) {
  if (!fits(d.N, d.C, d.W, d.R)) return static_cast<int>(cudaErrorInvalidValue);
  if (d.N == 0) return static_cast<int>(cudaSuccess);
  static void (*const kernels[3])(Phase1Arrays, Shape, int64_t, unsigned char*, int64_t) = {
      phase1_fwd_kernel<kScratchShared>, phase1_fwd_kernel<kScratchRunsGlobal>, phase1_fwd_kernel<kScratchGlobal>};
  return launch<Phase1Arrays>(kernels, a, make_shape(d), d.N, false, workspace, workspace_bytes, stream);
}

int phase1_bwd_cuda(const Phase1GradArrays& a, const Phase1Dims& d, void* workspace, int64_t workspace_bytes,
                    CUstream_st* stream) {
  if (!fits(d.N, d.C, d.W, d.R)) return static_cast<int>(cudaErrorInvalidValue);
  if (d.N == 0) return static_cast<int>(cudaSuccess);
  static void (*const kernels[3])(Phase1GradArrays, Shape, int64_t, unsigned char*, int64_t) = {
      phase1_bwd_kernel<kScratchShared>, phase1_bwd_kernel<kScratchRunsGlobal>, phase1_bwd_kernel<kScratchGlobal>};
  return launch<Phase1GradArrays>(kernels, a, make_shape(d), d.N, true, workspace, workspace_bytes, stream);
}

}  // namespace sdm
