// The token recurrence (docs/MATH.md "Token recurrence") run directly, token after token: the CPU's forward of
// `sdm_write_read` when nothing is differentiated. Plain C++ on raw pointers.
//
// A no-grad forward needs none of the chunked form's bank-independent work (Phase 1's sort, the solves, the
// snapshot): on a CPU each token is O((W + R) D) per stream, a few rows, and running them in order is cheaper.
//
// Layout: the public one, so that the op's arguments reach the kernel as they are (no relayout, no widening, no
// temporaries that grow with T). Per-token arrays are [V, B, T, H, ...] (V independent problems, e.g. from vmap;
// the stream (v, b, h) is s = (v*B + b)*H + h, its token t at index ((v*B + b)*T + t)*H + h); the bank is
// [V, B, H, K, D], the rows of stream s at s*K. Slot ids outside [0, K) touch no row and read zeros.
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
  int64_t V, B, T, H, K, D, W, R;
  bool per_write_gates;  // x is [V, B, T, H, W], else [V, B, T, H]
  int64_t streams() const { return V * B * H; }
};

// The token arrays; the values and the readings in the bank's type BankT.
template <typename BankT>
struct TokenRecurrenceIO {
  const int32_t* k_idx;  // [V, B, T, H, W]
  const BankT* k_val;    // [V, B, T, H, W]
  const float* x;        // [V, B, T, H, W] or [V, B, T, H] log-gates
  const BankT* v;        // [V, B, T, H, D]
  const float* beta;     // [V, B, T, H]
  const int32_t* q_idx;  // [V, B, T, H, R]
  const BankT* q_val;    // [V, B, T, H, R]
  BankT* y;              // [V, B, T, H, D] out: the readings
  int32_t* repeats;      // [V, B, H] out: the write lanes repeating an earlier lane's slot in their token
};

// Every token of every stream: `bank` ([V, B, H, K, D]) becomes the final bank, from `initial` (the same shape;
// each stream's rows are copied by the thread that runs the stream, or not at all if `initial` is `bank`).
// BankT is float or sdm::bf16.
template <typename BankT>
void token_recurrence_cpu(const TokenRecurrenceDims& dims, const TokenRecurrenceIO<BankT>& io, const BankT* initial,
                          BankT* bank);

}  // namespace sdm

#endif  // JAX_SDM_KERNELS_TOKEN_RECURRENCE_H_
