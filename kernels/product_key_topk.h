// Exact top-k over the slots of a product key (`jax_sdm.product_key_topk`, docs/DESIGN.md "Product-key top-k").
// Plain C++ / CUDA on raw pointers.
//
// A row holds the scores of F factors side by side, x [width] with width = n_0 + ... + n_{F-1}; slot
// (i_0, ..., i_{F-1}) has id ((i_0 n_1 + i_1) n_2 + ...) (mixed radix, the first factor most significant) and score
// x[o_0 + i_0] + x[o_1 + i_1] + ... (float32, summed in factor order; o_f the factor's offset). Order: each factor
// ranks its entries by score (best first), equal scores by the smaller index; slots rank by score (best first),
// equal scores by the lexicographically smaller tuple of factor ranks. Scores compare through order_key: NaN below
// every number, -0 equal to +0.
//
// The k best slots lie among the candidates, the rank tuples (r_0, ..., r_{F-1}) with prod(r_f + 1) <= k (every
// other tuple has at least k tuples with componentwise smaller-or-equal ranks, each scoring at least as much and
// coming first on a tie). The caller passes them as a table [F, C] of ranks (int32, factor-major), the tuples in
// lexicographic order, so that a candidate's position in the table is its tie rank. A row's work:
//   1. per factor f, the top m_f = min(k, n_f) entries, sorted: (score, index) at rank r = 0 .. m_f - 1;
//   2. per candidate c, its score, the sum over f of the score at rank table[f][c];
//   3. the top k candidates by (score, position), sorted: scores [k] (float32) and slot ids [k] (int32).
// For F = 1 step 1 is the answer. Both kernels compare the same keys (composite: the score's order key, then the
// index or position) and add the same float32 numbers in the same order, so they give the same bits.
//
// The backward: dx[o_f + i] = sum over j = 0, 1, ..., k-1 (in that order, from +0) of dscores[j] for the selected
// slots j whose factor-f index is i; every other entry 0. One writer per entry, a fixed order: bitwise reproducible.
#ifndef JAX_SDM_KERNELS_PRODUCT_KEY_TOPK_H_
#define JAX_SDM_KERNELS_PRODUCT_KEY_TOPK_H_

#include <cstdint>
#include <cstring>

struct CUstream_st;  // cudaStream_t, declared so that this header needs no CUDA include

#include "kernels/host_device.h"

