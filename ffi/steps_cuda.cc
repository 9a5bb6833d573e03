// XLA FFI handlers `sdm_forward` and `sdm_backward` (platform CUDA): the same checks and buffers as the CPU
// handlers (ffi/steps_common.h), then the chunk loops of kernels/steps_cuda.cu on XLA's stream. No allocation
// (the workspace is a result buffer), no host synchronisation, launches from the shapes only: the handlers can
// be captured in CUDA graphs (kCmdBufferCompatible).
#include <cuda_runtime_api.h>

#include <string>

#include "ffi/cuda_common.h"
#include "ffi/steps_common.h"
#include "kernels/bf16.h"

namespace ffi = xla::ffi;

namespace {

// The result aliases the input; copy only if XLA handed two buffers.
int AliasCopy(const void* in, void* out, size_t bytes, cudaStream_t stream) {
  if (in == out) return 0;
  return static_cast<int>(cudaMemcpyAsync(out, in, bytes, cudaMemcpyDeviceToDevice, stream));
}

ffi::Error ForwardCuda(cudaStream_t stream, SDM_FORWARD_PARAMS) {
  sdm_ffi::ForwardCall call;
  SDM_RETURN_IF_ERROR(sdm_ffi::PrepareForward(SDM_FORWARD_NAMES, &call));
  int rc = AliasCopy(call.bank_in, call.bank, call.bank_bytes, stream);
  if (!rc) {
    rc = call.type == ffi::DataType::F32
             ? sdm::forward_cuda(call.dm, call.p1, call.io, static_cast<float*>(call.bank), call.workspace, stream)
             : sdm::forward_cuda(call.dm, call.p1, call.io, static_cast<sdm::bf16*>(call.bank), call.workspace,
                                 stream);
  }
  return sdm_ffi::CudaStatus("sdm_forward", rc);
}

ffi::Error BackwardCuda(cudaStream_t stream, SDM_BACKWARD_PARAMS) {
  sdm_ffi::BackwardCall call;
  SDM_RETURN_IF_ERROR(sdm_ffi::PrepareBackward(SDM_BACKWARD_NAMES, &call));
  int rc = AliasCopy(call.bank_in, call.bank, call.bank_bytes, stream);
  if (!rc) rc = AliasCopy(call.dbank_in, call.dbank, call.dbank_bytes, stream);
  if (!rc) {
    rc = sdm_ffi::WithBankTypes(call, [&](auto* bank, auto* dbank) {
      return sdm::backward_cuda(call.dm, call.p1, call.io, bank, dbank, call.workspace, stream);
    });
  }
  return sdm_ffi::CudaStatus("sdm_backward", rc);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SdmForwardCuda, ForwardCuda,
                              ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().SDM_FORWARD_BUFFERS,
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(SdmBackwardCuda, BackwardCuda,
                              ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().SDM_BACKWARD_BUFFERS,
                              {xla::ffi::Traits::kCmdBufferCompatible});
