// A warp's selection in the product-key top-k (kernels/product_key_topk.h): a factor's top m_f of n_f, then the
// top k of the C candidates, each by one of two routes, both exact:
//   - prefiltered (m <= 32, m < N): a lower bound L of the m-th largest key, the m-th largest of the lanes' own
//     best keys (their best one for m <= 16, their best two for m <= 32); the keys >= L, in element order, into
//     the warp's shared memory (at most kPrefilterCap of them, else the other route); a sort of those in registers.
//     L leaves about 1.5 m keys in random data, so the cost hardly grows with N.
//   - threshold search: the threshold T, the m-th largest key, bit by bit from the top over the bits where the keys
//     differ (one warp reduction per bit, stopping early at a trial value that exactly m keys reach); one pass that
//     keeps the keys > T and, in element order, the first keys == T that complete m (ballots give every kept
//     element its place); a bitonic sort of the m kept composites (padded to a power of two), in registers up to
//     64, else in the warp's shared memory.
// Keys of up to 1024 elements stay in registers (32 per lane; the warp-per-row kernel's instance for the row's
// longest list keeps 256, 512 or 1024); longer lists are recomputed on every pass. The composites order the
// elements totally, so the result is the CPU kernel's, bit for bit, whatever the route; a bfloat16 factor's are
// 32 bits wide (Composite).
// Used by the top-k's kernels (kernels/product_key_topk_cuda.cu) and by the layer's decode step, which ranks its
// lists in its own kernel (kernels/decode_step_cuda.cu).
#ifndef JAX_SDM_KERNELS_PRODUCT_KEY_TOPK_WARP_CUH_
#define JAX_SDM_KERNELS_PRODUCT_KEY_TOPK_WARP_CUH_

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/bf16_cuda.cuh"
#include "kernels/product_key_topk.h"

namespace sdm {
namespace topk_warp {

constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float from_f(float x, float*) { return x; }
__device__ __forceinline__ __nv_bfloat16 from_f(float x, __nv_bfloat16*) { return __float2bfloat16_rn(x); }

struct Top {
  float score;
  int32_t index;
};

// The keys of elements e = 32 s + lane, s < chunks (e >= N reads as 0, below every real element's composite and
// after it in element order, so it is never kept). E > 0: all in registers (chunks <= E); E == 0: key_of(e) on
// every pass. kTogether: the E keys are read with no branch between them (out-of-range lanes read element 0, then
// read as 0), so that their loads are in flight together: a load under its own test waits for the one before it.
// That needs registers for all E loads at once, so it serves the block-per-row kernel, whose rows' latency is the
// call's; the warp-per-row kernel keeps its occupancy.
template <int E, typename KeyOf, bool kTogether>
struct Keys {
  KeyOf key_of;
  int N, chunks, lane;
  uint32_t r[E > 0 ? E : 1];

