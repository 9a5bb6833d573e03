// The buffer list of the CPU target sdm_token_recurrence (the no-grad forward as the token recurrence), declared once
// (ffi/common.h SDM_FFI_PARAMS): the handler's parameters, its binding and the description Python reads.
#ifndef JAX_SDM_FFI_TOKEN_RECURRENCE_COMMON_H_
#define JAX_SDM_FFI_TOKEN_RECURRENCE_COMMON_H_

#include "ffi/common.h"

// The public layout: bank [V..., B, H, K, D]; k_idx, k_val [V..., B, T, H, W]; x like k_idx (per write) or
// [V..., B, T, H] (per token); v [.., D]; beta [V..., B, T, H]; q_idx, q_val [.., R]; the values (k_val, v, q_val)
// in the bank's dtype. Results: the final bank like the input, y [V..., B, T, H, D] in the bank's dtype and repeats
// [V..., B, H] int32.
#define SDM_TOKEN_RECURRENCE_BUFFERS(X, SEP)                                                                    \
  X(Arg, ::sdm_ffi::AnyBuffer, bank) SEP() X(Arg, ::sdm_ffi::S32, k_idx) SEP()                                  \
  X(Arg, ::sdm_ffi::AnyBuffer, k_val) SEP() X(Arg, ::sdm_ffi::F32, x) SEP() X(Arg, ::sdm_ffi::AnyBuffer, v)     \
  SEP() X(Arg, ::sdm_ffi::F32, beta) SEP() X(Arg, ::sdm_ffi::S32, q_idx) SEP()                                  \
  X(Arg, ::sdm_ffi::AnyBuffer, q_val) SEP() X(Ret, ::sdm_ffi::AnyBuffer, bank_out) SEP()                        \
  X(Ret, ::sdm_ffi::AnyBuffer, y) SEP() X(Ret, ::sdm_ffi::S32, repeats)

#endif  // JAX_SDM_FFI_TOKEN_RECURRENCE_COMMON_H_
