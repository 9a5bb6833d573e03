// Phase 1 and its backward on the GPU (docs/DESIGN.md "Phase 1", "Phase-1 backward"; SPEC 1.3, 1.4). The same
// arrays as kernels/phase1_cpu.cc, the same sums in the same order where it matters (segmented scans, run sums,
// the per-run pair gradients), so the two agree to float32 rounding (exp may differ in the last bit, and the
// cells of A / QK add their per-slot terms in another order).
//
// One thread block per unit (grid-stride over the units). Per unit:
//  1. Every entry e in [0, E), E = C * (W + R), with e = t * (W + R) + lane (write lanes 0..W-1, read lanes
//     W..W+R-1), gets the key (slot << 32) | e, slot 0x7fffffff for an invalid entry (it sorts after every valid
//     one); the keys are padded to the next power of two with ~0 and sorted by a bitonic sort. The keys are
//     unique, so the order is (slot, token, write-before-read, lane): the stable order of SPEC 1.3, and the
//     sorted position of an entry is found again by a binary search for its key.
//  2. A *run* is a maximal block of sorted entries of one (slot, token, kind). A write run is a first occurrence
//     (its head) followed by the repeats of that slot in that token; log_k is constant over it, and so is log_q
//     over a read run. The heads are compacted in sorted order (block-wide scans of per-thread counts) with the
//     sum of their run's weights (lane order) and the run's gate (its head's).
//  3. Group walks: one thread per group (run of one slot) walks it sequentially, as the CPU does: inclusive
//     prefix of the gates (log_k, log_q), the exclusive suffix for rex by its own backward walk, the total.
//  4. Forward pairs: one thread per token row i of A and QK; for each write head (read head) a of token i, in
//     lane order, the earlier write heads b of its group, nearest first, add K_a K_b exp(X_ab) to A[i, t_b]
//     (QK[i, t_b]). One writer per row. X_ab = L_a - L_b is summed directly, from a down to b, over the gates
//     of the heads after b (a read run's gate is 0), never taken as a difference of log values: that would
//     give -inf - -inf = NaN for a gate of -inf and cancel every digit of the small part next to a gate of
//     -1e30.
//     Backward pairs: one thread per head (write or read) accumulates the gradient of its run's weight sum and
//     log value over the pairs it is part of: first the earlier write heads, nearest first (as the later run),
//     then the later runs of its group in sorted order (as the earlier write run): the CPU's accumulation
//     order (the exponents of the second kind are summed from b up to a, the CPU's from a down to b: they may
//     differ in the last bit). It writes dk_val / dq_val of its run's entries (one writer per entry).
//  5. Backward gates: one thread per group: the total's gradient (forward), the suffix sums of the log
//     gradients (backward walk), the prefix sums of the rex gradients and dx (forward walk).
// Integer maps (orders, group offsets, repeats) come from block-wide exclusive scans of per-thread counts over
// contiguous chunks of the sorted list: exact and independent of the thread count.
//
// Scratch (per unit, sizes from the shapes only, kernels/phase1.h phase1_cuda_scratch_bytes): the keys and the
// head arrays. In dynamic shared memory when it fits kPhase1CudaSharedBytes, else in a global workspace, one slice
// per block. The same kernel code serves both (a template flag picks the base pointer).
//
// Every sum runs in an order fixed by the input, every output element has one writer, no atomics: the results
// are bitwise reproducible. Built with -fmad=false (CMakeLists.txt) to round like the CPU kernel.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/phase1.h"

