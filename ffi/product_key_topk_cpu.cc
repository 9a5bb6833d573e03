// XLA FFI handlers `sdm_product_key_topk` and `sdm_product_key_topk_bwd` (platform cpu): check
// (ffi/product_key_topk_common.h), then kernels/product_key_topk_cpu.cc.
#include "ffi/product_key_topk_common.h"
#include "kernels/bf16.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error ProductKeyTopkCpu(SDM_FFI_PARAMS(SDM_PKTOPK_BUFFERS)) {
  constexpr const char* op = "sdm_product_key_topk";
  sdm::ProductKeyDims d;
  SDM_RETURN_IF_ERROR(sdm_ffi::PrepareProductKeyTopk(op, x, table, factors, k, scores, ids, &d));
  return sdm_ffi::RunCatching(op, [&] {
    if (x.element_type() == ffi::DataType::F32)
      sdm::product_key_topk_cpu(d, static_cast<const float*>(x.untyped_data()), table.typed_data(),
                                scores->typed_data(), ids->typed_data());
    else
      sdm::product_key_topk_cpu(d, static_cast<const sdm::bf16*>(x.untyped_data()), table.typed_data(),
                                scores->typed_data(), ids->typed_data());
  });
}

ffi::Error ProductKeyTopkBwdCpu(SDM_FFI_PARAMS(SDM_PKTOPK_BWD_BUFFERS)) {
  constexpr const char* op = "sdm_product_key_topk_bwd";
  sdm::ProductKeyDims d;
  SDM_RETURN_IF_ERROR(sdm_ffi::PrepareProductKeyTopkBwd(op, dscores, ids, factors, *dx, &d));
  return sdm_ffi::RunCatching(op, [&] {
    if (dx->element_type() == ffi::DataType::F32)
      sdm::product_key_topk_bwd_cpu(d, dscores.typed_data(), ids.typed_data(), static_cast<float*>(dx->untyped_data()));
    else
      sdm::product_key_topk_bwd_cpu(d, dscores.typed_data(), ids.typed_data(),
                                    static_cast<sdm::bf16*>(dx->untyped_data()));
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SdmProductKeyTopkCpu, ProductKeyTopkCpu,
                              ffi::Ffi::Bind() SDM_FFI_BINDING(SDM_PKTOPK_BUFFERS));
XLA_FFI_DEFINE_HANDLER_SYMBOL(SdmProductKeyTopkBwdCpu, ProductKeyTopkBwdCpu,
                              ffi::Ffi::Bind() SDM_FFI_BINDING(SDM_PKTOPK_BWD_BUFFERS));
