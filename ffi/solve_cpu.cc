// XLA FFI handler `sdm_solve` (platform cpu): Minv = (I + diag(beta) A)^{-1}
// per unit (docs/DESIGN.md "Solve"); any leading batch dims (their product is N).
#include <cstdint>
#include <exception>
#include <string>

#include "ffi/common.h"
#include "kernels/solve.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error SolveCpuImpl(ffi::Buffer<ffi::F32> A, ffi::Buffer<ffi::F32> beta,
                        ffi::ResultBuffer<ffi::F32> Minv) {
  constexpr const char* op = "sdm_solve";
  auto ad = A.dimensions();
  if (ad.size() < 2) {
    return ffi::Error::InvalidArgument(std::string(op) + ": A must be [..., C, C], got shape " +
                                       sdm_ffi::DimsToString(ad));
  }
  const int64_t N = sdm_ffi::LeadingProduct(ad, 2), C = ad.back();
  SDM_RETURN_IF_ERROR(sdm_ffi::CheckShape(op, "A", A, N, {C, C}));
  SDM_RETURN_IF_ERROR(sdm_ffi::CheckShape(op, "beta", beta, N, {C}));
  SDM_RETURN_IF_ERROR(sdm_ffi::CheckShape(op, "Minv (result)", *Minv, N, {C, C}));
  try {
    sdm::solve_cpu(A.typed_data(), beta.typed_data(), N, C, Minv->typed_data());
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string(op) + ": " + e.what());
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SdmSolveCpu, SolveCpuImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // A
                                  .Arg<ffi::Buffer<ffi::F32>>()  // beta
                                  .Ret<ffi::Buffer<ffi::F32>>()  // Minv
);
