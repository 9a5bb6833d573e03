// XLA FFI handlers `sdm_product_key_topk` and `sdm_product_key_topk_bwd` (platform CUDA): the CPU handlers' checks
// (ffi/product_key_topk_common.h), then one launch of kernels/product_key_topk_cuda.cu on XLA's stream. No
// allocation, no host synchronisation, the launch configuration from the shapes only: the handlers can be
// captured in CUDA graphs (kCmdBufferCompatible).
#include <cuda_runtime_api.h>

#include "ffi/cuda_common.h"
#include "ffi/product_key_topk_common.h"
#include "kernels/bf16.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error ProductKeyTopkCuda(cudaStream_t stream, SDM_FFI_PARAMS(SDM_PKTOPK_BUFFERS)) {
  constexpr const char* op = "sdm_product_key_topk (CUDA)";
  sdm::ProductKeyDims d;
  SDM_RETURN_IF_ERROR(sdm_ffi::PrepareProductKeyTopk(op, x, table, factors, k, scores, ids, &d));
  const int rc = x.element_type() == ffi::DataType::F32
                     ? sdm::product_key_topk_cuda(d, static_cast<const float*>(x.untyped_data()), table.typed_data(),
                                                  scores->typed_data(), ids->typed_data(), stream)
                     : sdm::product_key_topk_cuda(d, static_cast<const sdm::bf16*>(x.untyped_data()),
                                                  table.typed_data(), scores->typed_data(), ids->typed_data(), stream);
  return sdm_ffi::CudaStatus(op, rc);
}

ffi::Error ProductKeyTopkBwdCuda(cudaStream_t stream, SDM_FFI_PARAMS(SDM_PKTOPK_BWD_BUFFERS)) {
  constexpr const char* op = "sdm_product_key_topk_bwd (CUDA)";
  sdm::ProductKeyDims d;
  SDM_RETURN_IF_ERROR(sdm_ffi::PrepareProductKeyTopkBwd(op, dscores, ids, factors, *dx, &d));
  const int rc = dx->element_type() == ffi::DataType::F32
                     ? sdm::product_key_topk_bwd_cuda(d, dscores.typed_data(), ids.typed_data(),
                                                      static_cast<float*>(dx->untyped_data()), stream)
                     : sdm::product_key_topk_bwd_cuda(d, dscores.typed_data(), ids.typed_data(),
                                                      static_cast<sdm::bf16*>(dx->untyped_data()), stream);
  return sdm_ffi::CudaStatus(op, rc);
}

}  // namespace

SDM_CUDA_HANDLER(SdmProductKeyTopkCuda, ProductKeyTopkCuda, SDM_PKTOPK_BUFFERS);
SDM_CUDA_HANDLER(SdmProductKeyTopkBwdCuda, ProductKeyTopkBwdCuda, SDM_PKTOPK_BWD_BUFFERS);
