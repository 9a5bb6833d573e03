// The buffer list of the CPU target sdm_token_recurrence (the no-grad forward as the token recurrence), declared once
// (ffi/common.h SDM_FFI_PARAMS): the handler's parameters, its binding and the description Python reads.
#ifndef JAX_SDM_FFI_TOKEN_RECURRENCE_COMMON_H_
#define JAX_SDM_FFI_TOKEN_RECURRENCE_COMMON_H_

#include "ffi/common.h"

// bank [V..., P, K, D]; k_idx, k_val, x [V..., NC, P, C, W]; v [.., D]; beta [V..., NC, P, C]; q_idx, q_val
// [.., R]; results: the final bank like the input, y [.., D] float32 and repeats [V..., NC, P] int32.
#define SDM_TOKEN_RECURRENCE_BUFFERS(X, SEP)                                                                    \
  X(Arg, ::sdm_ffi::AnyBuffer, bank) SEP() X(Arg, ::sdm_ffi::S32, k_idx) SEP() X(Arg, ::sdm_ffi::F32, k_val)    \
  SEP() X(Arg, ::sdm_ffi::F32, x) SEP() X(Arg, ::sdm_ffi::F32, v) SEP() X(Arg, ::sdm_ffi::F32, beta) SEP()      \
  X(Arg, ::sdm_ffi::S32, q_idx) SEP() X(Arg, ::sdm_ffi::F32, q_val) SEP()                                       \
  X(Ret, ::sdm_ffi::AnyBuffer, bank_out) SEP() X(Ret, ::sdm_ffi::F32, y) SEP() X(Ret, ::sdm_ffi::S32, repeats)

#endif  // JAX_SDM_FFI_TOKEN_RECURRENCE_COMMON_H_
