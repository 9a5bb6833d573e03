// XLA FFI handler `sdm_solve` (platform CUDA): Minv = (I + diag(beta) A)^{-1} per unit (docs/DESIGN.md "Solve");
// any leading batch dims (their product is N). Runs on XLA's stream; no allocation, no host synchronisation; the
// launch configuration depends on the shapes only, so the handler is safe to capture in a CUDA graph
// (kCmdBufferCompatible). The checks of the CPU handler (ffi/solve_common.h), then the kernel's limit on C.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "ffi/cuda_common.h"
#include "ffi/solve_common.h"
#include "kernels/solve.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error SolveCudaImpl(cudaStream_t stream, SDM_FFI_PARAMS(SDM_SOLVE_BUFFERS)) {
  constexpr const char* op = "sdm_solve (CUDA)";
  int64_t N, C;
  SDM_RETURN_IF_ERROR(sdm_ffi::CheckSolveArgs(op, A, beta, Minv, &N, &C));
  if (C > sdm::kSolveCudaMaxC) {
    return ffi::Error::InvalidArgument(
        std::string(op) + ": chunk size C=" + std::to_string(C) +
        " exceeds the kernel's limit of " + std::to_string(sdm::kSolveCudaMaxC));
  }
  const int rc = sdm::solve_cuda(A.typed_data(), beta.typed_data(), N, C,
                                 Minv->typed_data(), stream);
  return sdm_ffi::CudaStatus(op, rc);
}

}  // namespace

SDM_CUDA_HANDLER(SdmSolveCuda, SolveCudaImpl, SDM_SOLVE_BUFFERS);
