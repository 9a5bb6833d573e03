// One token of one stream of the token recurrence (docs/MATH.md "Token recurrence") on the CPU: the arithmetic
// that the fused decode step (kernels/decode_step_cpu.cc) and the no-grad forward (kernels/token_recurrence_cpu.cc)
// share, so that both give the same bits. Compiled with -ffp-contract=off like the other CPU kernels.
#ifndef JAX_SDM_KERNELS_TOKEN_ROWS_CPU_H_
#define JAX_SDM_KERNELS_TOKEN_ROWS_CPU_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kernels/bf16.h"

namespace sdm {

// The token's lanes and the stream's rows. `first[n]` is the first valid write lane with lane n's slot (n itself
// unless a repeat; -1 for a slot id outside [0, K)); `read_lane[m]` the first write lane with read lane m's slot
// (-1 if the token does not write it or the id is outside [0, K)). ValT is the values' type (float, or the bank's
// BankT), the gate of lane n is x[n * x_stride] (x_stride 0: one gate per token).
template <typename BankT, typename ValT>
struct TokenRows {
  int64_t K, D, W, R;
  const int32_t* k_idx;  // [W]
  const ValT* k_val;     // [W]
  const float* x;
  int64_t x_stride;
  const ValT* v;         // [D]
  float beta;
  const int32_t* q_idx;  // [R]
  const ValT* q_val;     // [R]
  const int32_t* first;      // [W]
  const int32_t* read_lane;  // [R]
  BankT* rows;               // [K, D] the stream's bank, in/out
};

// The row operations of a token, on `n` columns; restrict: the arrays of one call never overlap.
template <typename T>
inline void add_scaled_row(float* __restrict dst, const T* __restrict src, float a, int64_t n) {
  for (int64_t j = 0; j < n; ++j) dst[j] += a * to_float(src[j]);
}
// work = decay * row, then acc += k * work (the decay of a written row, and its term of pred).
template <typename T>
inline void decay_row(float* __restrict work, const T* __restrict row, float decay, float k, float* __restrict acc,
                      int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    work[j] = decay * to_float(row[j]);
    acc[j] += k * work[j];
  }
}
// The same on a float32 row in place.
inline void decay_row_in_place(float* __restrict row, float decay, float k, float* __restrict acc, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    row[j] = decay * row[j];
    acc[j] += k * row[j];
  }
}
template <typename T>
inline void store_row(T* __restrict dst, const float* __restrict src, int64_t n) {
  for (int64_t j = 0; j < n; ++j) dst[j] = from_float<T>(src[j]);
}

// Asks for the rows of slot ids `ids[0..n)` in [0, K) of a bank far larger than the caches, all at once, so that
// their cache misses overlap instead of following one another.
template <typename BankT>
inline void prefetch_rows(const BankT* rows, const int32_t* ids, int64_t n, int64_t K, int64_t D) {
  for (int64_t i = 0; i < n; ++i) {
    if (ids[i] < 0 || ids[i] >= K) continue;
    const char* row = reinterpret_cast<const char*>(rows + static_cast<int64_t>(ids[i]) * D);
    for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(BankT)); b += 64) __builtin_prefetch(row + b);
  }
}

// Runs the token; `cur` ([W, D], unused for a float32 bank) and `delta` ([D]) are scratch, `reading` ([D])
// receives y in float32. With `cur[n]` the working row of first lane n (for a float32 bank, the bank row itself):
//
//   cur[n] = exp(x_n) * S[s_n]                 for each first lane n (each distinct written slot decays once)
//   pred   = sum_n k_n cur[first[n]]           lanes n = 0, 1, ..., W-1 (after the decay, before the write)
//   d      = beta (v - pred)
//   cur[first[n]] += k_n d                     lanes in order
//   S[s_n] = cur[n]                            for each first lane n (rounded once to the bank's dtype)
//   y      = sum_m q_m (r_m written ? cur[read_lane[m]] : S[r_m])   lanes m in order (read after the write)
//
// Every sum runs column by column in lane order (column j depends on column j only); a row's decay and its pred
// term share one pass, since lane n's first lane is never after n.
template <typename BankT, typename ValT>
inline void token_rows_cpu(const TokenRows<BankT, ValT>& a, float* cur, float* delta, float* reading) {
  constexpr bool kInPlace = std::is_same<BankT, float>::value;
  const int64_t D = a.D;
  auto work = [&](int64_t lane) -> float* {  // the working row of a first lane
    if constexpr (kInPlace) return a.rows + static_cast<int64_t>(a.k_idx[lane]) * D;
    else return cur + lane * D;
  };
  std::fill(delta, delta + D, 0.0f);
  for (int64_t n = 0; n < a.W; ++n) {
    const int32_t f = a.first[n];
    if (f < 0) continue;
    const float k = to_float(a.k_val[n]);
    if (f != n) {
      add_scaled_row(delta, work(f), k, D);
      continue;
    }
    const float decay = std::exp(a.x[n * a.x_stride]);
    if constexpr (kInPlace) decay_row_in_place(work(n), decay, k, delta, D);
    else decay_row(work(n), a.rows + static_cast<int64_t>(a.k_idx[n]) * D, decay, k, delta, D);
  }
  for (int64_t j = 0; j < D; ++j) delta[j] = a.beta * (to_float(a.v[j]) - delta[j]);
  for (int64_t n = 0; n < a.W; ++n) {
    if (a.first[n] >= 0) add_scaled_row(work(a.first[n]), delta, to_float(a.k_val[n]), D);
  }
  if constexpr (!kInPlace) {
    for (int64_t n = 0; n < a.W; ++n) {
      if (a.first[n] == n) store_row(a.rows + static_cast<int64_t>(a.k_idx[n]) * D, work(n), D);
    }
  }
  // Reads after the write: a written row from its float32 working row, any other from the bank.
  std::fill(reading, reading + D, 0.0f);
  for (int64_t m = 0; m < a.R; ++m) {
    const int32_t r = a.q_idx[m];
    if (r < 0 || r >= a.K) continue;
    const float q = to_float(a.q_val[m]);
    if (a.read_lane[m] >= 0) add_scaled_row(reading, work(a.read_lane[m]), q, D);
    else add_scaled_row(reading, a.rows + static_cast<int64_t>(r) * D, q, D);
  }
}

}  // namespace sdm

#endif  // JAX_SDM_KERNELS_TOKEN_ROWS_CPU_H_
