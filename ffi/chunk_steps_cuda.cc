// XLA FFI handlers `sdm_forward` and `sdm_backward`, their packed-sequence variants `sdm_forward_packed` and
// `sdm_backward_packed`, and the no-grad forward's slab `sdm_forward_slab` (platform CUDA): the same checks and
// buffers as the CPU handlers (ffi/chunk_steps_common.h), then the chunk loops of kernels/chunk_steps/
// (forward_cuda.cu, backward_cuda.cu) on XLA's stream. No allocation (the workspace is a result buffer), no host
// synchronisation, launches from the shapes only: the handlers can be captured in CUDA graphs
// (kCmdBufferCompatible).
#include <cuda_runtime_api.h>

#include <string>
#include <type_traits>

#include "ffi/cuda_common.h"
#include "ffi/chunk_steps_common.h"
#include "kernels/bf16.h"

namespace ffi = xla::ffi;

namespace {

// The result aliases the input; copy only if XLA handed two buffers.
int AliasCopy(const void* in, void* out, size_t bytes, cudaStream_t stream) {
  if (in == out) return 0;
  return static_cast<int>(cudaMemcpyAsync(out, in, bytes, cudaMemcpyDeviceToDevice, stream));
}

// Runs a checked call; `segments`: null, or the packed sequences' buffers.
ffi::Error RunForward(cudaStream_t stream, const sdm_ffi::ForwardCall& call, const sdm::StepSegments* segments,
                      const char* name, const sdm::SlabCarry* slab = nullptr) {
  // Two bank buffers (the forward's result does not alias its input): the kernels read each row from the input
  // until its first write instead of copying the whole bank first.
  const int rc =
      call.type == ffi::DataType::F32
          ? sdm::forward_cuda(call.dm, call.p1, call.io, static_cast<const float*>(call.bank_in),
                              static_cast<float*>(call.bank), call.workspace, stream, segments, slab)
          : sdm::forward_cuda(call.dm, call.p1, call.io, static_cast<const sdm::bf16*>(call.bank_in),
                              static_cast<sdm::bf16*>(call.bank), call.workspace, stream, segments, slab);
  return sdm_ffi::CudaStatus(name, rc);
}

ffi::Error RunBackward(cudaStream_t stream, const sdm_ffi::BackwardCall& call, const sdm::StepSegments* segments,
                       int rc, const char* name) {
  if (!rc) {
    // Two gradient-bank buffers (the result does not alias the cotangent): the kernels read each row of the
    // cotangent until its first write instead of copying it whole first.
    rc = sdm_ffi::WithBankTypes(call, [&](const auto* bank_in, auto* dbank) {
      const auto* dbank_in = static_cast<const std::remove_pointer_t<decltype(dbank)>*>(call.dbank_in);
      return sdm::backward_cuda(call.dm, call.p1, call.io, bank_in, dbank_in, dbank, call.workspace, stream,
                                segments);
    });
  }
  return sdm_ffi::CudaStatus(name, rc);
}

ffi::Error ForwardCuda(cudaStream_t stream, SDM_FFI_PARAMS(SDM_FORWARD_BUFFERS)) {
  sdm_ffi::ForwardCall call;
  SDM_RETURN_IF_ERROR(sdm_ffi::PrepareForward(SDM_FFI_NAMES(SDM_FORWARD_BUFFERS), &call));
  return RunForward(stream, call, nullptr, "sdm_forward");
}

ffi::Error BackwardCuda(cudaStream_t stream, SDM_FFI_PARAMS(SDM_BACKWARD_BUFFERS)) {
  sdm_ffi::BackwardCall call;
  SDM_RETURN_IF_ERROR(sdm_ffi::PrepareBackward(SDM_FFI_NAMES(SDM_BACKWARD_BUFFERS), &call));
  return RunBackward(stream, call, nullptr, 0, "sdm_backward");
}

ffi::Error ForwardPackedCuda(cudaStream_t stream, SDM_FFI_PARAMS(SDM_FORWARD_PACKED_BUFFERS)) {
  sdm_ffi::ForwardCall call;
  sdm::StepSegments segments;
  SDM_RETURN_IF_ERROR(
      sdm_ffi::PrepareForwardPacked(SDM_FFI_NAMES(SDM_FORWARD_PACKED_BUFFERS), &call, &segments));
  return RunForward(stream, call, &segments, "sdm_forward_packed");
}

ffi::Error ForwardSlabCuda(cudaStream_t stream, SDM_FFI_PARAMS(SDM_FORWARD_SLAB_BUFFERS)) {
  sdm_ffi::ForwardCall call;
  sdm::SlabCarry slab;
  SDM_RETURN_IF_ERROR(sdm_ffi::PrepareForwardSlab(SDM_FFI_NAMES(SDM_FORWARD_SLAB_BUFFERS), &call, &slab));
  return RunForward(stream, call, nullptr, "sdm_forward_slab", &slab);
}

ffi::Error BackwardPackedCuda(cudaStream_t stream, SDM_FFI_PARAMS(SDM_BACKWARD_PACKED_BUFFERS)) {
  sdm_ffi::BackwardCall call;
  sdm::StepSegments segments;
  sdm_ffi::SegmentCopies copies;
  SDM_RETURN_IF_ERROR(sdm_ffi::PrepareBackwardPacked(SDM_FFI_NAMES(SDM_BACKWARD_PACKED_BUFFERS), &call,
                                                     &segments, &copies));
  int rc = 0;
  for (int i = 0; i < 2 && !rc; ++i) rc = AliasCopy(copies.in[i], copies.out[i], copies.bytes[i], stream);
  return RunBackward(stream, call, &segments, rc, "sdm_backward_packed");
}

}  // namespace

SDM_CUDA_HANDLER(SdmForwardCuda, ForwardCuda, SDM_FORWARD_BUFFERS);
SDM_CUDA_HANDLER(SdmBackwardCuda, BackwardCuda, SDM_BACKWARD_BUFFERS);
SDM_CUDA_HANDLER(SdmForwardPackedCuda, ForwardPackedCuda, SDM_FORWARD_PACKED_BUFFERS);
SDM_CUDA_HANDLER(SdmBackwardPackedCuda, BackwardPackedCuda, SDM_BACKWARD_PACKED_BUFFERS);
SDM_CUDA_HANDLER(SdmForwardSlabCuda, ForwardSlabCuda, SDM_FORWARD_SLAB_BUFFERS);