  __device__ Keys(KeyOf k, int n, int l) : key_of(k), N(n), chunks((n + 31) / 32), lane(l) {
    if constexpr (E > 0 && kTogether) {
#pragma unroll
      for (int s = 0; s < E; ++s) {
        const int e = 32 * s + lane;
        r[s] = key_of(e < N ? e : 0);
      }
#pragma unroll
      for (int s = 0; s < E; ++s)
        if (32 * s + lane >= N) r[s] = 0u;
    } else if constexpr (E > 0) {
#pragma unroll
      for (int s = 0; s < E; ++s) {
        const int e = 32 * s + lane;
        r[s] = s < chunks && e < N ? key_of(e) : 0u;
      }
    }
  }
  // f(s, key) for every chunk s of this lane, in order.
  template <typename F>
  __device__ __forceinline__ void each(F&& f) const {
    if constexpr (E > 0) {
#pragma unroll
      for (int s = 0; s < E; ++s)
        if (s < chunks) f(s, r[s]);
    } else {
      for (int s = 0; s < chunks; ++s) {
        const int e = 32 * s + lane;
        f(s, e < N ? key_of(e) : 0u);
      }
    }
  }
};

// Warp shuffles of a composite: one for 32 bits, two for 64.
__device__ __forceinline__ uint32_t shfl_xor_c(uint32_t v, int mask) {
  return static_cast<uint32_t>(__shfl_xor_sync(kFull, static_cast<int>(v), mask));
}
__device__ __forceinline__ uint32_t shfl_c(uint32_t v, int src) {
  return static_cast<uint32_t>(__shfl_sync(kFull, static_cast<int>(v), src));
}
__device__ __forceinline__ uint64_t shfl_xor_c(uint64_t v, int mask) {
  const int lo = __shfl_xor_sync(kFull, static_cast<int>(static_cast<uint32_t>(v)), mask);
  const int hi = __shfl_xor_sync(kFull, static_cast<int>(static_cast<uint32_t>(v >> 32)), mask);
  return (static_cast<uint64_t>(static_cast<uint32_t>(hi)) << 32) | static_cast<uint32_t>(lo);
}
__device__ __forceinline__ uint64_t shfl_c(uint64_t v, int src) {
  const int lo = __shfl_sync(kFull, static_cast<int>(static_cast<uint32_t>(v)), src);
  const int hi = __shfl_sync(kFull, static_cast<int>(static_cast<uint32_t>(v >> 32)), src);
  return (static_cast<uint64_t>(static_cast<uint32_t>(hi)) << 32) | static_cast<uint32_t>(lo);
}

// Composites of two widths, both descending in (key, then smaller position), 0 below every element. Wide: the
// header's composite, any key and position. Narrow: a 16-bit score's key (its low 16 bits are all equal across the
// keys of one sign, so the key's high half orders the scores) and a position below 0xffff, in 32 bits: half the
// shuffles and compares of the sorts.
template <typename C>
struct Composite;
template <>
struct Composite<uint64_t> {
  __device__ static uint64_t make(uint32_t key, uint32_t pos) { return composite(key, pos); }
  __device__ static uint32_t position(uint64_t c) { return composite_pos(c); }
};
template <>
struct Composite<uint32_t> {
  __device__ static uint32_t make(uint32_t key, uint32_t pos) { return (key & 0xffff0000u) | (0xffffu - pos); }
  __device__ static uint32_t position(uint32_t c) { return 0xffffu - (c & 0xffffu); }
};
constexpr int32_t kNarrowMaxN = 0xffff;  // positions 0 .. 0xfffe keep a narrow composite's low half above 0

// Sorts the warp's 32 E values descending, element 32 j + lane in v[j] (bitonic: pairs across lanes by shuffles,
// pairs of one lane in registers).
template <int E, typename C>
__device__ __forceinline__ void warp_sort_regs(C (&v)[E], int lane) {
#pragma unroll
  for (int size = 2; size <= 32 * E; size <<= 1) {
#pragma unroll
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      if (stride >= 32) {
        const int js = stride >> 5;
#pragma unroll
        for (int j = 0; j < E; ++j) {
          if (j & js) continue;
          const bool desc = ((32 * j + lane) & size) == 0;
          const C a = v[j], b = v[j | js];
          if ((a < b) == desc) {
            v[j] = b;
            v[j | js] = a;
          }
        }
      } else {
        const bool lower = (lane & stride) == 0;
#pragma unroll
        for (int j = 0; j < E; ++j) {
          const C other = shfl_xor_c(v[j], stride);
          const bool keep_max = lower == (((32 * j + lane) & size) == 0);
          v[j] = keep_max == (v[j] > other) ? v[j] : other;
        }
      }
    }
  }
}

// The n (<= 64) composites of buf sorted descending in registers, the best `keep` (<= n) written back to buf[0, keep).
template <typename C>
__device__ void warp_sort_prefix(C* buf, int n, int keep, int lane) {
  __syncwarp();
  C v[2] = {lane < n ? buf[lane] : C{0}, 32 + lane < n ? buf[32 + lane] : C{0}};
  __syncwarp();
  if (n <= 32) {
    C one[1] = {v[0]};
    warp_sort_regs<1>(one, lane);
    v[0] = one[0];
  } else {
    warp_sort_regs<2>(v, lane);
  }
  if (lane < keep) buf[lane] = v[0];
  if (32 + lane < keep) buf[32 + lane] = v[1];
  __syncwarp();
}

// Sorts buf[0, P) descending (P a power of two; the warp's lanes together), in registers up to P = 64.
template <typename C>
__device__ void warp_sort_desc(C* buf, int P, int lane) {
  if (P <= 64) {
    warp_sort_prefix(buf, P, P, lane);
    return;
  }
  for (int size = 2; size <= P; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int t = lane; t < P / 2; t += 32) {
        const int i = 2 * t - (t & (stride - 1));
        const int j = i + stride;
        const C a = buf[i], b = buf[j];
        if ((a < b) == ((i & size) == 0)) {
          buf[i] = b;
          buf[j] = a;
        }
      }
      __syncwarp();
    }
  }
}