namespace sdm {
namespace {

constexpr uint32_t kInvalidSlot = 0x7fffffffu;
constexpr uint64_t kPadKey = ~0ull;
constexpr int kMaxThreads = 512;

// Per-unit sizes (all below 2^31: E <= kPhase1CudaMaxEntries).
struct Shape {
  int C, W, R, S, E, P2, CW, CR;
  int64_t K;
};

// A decoded sort key.
struct Ent {
  uint32_t slot;
  int t;        // token
  bool write;
  int id;       // t * W + n (write) or t * R + m (read)
};

__device__ __forceinline__ Ent decode(uint64_t key, const Shape& s) {
  Ent e;
  e.slot = static_cast<uint32_t>(key >> 32);
  const int seq = static_cast<int>(static_cast<uint32_t>(key));
  e.t = seq / s.S;
  const int lane = seq - e.t * s.S;
  e.write = lane < s.W;
  e.id = e.write ? e.t * s.W + lane : e.t * s.R + (lane - s.W);
  return e;
}

__device__ __forceinline__ int token_of(uint64_t key, const Shape& s) {
  return static_cast<int>(static_cast<uint32_t>(key)) / s.S;
}

// Same run: same slot, token and kind (b directly follows a in sorted order).
__device__ __forceinline__ bool same_run(const Ent& a, const Ent& b) {
  return a.slot == b.slot && a.t == b.t && a.write == b.write;
}

// exp in double, rounded once to float: almost always the correctly rounded value, like the CPU kernel's
// std::exp on float (glibc, < 0.51 ulp), where CUDA's expf may be 2 ulp off. Phase 1 is a small part of the
// work; this keeps the CUDA and CPU kernels within a few float32 roundings of each other.
__device__ __forceinline__ float exp_f(float x) { return static_cast<float>(exp(static_cast<double>(x))); }

__device__ __forceinline__ uint64_t slot_key(uint32_t slot) { return static_cast<uint64_t>(slot) << 32; }

// First index in [lo, hi) with a[i] >= v (a ascending).
template <typename T>
__device__ __forceinline__ int lower_bound(const T* a, int lo, int hi, T v) {
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (a[mid] < v) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

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
      const int y = __shfl_up_sync(0xffffffffu, x, o);
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
        const int y = __shfl_up_sync(0xffffffffu, x, o);
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

// Bitonic sort of n (a power of two) keys, ascending. All threads must call it; ends synchronised.
__device__ __forceinline__ void bitonic_sort(uint64_t* keys, int n) {
  __syncthreads();
  for (int k = 2; k <= n; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int q = threadIdx.x; q < (n >> 1); q += blockDim.x) {
        const int i = ((q & ~(j - 1)) << 1) | (q & (j - 1));  // bit j of i is clear
        const int l = i | j;
        const uint64_t a = keys[i], b = keys[l];
        const bool up = (i & k) == 0;
        if ((a > b) == up) {
          keys[i] = b;
          keys[l] = a;
        }
      }
      __syncthreads();
    }
  }
}

// Contiguous chunk [lo, hi) of [0, n) for this thread.
__device__ __forceinline__ void chunk_of(int n, int& lo, int& hi) {
  const int chunk = (n + static_cast<int>(blockDim.x) - 1) / static_cast<int>(blockDim.x);
  lo = min(n, static_cast<int>(threadIdx.x) * chunk);
  hi = min(n, lo + chunk);
}

__device__ __forceinline__ bool valid_slot(int32_t slot, int64_t K) { return slot >= 0 && slot < K; }

// Builds the unit's keys (padded to P2) and returns, block-wide, the number of valid entries. `on_invalid(is_write,
// id)` is called once for each invalid entry. Ends synchronised with the keys sorted.
template <typename OnInvalid>
__device__ __forceinline__ int sort_unit(uint64_t* keys, const int32_t* ki, const int32_t* qi, const Shape& s,
                                         int* scan_sh, OnInvalid on_invalid) {
  int n_valid[1] = {0};
  for (int q = threadIdx.x; q < s.P2; q += blockDim.x) {
    uint64_t key = kPadKey;
    if (q < s.E) {
      const int t = q / s.S, lane = q - t * s.S;
      const bool write = lane < s.W;
      const int id = write ? t * s.W + lane : t * s.R + (lane - s.W);
      const int32_t slot = write ? ki[id] : qi[id];
      if (valid_slot(slot, s.K)) {
        key = slot_key(static_cast<uint32_t>(slot)) | static_cast<uint32_t>(q);
        ++n_valid[0];
      } else {
        key = slot_key(kInvalidSlot) | static_cast<uint32_t>(q);
        on_invalid(write, id);
      }
    }
    keys[q] = key;
  }
  int off[1], tot[1];
  block_scan<1>(n_valid, off, tot, scan_sh);
  bitonic_sort(keys, s.P2);
  return tot[0];
}

// ---------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------

template <bool kShared>
__global__ void __launch_bounds__(kMaxThreads, 1)
    phase1_fwd_kernel(Phase1Arrays all, Shape s, int64_t N, unsigned char* workspace, int64_t scratch_bytes) {
  extern __shared__ __align__(16) unsigned char dyn_smem[];
  __shared__ int scan_sh[32 * 4];
  unsigned char* base = kShared ? dyn_smem : workspace + static_cast<int64_t>(blockIdx.x) * scratch_bytes;
  uint64_t* keys = reinterpret_cast<uint64_t*>(base);
  int* hpos = reinterpret_cast<int*>(base + 8 * static_cast<int64_t>(s.P2));  // sorted position of write head h
  float* hsum = reinterpret_cast<float*>(hpos + s.CW);                       // its run's weight sum
  float* hgate = hsum + s.CW;                                                 // its gate

  const int C = s.C, W = s.W, R = s.R, S = s.S, CW = s.CW, CR = s.CR;
  const int tid = threadIdx.x, T = blockDim.x;

  for (int64_t u = blockIdx.x; u < N; u += gridDim.x) {
    const Phase1Arrays a = all.unit(u, C, W, R);

    // 1. Keys, sorted; the values of invalid entries; A and QK zeroed (their rows are accumulated in step 4).
    for (int64_t c = tid; c < static_cast<int64_t>(C) * C; c += T) {
      a.A[c] = 0.0f;
      a.QK[c] = 0.0f;
    }
    const int n_valid = sort_unit(keys, a.k_idx, a.q_idx, s, scan_sh, [&](bool write, int id) {
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

    // 2. Orders, write heads and repeats: counts over contiguous chunks of the sorted list, scanned.
    int n_w, n_r, n_heads;
    {
      int lo, hi;
      chunk_of(n_valid, lo, hi);
      int cnt[4] = {0, 0, 0, 0};  // writes, reads, write heads, repeats
      Ent prev{};
      if (lo > 0 && lo < hi) prev = decode(keys[lo - 1], s);
      for (int q = lo; q < hi; ++q) {
        const Ent e = decode(keys[q], s);
        const bool cont = q > 0 && same_run(prev, e);
        if (e.write) {
          ++cnt[0];
          if (cont) {
            ++cnt[3];
          } else {
            ++cnt[2];
          }
        } else {
          ++cnt[1];
        }
        prev = e;
      }
      int off[4], tot[4];
      block_scan<4>(cnt, off, tot, scan_sh);
      if (lo > 0 && lo < hi) prev = decode(keys[lo - 1], s);
      for (int q = lo; q < hi; ++q) {
        const Ent e = decode(keys[q], s);
        const bool cont = q > 0 && same_run(prev, e);
        if (e.write) {
          a.w_order[off[0]++] = e.id;
          if (!cont) hpos[off[2]++] = q;
        } else {
          a.r_order[off[1]++] = e.id;
        }
        prev = e;
      }
      n_w = tot[0];
      n_r = tot[1];
      n_heads = tot[2];
      if (tid == 0) *a.repeats = tot[3];
      for (int c = n_w + tid; c < CW; c += T) a.w_order[c] = -1;
      for (int c = n_r + tid; c < CR; c += T) a.r_order[c] = -1;
    }
    __syncthreads();

    // 3a. Group offsets: a write (read) group starts where the slot of the ordered entries changes.
    {
      int wlo, whi, rlo, rhi;
      chunk_of(n_w, wlo, whi);
      chunk_of(n_r, rlo, rhi);
      int cnt[2] = {0, 0};
      for (int c = wlo; c < whi; ++c) cnt[0] += (c == 0 || a.k_idx[a.w_order[c - 1]] != a.k_idx[a.w_order[c]]) ? 1 : 0;
      for (int c = rlo; c < rhi; ++c) cnt[1] += (c == 0 || a.q_idx[a.r_order[c - 1]] != a.q_idx[a.r_order[c]]) ? 1 : 0;
      int off[2], tot[2];
      block_scan<2>(cnt, off, tot, scan_sh);
      for (int c = wlo; c < whi; ++c) {
        if (c == 0 || a.k_idx[a.w_order[c - 1]] != a.k_idx[a.w_order[c]]) a.w_group[off[0]++] = c;
      }
      for (int c = rlo; c < rhi; ++c) {
        if (c == 0 || a.q_idx[a.r_order[c - 1]] != a.q_idx[a.r_order[c]]) a.r_group[off[1]++] = c;
      }
      for (int g = tot[0] + tid; g <= CW; g += T) a.w_group[g] = n_w;
      for (int g = tot[1] + tid; g <= CR; g += T) a.r_group[g] = n_r;
    }

    // 3b. Group walks, one thread per group (its first sorted position p).
    for (int p = tid; p < n_valid; p += T) {
      const uint32_t slot = static_cast<uint32_t>(keys[p] >> 32);
      if (p > 0 && static_cast<uint32_t>(keys[p - 1] >> 32) == slot) continue;
      int h = lower_bound(hpos, 0, n_heads, p);  // the group's first write head
      float run = 0.0f, head_sum = 0.0f, head_gate = 0.0f;
      bool open = false;
      Ent prev{};
      int end = p;
      for (; end < n_valid; ++end) {
        const uint64_t key = keys[end];
        if (static_cast<uint32_t>(key >> 32) != slot) break;
        const Ent e = decode(key, s);
        if (e.write) {
          const bool repeat = end > p && same_run(prev, e);
          const float k = a.k_val[e.id];
          run += repeat ? 0.0f : a.x[e.id];
          if (repeat) {
            head_sum += k;
          } else {
            if (open) {
              hsum[h] = head_sum;
              hgate[h] = head_gate;
              ++h;
            }
            open = true;
            head_sum = k;
            head_gate = a.x[e.id];
          }
          a.log_k[e.id] = run;
          a.k_eff[e.id] = k * exp_f(run);
        } else {
          a.log_q[e.id] = run;
          a.q_w[e.id] = a.q_val[e.id] * exp_f(run);
        }
        prev = e;
      }
      if (open) {
        hsum[h] = head_sum;
        hgate[h] = head_gate;
      }
      const float decay = exp_f(run);
      float suffix = 0.0f;
      for (int q = end - 1; q >= p; --q) {
        const Ent e = decode(keys[q], s);
        if (!e.write) continue;
        const bool repeat = q > p && same_run(decode(keys[q - 1], s), e);
        a.rex[e.id] = suffix;
        a.w[e.id] = a.k_val[e.id] * exp_f(suffix);
        a.cpe[e.id] = decay;
        suffix += repeat ? 0.0f : a.x[e.id];
      }
    }
    __syncthreads();

    // 4. Pair sums, one thread per token row: its write heads (lanes ascending) meet the earlier write heads of
    //    their group (A, j < i), then its read heads (QK, j <= i).
    for (int i = tid; i < C; i += T) {
      float* a_row = a.A + static_cast<int64_t>(i) * C;
      float* qk_row = a.QK + static_cast<int64_t>(i) * C;
      for (int n = 0; n < W; ++n) {
        const int32_t slot = a.k_idx[i * W + n];
        if (!valid_slot(slot, s.K)) continue;
        const uint32_t us = static_cast<uint32_t>(slot);
        const int p = lower_bound(keys, 0, n_valid, slot_key(us) | static_cast<uint32_t>(i * S + n));
        if (p > 0) {
          const Ent pr = decode(keys[p - 1], s);
          if (pr.write && pr.slot == us && pr.t == i) continue;  // a repeat: counted in its head's run
        }
        const int h = lower_bound(hpos, 0, n_heads, p);
        const int g0 = lower_bound(hpos, 0, h, lower_bound(keys, 0, p, slot_key(us)));
        const float as = hsum[h];
        float x = hgate[h];
        for (int b = h - 1; b >= g0; --b) {
          const int j = token_of(keys[hpos[b]], s);
          a_row[j] += as * hsum[b] * exp_f(x);
          x += hgate[b];
        }
      }
      for (int m = 0; m < R; ++m) {
        const int32_t slot = a.q_idx[i * R + m];
        if (!valid_slot(slot, s.K)) continue;
        const uint32_t us = static_cast<uint32_t>(slot);
        const int p = lower_bound(keys, 0, n_valid, slot_key(us) | static_cast<uint32_t>(i * S + W + m));
        if (p > 0) {
          const Ent pr = decode(keys[p - 1], s);
          if (!pr.write && pr.slot == us && pr.t == i) continue;  // not the first read of its run
        }
        float qs = a.q_val[i * R + m];
        for (int q = p + 1; q < n_valid; ++q) {
          const Ent e = decode(keys[q], s);
          if (e.write || e.slot != us || e.t != i) break;
          qs += a.q_val[e.id];
        }
        const int h_end = lower_bound(hpos, 0, n_heads, p);
        const int g0 = lower_bound(hpos, 0, h_end, lower_bound(keys, 0, p, slot_key(us)));
        float x = 0.0f;
        for (int b = h_end - 1; b >= g0; --b) {
          const int j = token_of(keys[hpos[b]], s);
          qk_row[j] += qs * hsum[b] * exp_f(x);
          x += hgate[b];
        }
      }
    }
    __syncthreads();  // the scratch is reused by the next unit
  }
}

// ---------------------------------------------------------------------------
// Backward
// ---------------------------------------------------------------------------

template <bool kShared>
__global__ void __launch_bounds__(kMaxThreads, 1)
    phase1_bwd_kernel(Phase1GradArrays all, Shape s, int64_t N, unsigned char* workspace, int64_t scratch_bytes) {
  extern __shared__ __align__(16) unsigned char dyn_smem[];
  __shared__ int scan_sh[32 * 4];
  unsigned char* base = kShared ? dyn_smem : workspace + static_cast<int64_t>(blockIdx.x) * scratch_bytes;
  uint64_t* keys = reinterpret_cast<uint64_t*>(base);
  // Write heads: sorted position, run weight sum, gate, gradient of the run's log value; read heads the same
  // without the gate (0).
  int* whpos = reinterpret_cast<int*>(base + 8 * static_cast<int64_t>(s.P2));
  float* whsum = reinterpret_cast<float*>(whpos + s.CW);
  float* whgate = whsum + s.CW;
  float* whdlog = whgate + s.CW;
  int* rhpos = reinterpret_cast<int*>(whdlog + s.CW);
  float* rhsum = reinterpret_cast<float*>(rhpos + s.CR);
  float* rhdlog = rhsum + s.CR;

  const int C = s.C;
  const int tid = threadIdx.x, T = blockDim.x;

  for (int64_t u = blockIdx.x; u < N; u += gridDim.x) {
    const Phase1GradArrays a = all.unit(u, C, s.W, s.R);

    // 1. Keys, sorted; invalid entries get zero gradients.
    const int n_valid = sort_unit(keys, a.k_idx, a.q_idx, s, scan_sh, [&](bool write, int id) {
      if (write) {
        a.dk_val[id] = 0.0f;
        a.dx[id] = 0.0f;
      } else {
        a.dq_val[id] = 0.0f;
      }
    });

    // 2. Run heads of both kinds, compacted in sorted order.
    int n_wh, n_rh;
    {
      int lo, hi;
      chunk_of(n_valid, lo, hi);
      int cnt[2] = {0, 0};
      Ent prev{};
      if (lo > 0 && lo < hi) prev = decode(keys[lo - 1], s);
      for (int q = lo; q < hi; ++q) {
        const Ent e = decode(keys[q], s);
        if (!(q > 0 && same_run(prev, e))) {
          if (e.write) {
            ++cnt[0];
          } else {
            ++cnt[1];
          }
        }
        prev = e;
      }
      int off[2], tot[2];
      block_scan<2>(cnt, off, tot, scan_sh);
      if (lo > 0 && lo < hi) prev = decode(keys[lo - 1], s);
      for (int q = lo; q < hi; ++q) {
        const Ent e = decode(keys[q], s);
        if (!(q > 0 && same_run(prev, e))) {
          if (e.write) {
            whpos[off[0]++] = q;
          } else {
            rhpos[off[1]++] = q;
          }
        }
        prev = e;
      }
      n_wh = tot[0];
      n_rh = tot[1];
    }
    __syncthreads();

    // 3. Run sums (lane order) and gates.
    for (int hh = tid; hh < n_wh + n_rh; hh += T) {
      const bool write = hh < n_wh;
      const int p = write ? whpos[hh] : rhpos[hh - n_wh];
      const Ent e0 = decode(keys[p], s);
      const float* val = write ? a.k_val : a.q_val;
      float sum = val[e0.id];
      for (int q = p + 1; q < n_valid; ++q) {
        const Ent e = decode(keys[q], s);
        if (!same_run(e0, e)) break;
        sum += val[e.id];
      }
      if (write) {
        whsum[hh] = sum;
        whgate[hh] = a.x[e0.id];
      } else {
        rhsum[hh - n_wh] = sum;
      }
    }
    __syncthreads();

    // 4. Pair gradients, one thread per run head; then the weight gradients of its run's entries.
    //    Pair (a later run, b earlier write run), cotangent c: ce = c exp(X_ab) (X_ab = L_a - L_b, summed),
    //    d sum_a += ce sum_b, d sum_b += ce sum_a, d L_a += ce sum_a sum_b, d L_b -= ce sum_a sum_b.
    for (int hh = tid; hh < n_wh + n_rh; hh += T) {
      const bool write = hh < n_wh;
      const int h = write ? hh : hh - n_wh;
      const int p = write ? whpos[h] : rhpos[h];
      const Ent e0 = decode(keys[p], s);
      const int t = e0.t;
      const int gs = lower_bound(keys, 0, p, slot_key(e0.slot));
      const int w0 = lower_bound(whpos, 0, n_wh, gs);
      const float as = write ? whsum[h] : rhsum[h];
      const float* c_row = (write ? a.dA : a.dQK) + static_cast<int64_t>(t) * C;
      float dsum = 0.0f, dlog = 0.0f;
      // As the later run: the earlier write heads of the group, nearest first.
      const int w_end = write ? h : lower_bound(whpos, w0, n_wh, p);
      float x = write ? whgate[h] : 0.0f;
      for (int b = w_end - 1; b >= w0; --b) {
        const float bs = whsum[b];
        const float ce = c_row[token_of(keys[whpos[b]], s)] * exp_f(x);
        dsum += ce * bs;
        dlog += ce * as * bs;
        x += whgate[b];
      }
      if (write) {
        // As the earlier write run: the later runs of the group (writes and reads merged in sorted order).
        const int ge = lower_bound(keys, p + 1, n_valid, slot_key(e0.slot + 1));
        const int w1 = lower_bound(whpos, h + 1, n_wh, ge);
        int ir = lower_bound(rhpos, 0, n_rh, p);
        const int r1 = lower_bound(rhpos, ir, n_rh, ge);
        int iw = h + 1;
        float x_later = 0.0f;  // the gates of the runs after this one, up to the later run
        while (iw < w1 || ir < r1) {
          const bool take_write = ir >= r1 || (iw < w1 && whpos[iw] < rhpos[ir]);
          const int pa = take_write ? whpos[iw] : rhpos[ir];
          const float a_sum = take_write ? whsum[iw] : rhsum[ir];
          if (take_write) x_later += whgate[iw];
          const float* dm = take_write ? a.dA : a.dQK;
          const float ce = dm[static_cast<int64_t>(token_of(keys[pa], s)) * C + t] * exp_f(x_later);
          dsum += ce * a_sum;
          dlog -= ce * a_sum * as;
          if (take_write) {
            ++iw;
          } else {
            ++ir;
          }
        }
        whdlog[h] = dlog;
      } else {
        rhdlog[h] = dlog;
      }
      // The run's entries: the chain rule through k_eff and w (q_w), plus the pair part.
      for (int q = p; q < n_valid; ++q) {
        const Ent e = decode(keys[q], s);
        if (q > p && !same_run(e0, e)) break;
        if (write) {
          a.dk_val[e.id] = a.dk_eff[e.id] * exp_f(a.log_k[e.id]) + a.dw[e.id] * exp_f(a.rex[e.id]) + dsum;
        } else {
          a.dq_val[e.id] = a.dq_w[e.id] * exp_f(a.log_q[e.id]) + dsum;
        }
      }
    }
    __syncthreads();

    // 5. Gates, one thread per group: dx of a head = (suffix of the log gradients from it) + (prefix of the rex
    //    gradients before it) + (gradient of the group total); repeats get 0.
    for (int p = tid; p < n_valid; p += T) {
      const uint32_t slot = static_cast<uint32_t>(keys[p] >> 32);
      if (p > 0 && static_cast<uint32_t>(keys[p - 1] >> 32) == slot) continue;
      float dtotal = 0.0f;
      int end = p;
      for (; end < n_valid; ++end) {
        const uint64_t key = keys[end];
        if (static_cast<uint32_t>(key >> 32) != slot) break;
        const Ent e = decode(key, s);
        if (e.write) dtotal += a.dcpe[e.id] * a.cpe[e.id];
      }
      // Suffix sums, from the group's end; parked in dx of the write heads.
      int iw = lower_bound(whpos, 0, n_wh, end) - 1;
      int ir = lower_bound(rhpos, 0, n_rh, end) - 1;
      float suffix = 0.0f;
      for (int q = end - 1; q >= p; --q) {
        const Ent e = decode(keys[q], s);
        const bool head = q == p || !same_run(decode(keys[q - 1], s), e);
        float dl;
        if (e.write) {
          const float el = exp_f(a.log_k[e.id]);
          dl = a.dk_eff[e.id] * (a.k_val[e.id] * el);
          if (head) dl = dl + whdlog[iw--];
        } else {
          const float el = exp_f(a.log_q[e.id]);
          dl = a.dq_w[e.id] * (a.q_val[e.id] * el);
          if (head) dl = dl + rhdlog[ir--];
        }
        suffix += dl;
        if (e.write && head) a.dx[e.id] = suffix;
      }
      // Prefix sums of the rex gradients, and dx.
      float prefix = 0.0f;
      Ent prev{};
      for (int q = p; q < end; ++q) {
        const Ent e = decode(keys[q], s);
        if (e.write) {
          const bool head = q == p || !same_run(prev, e);
          a.dx[e.id] = head ? a.dx[e.id] + prefix + dtotal : 0.0f;
          prefix += a.dw[e.id] * (a.k_val[e.id] * exp_f(a.rex[e.id]));
        }
        prev = e;
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
  int64_t p2 = 1;
  while (p2 < s.E) p2 <<= 1;
  s.P2 = static_cast<int>(p2);
  s.CW = static_cast<int>(d.C * d.W);
  s.CR = static_cast<int>(d.C * d.R);
  s.K = d.K;
  return s;
}

// Threads per block: one per compare-exchange of the sort (P2 / 2), within [128, 512].
int threads_for(const Shape& s) {
  return static_cast<int>(std::min<int64_t>(kMaxThreads, std::max<int64_t>(128, s.P2 / 2)));
}

bool fits(int64_t N, int64_t C, int64_t W, int64_t R) {
  return N >= 0 && C >= 0 && W >= 0 && R >= 0 && C * (W + R) <= kPhase1CudaMaxEntries &&
         C <= kPhase1CudaMaxEntries;
}

// Launches kernel<true> (scratch in shared memory) or kernel<false> (scratch in the workspace), from the shapes.
template <typename Args>
int launch(void (*shared_kernel)(Args, Shape, int64_t, unsigned char*, int64_t),
           void (*global_kernel)(Args, Shape, int64_t, unsigned char*, int64_t), const Args& args,
           const Shape& s, int64_t N, int64_t scratch, void* workspace, int64_t workspace_bytes,
           cudaStream_t stream) {
  const int threads = threads_for(s);
  if (scratch <= kPhase1CudaSharedBytes) {
    // Dynamic plus static shared memory may pass 48 KB even when the scratch alone does not: always raise the
    // limit to the scratch (idempotent).
    if (scratch > 0) {
      const cudaError_t e = cudaFuncSetAttribute(shared_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(scratch));
      if (e != cudaSuccess) return static_cast<int>(e);
    }
    const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(N, int64_t{1} << 30));
    shared_kernel<<<blocks, threads, static_cast<size_t>(scratch), stream>>>(args, s, N, nullptr, 0);
  } else {
    const int64_t blocks = std::min<int64_t>(N, kPhase1CudaGlobalBlocks);
    if (workspace == nullptr || workspace_bytes < blocks * scratch ||
        reinterpret_cast<uintptr_t>(workspace) % 16 != 0) {
      return static_cast<int>(cudaErrorInvalidValue);
    }
    global_kernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(
        args, s, N, static_cast<unsigned char*>(workspace), scratch);
  }
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int phase1_cuda(const Phase1Arrays& a, const Phase1Dims& d, void* workspace, int64_t workspace_bytes,
                CUstream_st* stream) {
  if (!fits(d.N, d.C, d.W, d.R)) return static_cast<int>(cudaErrorInvalidValue);
  if (d.N == 0) return static_cast<int>(cudaSuccess);
  return launch<Phase1Arrays>(phase1_fwd_kernel<true>, phase1_fwd_kernel<false>, a, make_shape(d),
                              d.N, phase1_cuda_scratch_bytes(d.C, d.W, d.R, false), workspace, workspace_bytes,
                              stream);
}

int phase1_bwd_cuda(const Phase1GradArrays& a, const Phase1Dims& d, void* workspace, int64_t workspace_bytes,
                    CUstream_st* stream) {
  if (!fits(d.N, d.C, d.W, d.R)) return static_cast<int>(cudaErrorInvalidValue);
  if (d.N == 0) return static_cast<int>(cudaSuccess);
  return launch<Phase1GradArrays>(phase1_bwd_kernel<true>, phase1_bwd_kernel<false>, a,
                                  make_shape(d), d.N, phase1_cuda_scratch_bytes(d.C, d.W, d.R, true),
                                  workspace, workspace_bytes, stream);
}

}  // namespace sdm
