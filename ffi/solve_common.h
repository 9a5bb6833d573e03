// Argument checks shared by the CPU and CUDA handlers `sdm_solve` (docs/DESIGN.md "Solve"): a handler binds its
// buffers, calls CheckSolveArgs, then calls its platform's kernel.
#ifndef JAX_SDM_FFI_SOLVE_COMMON_H_
#define JAX_SDM_FFI_SOLVE_COMMON_H_

#include <cstdint>
#include <string>

#include "ffi/common.h"

namespace sdm_ffi {

// Sizes from A [..., C, C] (N: the product of the leading dims); beta [..., C] and the result Minv [..., C, C]
// checked against them.
inline ffi::Error CheckSolveArgs(const char* op, const F32& A, const F32& beta, R32 Minv, int64_t* N,
                                 int64_t* C) {
  auto ad = A.dimensions();
  if (ad.size() < 2) {
    return ffi::Error::InvalidArgument(std::string(op) + ": A must be [..., C, C], got shape " +
                                       DimsToString(ad));
  }
  *N = LeadingProduct(ad, 2);
  *C = ad.back();
  SDM_RETURN_IF_ERROR(CheckShape(op, "A", A, *N, {*C, *C}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "beta", beta, *N, {*C}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "Minv (result)", *Minv, *N, {*C, *C}));
  return ffi::Error::Success();
}

}  // namespace sdm_ffi

// The buffers of `sdm_solve`, in order (docs/DESIGN.md "Solve"; ffi/common.h SDM_FFI_PARAMS), shared by the CPU and
// CUDA handlers.
#define SDM_SOLVE_BUFFERS(X, SEP) \
  X(Arg, ::sdm_ffi::F32, A) SEP() X(Arg, ::sdm_ffi::F32, beta) SEP() X(Ret, ::sdm_ffi::F32, Minv)

#endif  // JAX_SDM_FFI_SOLVE_COMMON_H_