constexpr int kPrefilterCap = 64;  // keys the prefiltered route sorts at most

// The prefiltered route (see the file's head) for 1 <= m <= 32, m < N: the m best of the N elements into
// buf[0, m), best first (buf holds at least kPrefilterCap composites). False, with buf's contents undefined, when
// more than kPrefilterCap keys reach the bound (many ties): the caller takes the threshold search.
template <typename K, typename C>
__device__ bool warp_top_prefiltered(const K& keys, int N, int m, C* buf, int lane) {
  // The lane's two best keys (0 where it has fewer elements: then the bound is 0 and every element passes).
  uint32_t best0 = 0, best1 = 0;
  keys.each([&](int s, uint32_t key) {
    if (32 * s + lane >= N) return;
    if (key > best0) {
      best1 = best0;
      best0 = key;
    } else if (key > best1) {
      best1 = key;
    }
  });
  // L: the m-th largest of the lanes' best keys. m of them are keys of distinct elements >= L (or L = 0 <= every
  // key), so the m best elements all have keys >= L. (Sorted as 64-bit values: as 32-bit ones, ptxas spills the
  // 1024-element kernel's registers.)
  uint32_t bound;
  if (m <= 16) {
    uint64_t v[1] = {uint64_t{best0}};
    warp_sort_regs<1>(v, lane);
    bound = static_cast<uint32_t>(shfl_c(v[0], m - 1));
  } else {
    uint64_t v[2] = {uint64_t{best0}, uint64_t{best1}};
    warp_sort_regs<2>(v, lane);
    bound = static_cast<uint32_t>(shfl_c(v[0], m - 1));  // m <= 32: among the first 32
  }
  const unsigned below = (1u << lane) - 1u;
  unsigned count = 0;  // keys >= L before this chunk, in element order
  keys.each([&](int s, uint32_t key) {
    const int e = 32 * s + lane;
    const bool pass = e < N && key >= bound;
    const unsigned mask = __ballot_sync(kFull, pass);
    const unsigned at = count + __popc(mask & below);
    if (pass && at < static_cast<unsigned>(kPrefilterCap)) buf[at] = Composite<C>::make(key, static_cast<uint32_t>(e));
    count += __popc(mask);
  });
  if (count > static_cast<unsigned>(kPrefilterCap)) return false;
  warp_sort_prefix(buf, static_cast<int>(count), m, lane);
  return true;
}

