// XLA FFI handlers `sdm_decode_step`, `sdm_layer_decode_step` and `sdm_layer_decode_rank_step` (platform CUDA):
// the CPU handlers' checks (ffi/decode_step_common.h), then one launch of kernels/decode_step_cuda.cu on XLA's
// stream. No allocation, no host synchronisation, the launch configuration from the shapes only: the handlers can be
// captured in CUDA graphs (kCmdBufferCompatible). The bank arrives aliased to the first result
// (input_output_aliases) and only its written rows are touched.
#include <cuda_runtime_api.h>

#include <string>

#include "ffi/cuda_common.h"
#include "ffi/decode_step_common.h"
#include "kernels/bf16.h"

namespace ffi = xla::ffi;

namespace {

// The kernel's lane limit, then the bank copied into its result where XLA could not alias the two (then, and only
// then, the whole bank is copied), then `launch()`.
template <typename Launch>
ffi::Error RunDecode(cudaStream_t stream, const char* op, int64_t W, int64_t R, const void* bank_in, void* bank,
                     size_t bank_bytes, Launch launch) {
  if (W > sdm::kDecodeCudaMaxLanes || R > sdm::kDecodeCudaMaxLanes) {
    return ffi::Error::InvalidArgument(std::string(op) + ": W=" + std::to_string(W) + " and R=" + std::to_string(R) +
                                       " must be at most " + std::to_string(sdm::kDecodeCudaMaxLanes));
  }
  int rc = 0;
  if (bank_in != bank)
    rc = static_cast<int>(cudaMemcpyAsync(bank, bank_in, bank_bytes, cudaMemcpyDeviceToDevice, stream));
  if (!rc) rc = launch();
  return sdm_ffi::CudaStatus(op, rc);
}

ffi::Error DecodeStepCuda(cudaStream_t stream, SDM_FFI_PARAMS(SDM_DECODE_BUFFERS)) {
  constexpr const char* op = "sdm_decode_step (CUDA)";
  sdm_ffi::DecodeCall call;
  SDM_RETURN_IF_ERROR(sdm_ffi::PrepareDecodeStep(op, SDM_FFI_NAMES(SDM_DECODE_BUFFERS), &call));
  return RunDecode(stream, op, call.dm.W, call.dm.R, call.bank_in, call.bank, call.bank_bytes, [&] {
    return call.type == ffi::DataType::F32
               ? sdm::decode_step_cuda(call.dm, call.token<float>(), static_cast<float*>(call.bank), stream)
               : sdm::decode_step_cuda(call.dm, call.token<sdm::bf16>(), static_cast<sdm::bf16*>(call.bank), stream);
  });
}

ffi::Error LayerDecodeStepCuda(cudaStream_t stream, SDM_FFI_PARAMS(SDM_LAYER_DECODE_BUFFERS)) {
  constexpr const char* op = "sdm_layer_decode_step (CUDA)";
  sdm_ffi::LayerDecodeCall call;
  SDM_RETURN_IF_ERROR(sdm_ffi::PrepareLayerDecodeStep(op, SDM_FFI_NAMES(SDM_LAYER_DECODE_BUFFERS), &call));
  return RunDecode(stream, op, call.dm.W, call.dm.R, call.bank_in, call.bank, call.bank_bytes,
                   [&] { return sdm::layer_decode_step_cuda(call.dm, call.in, call.bank, stream); });
}

ffi::Error LayerDecodeRankStepCuda(cudaStream_t stream, SDM_FFI_PARAMS(SDM_LAYER_DECODE_RANK_BUFFERS)) {
  constexpr const char* op = "sdm_layer_decode_rank_step (CUDA)";
  sdm_ffi::LayerDecodeRankCall call;
  SDM_RETURN_IF_ERROR(
      sdm_ffi::PrepareLayerDecodeRankStep(op, SDM_FFI_NAMES(SDM_LAYER_DECODE_RANK_BUFFERS), &call));
  if (call.pk.F > sdm::kLayerRankMaxFactors || call.pk.k > sdm::kLayerRankMaxK) {
    return ffi::Error::InvalidArgument(std::string(op) + ": ranks at most " +
                                       std::to_string(sdm::kLayerRankMaxFactors) + " factors and k <= " +
                                       std::to_string(sdm::kLayerRankMaxK) + ", got " + std::to_string(call.pk.F) +
                                       " and " + std::to_string(call.pk.k));
  }
  const sdm_ffi::LayerDecodeCall& c = call.layer;
  return RunDecode(stream, op, c.dm.W, c.dm.R, c.bank_in, c.bank, c.bank_bytes, [&] {
    return sdm::layer_decode_rank_step_cuda(c.dm, call.pk, call.table, c.in, c.bank, stream);
  });
}

}  // namespace

SDM_CUDA_HANDLER(SdmLayerDecodeRankStepCuda, LayerDecodeRankStepCuda, SDM_LAYER_DECODE_RANK_BUFFERS);
SDM_CUDA_HANDLER(SdmLayerDecodeStepCuda, LayerDecodeStepCuda, SDM_LAYER_DECODE_BUFFERS);
SDM_CUDA_HANDLER(SdmDecodeStepCuda, DecodeStepCuda, SDM_DECODE_BUFFERS);
