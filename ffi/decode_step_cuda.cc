// XLA FFI handler `sdm_decode_step` (platform CUDA): the CPU handler's checks (ffi/decode_step_common.h), then one
// launch of kernels/decode_step_cuda.cu on XLA's stream. No allocation, no host synchronisation, the launch
// configuration from the shapes only: the handler can be captured in CUDA graphs (kCmdBufferCompatible). The bank
// arrives aliased to the first result (input_output_aliases) and only its written rows are touched.
#include <cuda_runtime_api.h>

#include <string>

#include "ffi/cuda_common.h"
#include "ffi/decode_step_common.h"
#include "kernels/bf16.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error DecodeStepCuda(cudaStream_t stream, SDM_FFI_PARAMS(SDM_DECODE_BUFFERS)) {
  constexpr const char* op = "sdm_decode_step (CUDA)";
  sdm_ffi::DecodeCall call;
  SDM_RETURN_IF_ERROR(sdm_ffi::PrepareDecodeStep(op, SDM_FFI_NAMES(SDM_DECODE_BUFFERS), &call));
  if (call.dm.W > sdm::kDecodeCudaMaxLanes || call.dm.R > sdm::kDecodeCudaMaxLanes) {
    return ffi::Error::InvalidArgument(std::string(op) + ": W=" + std::to_string(call.dm.W) + " and R=" +
                                       std::to_string(call.dm.R) + " must be at most " +
                                       std::to_string(sdm::kDecodeCudaMaxLanes));
  }
  // Two buffers only when XLA could not alias them: then (and only then) the whole bank is copied.
  int rc = 0;
  if (call.bank_in != call.bank)
    rc = static_cast<int>(cudaMemcpyAsync(call.bank, call.bank_in, call.bank_bytes, cudaMemcpyDeviceToDevice, stream));
  if (!rc) {
    rc = call.type == ffi::DataType::F32
             ? sdm::decode_step_cuda(call.dm, call.token<float>(), static_cast<float*>(call.bank), stream)
             : sdm::decode_step_cuda(call.dm, call.token<sdm::bf16>(), static_cast<sdm::bf16*>(call.bank), stream);
  }
  return sdm_ffi::CudaStatus(op, rc);
}

}  // namespace

SDM_CUDA_HANDLER(SdmDecodeStepCuda, DecodeStepCuda, SDM_DECODE_BUFFERS);
