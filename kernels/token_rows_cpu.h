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
// dst = a * src (the decay of a written row; dst may be src).
template <typename T>
inline void scale_row(float* dst, const T* src, float a, int64_t n) {
  for (int64_t j = 0; j < n; ++j) dst[j] = a * to_float(src[j]);
}
// dst += a[0] src[0] + a[1] src[1] + ... + a[count-1] src[count-1], added in that order column by column (the same
// sums as one row after the other), four rows per pass over dst. The sources may be one row more than once.
template <typename T>
inline void add_scaled_rows(float* __restrict dst, const T* const* src, const float* a, int64_t count, int64_t n) {
  int64_t i = 0;
  for (; i + 4 <= count; i += 4) {
    const T *s0 = src[i], *s1 = src[i + 1], *s2 = src[i + 2], *s3 = src[i + 3];
    const float a0 = a[i], a1 = a[i + 1], a2 = a[i + 2], a3 = a[i + 3];
    for (int64_t j = 0; j < n; ++j) {
      dst[j] = (((dst[j] + a0 * to_float(s0[j])) + a1 * to_float(s1[j])) + a2 * to_float(s2[j])) +
               a3 * to_float(s3[j]);
    }
  }
  for (; i + 2 <= count; i += 2) {
    const T *s0 = src[i], *s1 = src[i + 1];
    const float a0 = a[i], a1 = a[i + 1];
    for (int64_t j = 0; j < n; ++j) dst[j] = (dst[j] + a0 * to_float(s0[j])) + a1 * to_float(s1[j]);
  }
  if (i < count) add_scaled_row(dst, src[i], a[i], n);
}
template <typename T>
inline void store_row(T* __restrict dst, const float* __restrict src, int64_t n) {
  for (int64_t j = 0; j < n; ++j) dst[j] = from_float<T>(src[j]);
}

// Sums scaled rows into `dst` in the order they are pushed, four at a time (add_scaled_rows); rows of two types
// (the float32 working rows and the bank's) go through two of these, each flushed before the other takes a row.
template <typename T>
struct RowSum {
  float* dst;
  int64_t n;
  const T* src[4];
  float a[4];
  int64_t count = 0;
  void push(const T* row, float weight) {
    src[count] = row;
    a[count] = weight;
    if (++count == 4) flush();
  }
  void flush() {
    add_scaled_rows(dst, src, a, count, n);
    count = 0;
  }
};

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
  for (int64_t n = 0; n < a.W; ++n) {
    if (a.first[n] == n) {
      scale_row(work(n), a.rows + static_cast<int64_t>(a.k_idx[n]) * D, std::exp(a.x[n * a.x_stride]), D);
    }
  }
  std::fill(delta, delta + D, 0.0f);
  RowSum<float> pred{delta, D};
  for (int64_t n = 0; n < a.W; ++n) {
    if (a.first[n] >= 0) pred.push(work(a.first[n]), to_float(a.k_val[n]));
  }
  pred.flush();
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
  RowSum<float> written{reading, D};
  RowSum<BankT> stored{reading, D};
  for (int64_t m = 0; m < a.R; ++m) {
    const int32_t r = a.q_idx[m];
    if (r < 0 || r >= a.K) continue;
    const float q = to_float(a.q_val[m]);
    if (kInPlace || a.read_lane[m] < 0) {
      if constexpr (!kInPlace) written.flush();
      stored.push(a.rows + static_cast<int64_t>(r) * D, q);
    } else {
      stored.flush();
      written.push(work(a.read_lane[m]), q);
    }
  }
  written.flush();
  stored.flush();
}

}  // namespace sdm

#endif  // JAX_SDM_KERNELS_TOKEN_ROWS_CPU_H_
