// XLA FFI handler `sdm_solve` (platform cpu): Minv = (I + diag(beta) A)^{-1}
// per unit (docs/DESIGN.md "Solve"); any leading batch dims (their product is N).
// The checks are shared with the CUDA handler (ffi/solve_common.h).
#include <cstdint>
#include <string>

#include "ffi/solve_common.h"
#include "kernels/solve.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error SolveCpuImpl(SDM_FFI_PARAMS(SDM_SOLVE_BUFFERS)) {
  constexpr const char* op = "sdm_solve";
  int64_t N, C;
  SDM_RETURN_IF_ERROR(sdm_ffi::CheckSolveArgs(op, A, beta, Minv, &N, &C));
  return sdm_ffi::RunCatching(
      op, [&] { sdm::solve_cpu(A.typed_data(), beta.typed_data(), N, C, Minv->typed_data()); });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SdmSolveCpu, SolveCpuImpl, ffi::Ffi::Bind() SDM_FFI_BINDING(SDM_SOLVE_BUFFERS));
