// The fused decode step (`jax_sdm.sdm_step`): one token of the token recurrence (docs/MATH.md) for every stream,
// with the bank updated in place. Plain C++ / CUDA on raw pointers.
//
// Layout: S independent streams; the bank is [S, K, D] (stream s's rows at s*K), per-token arrays are [S, W]
// (writes), [S, R] (reads), [S, D] (v, y), [S] (beta) and the gates [S] (per token) or [S, W] (per write).
// Per stream, with `first[n]` the first valid lane writing lane n's slot and `cur[n]` (float32, n a first lane)
// the working value of that row:
//
//   cur[n] = exp(x_n) * S[s_n]                 for each first lane n (each distinct written slot decays once)
//   pred   = sum_n k_n cur[first[n]]           lanes n = 0, 1, ..., W-1 (after the decay, before the write)
//   d      = beta (v - pred)
//   cur[first[n]] += k_n d                     lanes in order
//   S[s_n] = cur[n]                            for each first lane n (rounded once to the bank's dtype)
//   y      = sum_m q_m (r_m written ? cur[first lane of r_m] : S[r_m])    lanes m in order (read after the write)
//
// Lanes whose slot id is outside [0, K) take no part (they read zeros and touch no row). Everything above is
// column by column: column j of a stream depends on column j only, so each column has one owner (a thread on
// the GPU, a loop iteration on the CPU) that runs the whole token in lane order. Only the W written rows are
// touched, so a step costs O((W + R) D) per stream, independent of K, and results are bitwise reproducible.
#ifndef JAX_SDM_KERNELS_DECODE_STEP_H_
#define JAX_SDM_KERNELS_DECODE_STEP_H_

#include <cstdint>

struct CUstream_st;  // cudaStream_t, declared so that this header needs no CUDA include

#include "kernels/host_device.h"

namespace sdm {

// The first write lane of a stream's token ([W] slot ids) that writes `slot`; -1 if none does or if `slot` is
// outside [0, K). For a write lane n, first_write_lane(.., k_idx[n]) is `first[n]` (n itself unless a repeat).
SDM_HOST_DEVICE inline int32_t first_write_lane(const int32_t* k_idx, int64_t W, int64_t K, int32_t slot) {
  if (slot < 0 || slot >= K) return -1;
  for (int64_t n = 0; n < W; ++n) {
    if (k_idx[n] == slot) return static_cast<int32_t>(n);
  }
  return -1;
}

struct DecodeDims {
  int64_t S, K, D, W, R;
  bool per_write_gates;  // x is [S, W] (else [S], one gate per token)
};

// The token, one per stream. ValT is the bank's type (float or sdm::bf16 / __nv_bfloat16).
template <typename ValT>
struct DecodeToken {
  const int32_t* k_idx;  // [S, W]
  const ValT* k_val;     // [S, W]
  const float* x;        // [S] or [S, W] log-gates
  const ValT* v;         // [S, D]
  const float* beta;     // [S]
  const int32_t* q_idx;  // [S, R]
  const ValT* q_val;     // [S, R]
  ValT* y;               // [S, D] out
};

// The bank ([S, K, D], in/out) goes one token forward. BankT is float or sdm::bf16.
template <typename BankT>
void decode_step_cpu(const DecodeDims& dims, const DecodeToken<BankT>& token, BankT* bank);

// Largest W and R of the CUDA kernel (a warp's working rows fit the default shared memory).
constexpr int64_t kDecodeCudaMaxLanes = 256;

// The same on `stream`, one launch; no allocation, no synchronisation, launch configuration from the shapes only.
// BankT is float or __nv_bfloat16 (passed as sdm::bf16, same layout). Returns the cudaError_t of the launch.
template <typename BankT>
int decode_step_cuda(const DecodeDims& dims, const DecodeToken<BankT>& token, BankT* bank, CUstream_st* stream);

}  // namespace sdm

#endif  // JAX_SDM_KERNELS_DECODE_STEP_H_