// The m best of the N elements (1 <= m <= N) into buf[0, m), best first (buf holds max(P, kPrefilterCap)
// composites, P >= m a power of two). Composites (key, element), so ties go to the smaller element.
template <typename K, typename C>
__device__ void warp_top(const K& keys, int N, int m, int P, C* buf, int lane) {
  const unsigned below = (1u << lane) - 1u;
  if (m == N) {
    keys.each([&](int s, uint32_t key) {
      const int e = 32 * s + lane;
      if (e < N) buf[e] = Composite<C>::make(key, static_cast<uint32_t>(e));
    });
  } else {
    if (m <= 32 && warp_top_prefiltered(keys, N, m, buf, lane)) return;
    // The bits where the keys differ: above the highest and below the lowest, every key (and so T) has the same.
    uint32_t any = 0, all = ~0u;
    keys.each([&](int s, uint32_t key) {
      if (32 * s + lane >= N) return;
      any |= key;
      all &= key;
    });
    any = __reduce_or_sync(kFull, any);
    all = __reduce_and_sync(kFull, all);
    const uint32_t differ = any ^ all;
    const int high = differ ? 31 - __clz(differ) : -1;
    const int low = differ ? __ffs(differ) - 1 : 0;
    const uint32_t low_bits = all & ((1u << low) - 1u);
    // T: the largest value that at least m keys reach, built from the top (T's bits below the current one are
    // the keys' common low bits, so that a key compares with T as with its prefix).
    uint32_t T = high < 0 ? all : (all & ~(high == 31 ? ~0u : (2u << high) - 1u)) | low_bits;
    for (int b = high; b >= low; --b) {
      const uint32_t trial = T | (1u << b);
      unsigned c = 0;
      keys.each([&](int, uint32_t key) { c += key >= trial ? 1u : 0u; });
      c = __reduce_add_sync(kFull, c);
      if (c >= static_cast<unsigned>(m)) {
        T = trial;
        if (c == static_cast<unsigned>(m)) break;  // exactly m keys >= T: those are the m
      }
    }
    unsigned above = 0;
    keys.each([&](int, uint32_t key) { above += key > T ? 1u : 0u; });
    const unsigned need = static_cast<unsigned>(m) - __reduce_add_sync(kFull, above);  // keys == T to keep
    unsigned kept = 0, equal = 0;  // before this chunk, in element order
    keys.each([&](int s, uint32_t key) {
      const bool eq = key == T;
      const unsigned eq_mask = __ballot_sync(kFull, eq);
      const bool keep = key > T || (eq && equal + __popc(eq_mask & below) < need);
      const unsigned keep_mask = __ballot_sync(kFull, keep);
      if (keep) buf[kept + __popc(keep_mask & below)] = Composite<C>::make(key, static_cast<uint32_t>(32 * s + lane));
      kept += __popc(keep_mask);
      equal += __popc(eq_mask);
    });
  }
  for (int i = m + lane; i < P; i += 32) buf[i] = 0;
  __syncwarp();
  warp_sort_desc(buf, P, lane);
}

// warp_top with the keys in registers when they fit (at most kMaxE a lane), recomputed on every pass otherwise.
template <bool kTogether, int kMaxE, typename KeyOf, typename C>
__device__ void warp_top_of(KeyOf key_of, int N, int m, int P, C* buf, int lane) {
  if constexpr (kTogether) {  // reading every key at once reads all E chunks: short lists get fewer
    if (N <= 32 * 2) return warp_top(Keys<2, KeyOf, true>(key_of, N, lane), N, m, P, buf, lane);
    if (N <= 32 * 4) return warp_top(Keys<4, KeyOf, true>(key_of, N, lane), N, m, P, buf, lane);
  }
  if (N <= 32 * 8) return warp_top(Keys<8, KeyOf, kTogether>(key_of, N, lane), N, m, P, buf, lane);
  if constexpr (kMaxE > 8) {
    if (N <= 32 * kMaxE) return warp_top(Keys<kMaxE, KeyOf, kTogether>(key_of, N, lane), N, m, P, buf, lane);
  }
  warp_top(Keys<0, KeyOf, kTogether>(key_of, N, lane), N, m, P, buf, lane);
}