namespace sdm {

constexpr int kProductKeyMaxFactors = 32;  // F
constexpr int kProductKeyMaxK = 256;       // k
constexpr int64_t kProductKeyMaxSlots = int64_t{1} << 31;  // prod(n_f): the ids are int32

struct ProductKeyDims {
  int64_t rows;   // independent rows (the product of the leading dims)
  int64_t slots;  // prod(n_f)
  int32_t F, k, C, width;
  int32_t p_k;   // the smallest power of two >= k (the sort's length)
  int32_t tops;  // sum of m_f: a row's per-factor top lists
  int32_t n[kProductKeyMaxFactors];           // factor sizes
  int32_t m[kProductKeyMaxFactors];           // min(k, n_f)
  int32_t p[kProductKeyMaxFactors];           // the smallest power of two >= m_f
  int32_t x_offset[kProductKeyMaxFactors];    // o_f: the factor's first column in x
  int32_t top_offset[kProductKeyMaxFactors];  // the factor's first entry in a row's top lists
  uint32_t weight[kProductKeyMaxFactors];     // prod(n_g) over g > f: id = sum_f i_f weight_f
};

inline int32_t next_pow2(int32_t v) {
  int32_t p = 1;
  while (p < v) p <<= 1;
  return p;
}

// The dims of `rows` rows of F factors (sizes `factors`), top k, C candidates. The caller has checked
// 1 <= F <= kProductKeyMaxFactors, every n_f >= 1, prod(n_f) <= kProductKeyMaxSlots, 1 <= k <= min(prod, kMaxK).
inline ProductKeyDims product_key_dims(int64_t rows, const int64_t* factors, int F, int64_t k, int64_t C) {
  ProductKeyDims d{};
  d.rows = rows;
  d.F = F;
  d.k = static_cast<int32_t>(k);
  d.C = static_cast<int32_t>(C);
  d.slots = 1;
  int32_t x_off = 0, top_off = 0;
  for (int f = 0; f < F; ++f) {
    d.n[f] = static_cast<int32_t>(factors[f]);
    d.m[f] = d.n[f] < d.k ? d.n[f] : d.k;
    d.p[f] = next_pow2(d.m[f]);
    d.x_offset[f] = x_off;
    d.top_offset[f] = top_off;
    x_off += d.n[f];
    top_off += d.m[f];
    d.slots *= factors[f];
  }
  uint32_t w = 1;
  for (int f = F - 1; f >= 0; --f) {
    d.weight[f] = w;
    w *= static_cast<uint32_t>(d.n[f]);
  }
  d.width = x_off;
  d.tops = top_off;
  d.p_k = next_pow2(d.k);
  return d;
}

// A float32 score as an unsigned key of the same order (larger key = better score), from the bits only (no float
// compare, so no dependence on a flush-to-zero mode): NaN is 0 (below -inf), -0 is +0.
SDM_HOST_DEVICE inline uint32_t order_key(float s) {
  uint32_t u;
  std::memcpy(&u, &s, 4);
  const uint32_t mag = u & 0x7fffffffu;
  if (mag > 0x7f800000u) return 0u;  // NaN
  if (mag == 0u) u = 0u;             // -0 == +0
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// A score as the kernels write it: a NaN as the one quiet NaN 0x7fc00000, whatever its payload (a CUDA add that
// meets a NaN returns 0x7fffffff, an x86 add the operand's NaN), so that both kernels give the same bits.
SDM_HOST_DEVICE inline float canonical_score(float s) {
  uint32_t u;
  std::memcpy(&u, &s, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) u = 0x7fc00000u;
  std::memcpy(&s, &u, 4);
  return s;
}

// (key, position) as one integer whose descending order is: larger key first, then smaller position. 0 is below
// every element (a real element's low word is 0xffffffff - position > 0): the padding of a sort.
SDM_HOST_DEVICE inline uint64_t composite(uint32_t key, uint32_t pos) {
  return (static_cast<uint64_t>(key) << 32) | (0xffffffffu - pos);
}
SDM_HOST_DEVICE inline uint32_t composite_pos(uint64_t c) { return 0xffffffffu - static_cast<uint32_t>(c); }

// Forward. x [rows, width] (T: float or sdm::bf16), table [F, C] (ranks, see above) -> scores [rows, k] float32,
// ids [rows, k] int32, best first. The CPU kernel checks the table (std::invalid_argument on a rank out of range).
template <typename T>
void product_key_topk_cpu(const ProductKeyDims& dims, const T* x, const int32_t* table, float* scores,
                          int32_t* ids);

// Backward. dscores [rows, k] float32, ids [rows, k] -> dx [rows, width] (T, rounded once from float32). Ids
// outside [0, slots) contribute nothing.
template <typename T>
void product_key_topk_bwd_cpu(const ProductKeyDims& dims, const float* dscores, const int32_t* ids, T* dx);

// The same on `stream`, one launch each (a warp, a block or a thread per row, by the shapes); no allocation, no
// synchronisation, the launch configuration from the shapes only. T is float or __nv_bfloat16 (passed as sdm::bf16,
// same layout). The table must hold ranks r < m_f (the forward reads shared memory at them). Return the
// cudaError_t of the launch.
template <typename T>
int product_key_topk_cuda(const ProductKeyDims& dims, const T* x, const int32_t* table, float* scores, int32_t* ids,
                          CUstream_st* stream);
template <typename T>
int product_key_topk_bwd_cuda(const ProductKeyDims& dims, const float* dscores, const int32_t* ids, T* dx,
                              CUstream_st* stream);

}  // namespace sdm

#endif  // JAX_SDM_KERNELS_PRODUCT_KEY_TOPK_H_
