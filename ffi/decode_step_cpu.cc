// XLA FFI handlers `sdm_decode_step`, `sdm_layer_decode_step` and `sdm_layer_decode_rank_step` (platform cpu):
// check (ffi/decode_step_common.h), then one token of every stream (kernels/decode_step_cpu.cc). The bank arrives
// aliased to the first result (input_output_aliases) and only its written rows are touched.
#include <cstring>

#include "ffi/decode_step_common.h"
#include "kernels/bf16.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error DecodeStepCpu(SDM_FFI_PARAMS(SDM_DECODE_BUFFERS)) {
  constexpr const char* op = "sdm_decode_step";
  sdm_ffi::DecodeCall call;
  SDM_RETURN_IF_ERROR(sdm_ffi::PrepareDecodeStep(op, SDM_FFI_NAMES(SDM_DECODE_BUFFERS), &call));
  // Two buffers only when XLA could not alias them: then (and only then) the whole bank is copied.
  if (call.bank_in != call.bank) std::memcpy(call.bank, call.bank_in, call.bank_bytes);
  return sdm_ffi::RunCatching(op, [&] {
    if (call.type == ffi::DataType::F32)
      sdm::decode_step_cpu(call.dm, call.token<float>(), static_cast<float*>(call.bank));
    else
      sdm::decode_step_cpu(call.dm, call.token<sdm::bf16>(), static_cast<sdm::bf16*>(call.bank));
  });
}

ffi::Error LayerDecodeStepCpu(SDM_FFI_PARAMS(SDM_LAYER_DECODE_BUFFERS)) {
  constexpr const char* op = "sdm_layer_decode_step";
  sdm_ffi::LayerDecodeCall call;
  SDM_RETURN_IF_ERROR(sdm_ffi::PrepareLayerDecodeStep(op, SDM_FFI_NAMES(SDM_LAYER_DECODE_BUFFERS), &call));
  if (call.bank_in != call.bank) std::memcpy(call.bank, call.bank_in, call.bank_bytes);
  return sdm_ffi::RunCatching(op, [&] { sdm::layer_decode_step_cpu(call.dm, call.in, call.bank); });
}

ffi::Error LayerDecodeRankStepCpu(SDM_FFI_PARAMS(SDM_LAYER_DECODE_RANK_BUFFERS)) {
  constexpr const char* op = "sdm_layer_decode_rank_step";
  sdm_ffi::LayerDecodeRankCall call;
  SDM_RETURN_IF_ERROR(
      sdm_ffi::PrepareLayerDecodeRankStep(op, SDM_FFI_NAMES(SDM_LAYER_DECODE_RANK_BUFFERS), &call));
  if (call.layer.bank_in != call.layer.bank) std::memcpy(call.layer.bank, call.layer.bank_in, call.layer.bank_bytes);
  return sdm_ffi::RunCatching(op, [&] {
    sdm::layer_decode_rank_step_cpu(call.layer.dm, call.pk, call.table, call.layer.in, call.layer.bank);
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SdmLayerDecodeRankStepCpu, LayerDecodeRankStepCpu,
                              ffi::Ffi::Bind() SDM_FFI_BINDING(SDM_LAYER_DECODE_RANK_BUFFERS));
XLA_FFI_DEFINE_HANDLER_SYMBOL(SdmLayerDecodeStepCpu, LayerDecodeStepCpu,
                              ffi::Ffi::Bind() SDM_FFI_BINDING(SDM_LAYER_DECODE_BUFFERS));
XLA_FFI_DEFINE_HANDLER_SYMBOL(SdmDecodeStepCpu, DecodeStepCpu,
                              ffi::Ffi::Bind() SDM_FFI_BINDING(SDM_DECODE_BUFFERS));