// A warp's sort buffer: max(p_k, kPrefilterCap) composites (p_k >= every factor's p_f).
__host__ __device__ inline int64_t sort_slots(const ProductKeyDims& d) {
  return d.p_k > kPrefilterCap ? d.p_k : kPrefilterCap;
}

// fn(C{}) with the composite type of factor f's sort: 32-bit (narrow) for 16-bit scores of a factor below
// kNarrowMaxN entries, whose keys' low halves, equal across the keys of one sign, are masked off (so that the
// threshold search skips those bits); else 64-bit.
template <typename T, typename Fn>
__device__ __forceinline__ void with_composite(const ProductKeyDims& d, int f, Fn&& fn) {
  if constexpr (sizeof(T) == 2) {
    if (d.n[f] < kNarrowMaxN) {
      fn(uint32_t{0});
      return;
    }
  }
  fn(uint64_t{0});
}

// The top-list entry of composite c of factor xf: the element's score and index.
template <typename C, typename T>
__device__ __forceinline__ Top top_of(const T* xf, C c) {
  const uint32_t e = Composite<C>::position(c);
  return Top{to_f(xf[e]), static_cast<int32_t>(e)};
}

// Factor f of row xr: its top m_f (score, index) into the row's top lists, by one warp (buf: its sort buffer).
template <bool kTogether, int kMaxE, typename C, typename T>
__device__ void select_factor_as(const ProductKeyDims& d, const T* xr, int f, C* buf, Top* tops, int lane) {
  constexpr uint32_t kKeyBits = sizeof(T) == 2 ? 0xffff0000u : 0xffffffffu;
  const T* xf = xr + d.x_offset[f];
  warp_top_of<kTogether, kMaxE>([xf](int e) { return order_key(to_f(xf[e])) & kKeyBits; }, d.n[f], d.m[f], d.p[f],
                                buf, lane);
  Top* tf = tops + d.top_offset[f];
  for (int r = lane; r < d.m[f]; r += 32) tf[r] = top_of(xf, buf[r]);
  __syncwarp();
}
template <bool kTogether, int kMaxE, typename T>
__device__ void select_factor(const ProductKeyDims& d, const T* xr, int f, uint64_t* buf, Top* tops, int lane) {
  with_composite<T>(d, f, [&](auto c) {
    select_factor_as<kTogether, kMaxE>(d, xr, f, reinterpret_cast<decltype(c)*>(buf), tops, lane);
  });
}

