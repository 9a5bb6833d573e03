// The token recurrence (docs/MATH.md "Token recurrence") run directly, token after token: the CPU's forward of
// `sdm_write_read` when nothing is differentiated. Plain C++ on raw pointers.
//
// A no-grad forward needs none of the chunked form's bank-independent work (Phase 1's sort, the solves, the
// snapshot): on a CPU each token is O((W + R) D) per stream, a few rows, and running them in order is cheaper.
//
// Layout (as kernels/steps.h): per-token arrays are [V, NC, P, C, ...] (V independent problems, e.g. from vmap, NC
// chunks, P streams), the token t = c*C + i of stream (v, p) at index ((v*NC + c)*P + p)*C + i; the bank is
// [V, P, K, D], the rows of stream (v, p) at (v*P + p)*K. Tokens past the end of a sequence carry slot ids
// outside [0, K): they touch no row.
//
// Each token of a stream runs `token_rows_cpu` (the decode step's arithmetic, shared with kernels/decode_step_cpu.cc),
// so a bfloat16 bank is rounded once per written row per token (the chunked kernels round once per written row
// per chunk; a decode loop of `sdm_step` gives the same bits as this forward). Streams are independent: they
// run in parallel blocks, each stream by one thread in token order, so results are bitwise reproducible.
#ifndef JAX_SDM_KERNELS_TOKEN_RECURRENCE_H_
#define JAX_SDM_KERNELS_TOKEN_RECURRENCE_H_

#include <cstdint>

namespace sdm {

struct TokenRecurrenceDims {
  int64_t V, NC, P, C, K, D, W, R;
  int64_t streams() const { return V * P; }
};

// The token arrays in float32 (the values of a bfloat16 problem widened), gates per write lane.
struct TokenRecurrenceIO {
  const int32_t* k_idx;  // [V, NC, P, C, W]
  const float* k_val;    // [V, NC, P, C, W]
  const float* x;        // [V, NC, P, C, W] log-gates, per lane
  const float* v;        // [V, NC, P, C, D]
  const float* beta;     // [V, NC, P, C]
  const int32_t* q_idx;  // [V, NC, P, C, R]
  const float* q_val;    // [V, NC, P, C, R]
  float* y;              // [V, NC, P, C, D] out: the readings
  int32_t* repeats;      // [V, NC, P] out: per chunk, the write lanes repeating an earlier lane's slot in their token
};

// Every token of every stream: `bank` ([V, P, K, D]) becomes the final bank, from `initial` (the same shape; each
// stream's rows are copied by the thread that runs the stream, or not at all if `initial` is `bank`).
// BankT is float or sdm::bf16.
template <typename BankT>
void token_recurrence_cpu(const TokenRecurrenceDims& dims, const TokenRecurrenceIO& io, const BankT* initial,
                          BankT* bank);

}  // namespace sdm

#endif  // JAX_SDM_KERNELS_TOKEN_RECURRENCE_H_