// Factor f of row xr by two warps, half of its elements each (h = 0 the first half, 1 the second): fewer keys a lane
// and, with kMaxE the halves' chunks, straight-line code half as long. Step 1, select_factor_half: the warp's half's
// best min(m_f, half) into buf[0, m_f) (0 past them), each composite with its element's position in the factor.
// Step 2, after a barrier, merge_factor by one warp of the two: the m_f best of both lists into the row's top
// lists. The m_f best of the factor are among the two lists and composites order them totally, so the result is
// select_factor's, bit for bit. m_f <= 64.
template <bool kTogether, int kMaxE, typename C, typename T>
__device__ void select_factor_half_as(const ProductKeyDims& d, const T* xr, int f, int h, C* buf, int lane) {
  constexpr uint32_t kKeyBits = sizeof(T) == 2 ? 0xffff0000u : 0xffffffffu;
  const T* xf = xr + d.x_offset[f];
  const int first = (d.n[f] + 1) / 2, lo = h ? first : 0, N = h ? d.n[f] - first : first;
  const int m = N < d.m[f] ? N : d.m[f];
  if (m > 0) {
    const T* xh = xf + lo;
    warp_top_of<kTogether, kMaxE>([xh](int e) { return order_key(to_f(xh[e])) & kKeyBits; }, N, m, d.p[f], buf,
                                  lane);
  }
  for (int r = lane; r < d.m[f]; r += 32) {  // positions in the factor, not the half
    const uint32_t e = r < m ? Composite<C>::position(buf[r]) + static_cast<uint32_t>(lo) : 0u;
    buf[r] = r < m ? Composite<C>::make(order_key(to_f(xf[e])) & kKeyBits, e) : C{0};
  }
  __syncwarp();
}
template <typename C, typename T>
__device__ void merge_factor_as(const ProductKeyDims& d, const T* xr, int f, const C* a, const C* b, Top* tops,
                                int lane) {
  const T* xf = xr + d.x_offset[f];
  const int m = d.m[f];
  Top* tf = tops + d.top_offset[f];
  if (m <= 32) {
    C v[2] = {lane < m ? a[lane] : C{0}, lane < m ? b[lane] : C{0}};
    warp_sort_regs<2>(v, lane);  // element 32 j + lane in v[j], best first
    if (lane < m) tf[lane] = top_of(xf, v[0]);
  } else {
    C v[4] = {a[lane], 32 + lane < m ? a[32 + lane] : C{0}, b[lane], 32 + lane < m ? b[32 + lane] : C{0}};
    warp_sort_regs<4>(v, lane);
    tf[lane] = top_of(xf, v[0]);
    if (32 + lane < m) tf[32 + lane] = top_of(xf, v[1]);
  }
  __syncwarp();
}
template <bool kTogether, int kMaxE, typename T>
__device__ void select_factor_half(const ProductKeyDims& d, const T* xr, int f, int h, uint64_t* buf, int lane) {
  with_composite<T>(d, f, [&](auto c) {
    select_factor_half_as<kTogether, kMaxE>(d, xr, f, h, reinterpret_cast<decltype(c)*>(buf), lane);
  });
}
template <typename T>
__device__ void merge_factor(const ProductKeyDims& d, const T* xr, int f, const uint64_t* a, const uint64_t* b,
                             Top* tops, int lane) {
  with_composite<T>(d, f, [&](auto c) {
    using C = decltype(c);
    merge_factor_as(d, xr, f, reinterpret_cast<const C*>(a), reinterpret_cast<const C*>(b), tops, lane);
  });
}

// The row's top k from its top lists (all F written and visible to the warp), by one warp: for F = 1 the list
// itself, else the best k candidates.
template <bool kTogether, int kMaxE>
__device__ void select_slots(const ProductKeyDims& d, const Top* tops, const int32_t* __restrict__ table,
                             uint64_t* buf, float* sr, int32_t* ir, int lane) {
  if (d.F == 1) {
    for (int r = lane; r < d.k; r += 32) {
      sr[r] = canonical_score(tops[r].score);
      ir[r] = tops[r].index;
    }
    return;
  }
  // A candidate's score, summed in factor order (the CPU kernel's order), and its slot id.
  const ProductKeyDims* dp = &d;
  auto candidate = [dp, tops, table](int c) {
    const Top t0 = tops[dp->top_offset[0] + __ldg(table + c)];
    Top slot = t0;  // (score, slot id)
    for (int f = 1; f < dp->F; ++f) {
      const Top t = tops[dp->top_offset[f] + __ldg(table + static_cast<int64_t>(f) * dp->C + c)];
      slot.score = slot.score + t.score;
      slot.index = slot.index * dp->n[f] + t.index;
    }
    return slot;
  };
  warp_top_of<kTogether, kMaxE>([&candidate](int c) { return order_key(candidate(c).score); }, d.C, d.k, d.p_k, buf,
                                lane);
  for (int r = lane; r < d.k; r += 32) {
    const Top slot = candidate(static_cast<int>(Composite<uint64_t>::position(buf[r])));
    sr[r] = canonical_score(slot.score);
    ir[r] = slot.index;
  }
}

}  // namespace topk_warp
}  // namespace sdm

#endif  // JAX_SDM_KERNELS_PRODUCT_KEY_TOPK_WARP_CUH_
