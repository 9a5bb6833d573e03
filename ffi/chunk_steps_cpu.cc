// XLA FFI handlers `sdm_forward` and `sdm_backward`, their packed-sequence variants `sdm_forward_packed` and
// `sdm_backward_packed`, and the no-grad forward's slab `sdm_forward_slab` (platform cpu): check, then run the
// chunk loops of kernels/chunk_steps/cpu.cc (docs/DESIGN.md "Forward steps", "Backward steps"). The forward's bank
// is updated in place: it arrives aliased to the first result (input_output_aliases); the backward reads the
// forward's input bank and updates the gradient bank in place. The workspace result is the CUDA kernels'; the CPU
// kernels keep their scratch per thread.
#include <cstring>
#include <string>

#include "ffi/chunk_steps_common.h"
#include "kernels/bf16.h"

namespace ffi = xla::ffi;
using sdm_ffi::F32;
using sdm_ffi::S32;

namespace {

// The result aliases the input; copy only if XLA handed two buffers (a null input: zeros, the backward's zero
// cotangent).
void AliasCopy(const void* in, void* out, size_t bytes) {
  if (in == nullptr) std::memset(out, 0, bytes);
  else if (in != out) std::memcpy(out, in, bytes);
}

// The forward's input bank into its result, repeated for a bank the streams share (StepDims::input_streams: the
// result's blocks of streams s with equal s % input_streams are the input's); nothing if XLA aliased them.
void TileCopy(const void* in, size_t in_bytes, void* out, size_t bytes) {
  if (in == out) return;
  for (size_t at = 0; at < bytes; at += in_bytes) std::memcpy(static_cast<char*>(out) + at, in, in_bytes);
}

// Runs a checked call; `segments`: null, or the packed sequences' buffers.
ffi::Error RunForward(const sdm_ffi::ForwardCall& call, const sdm::StepSegments* segments) {
  TileCopy(call.bank_in, call.bank_in_bytes, call.bank, call.bank_bytes);
  return sdm_ffi::RunCatching("sdm_forward", [&] {
    if (call.type == ffi::DataType::F32)
      sdm::forward_cpu(call.dm, call.p1, call.io, static_cast<float*>(call.bank), segments);
    else
      sdm::forward_cpu(call.dm, call.p1, call.io, static_cast<sdm::bf16*>(call.bank), segments);
  });
}

ffi::Error RunBackward(const sdm_ffi::BackwardCall& call, const sdm::StepSegments* segments) {
  AliasCopy(call.dbank_in, call.dbank, call.dbank_bytes);
  return sdm_ffi::RunCatching("sdm_backward", [&] {
    sdm_ffi::WithBankTypes(call, [&](const auto* bank_in, auto* dbank) {
      sdm::backward_cpu(call.dm, call.p1, call.io, bank_in, dbank, segments);
    });
  });
}

ffi::Error ForwardCpu(SDM_FFI_PARAMS(SDM_FORWARD_BUFFERS)) {
  sdm_ffi::ForwardCall call;
  SDM_RETURN_IF_ERROR(sdm_ffi::PrepareForward(SDM_FFI_NAMES(SDM_FORWARD_BUFFERS), &call));
  return RunForward(call, nullptr);
}

ffi::Error BackwardCpu(SDM_FFI_PARAMS(SDM_BACKWARD_BUFFERS)) {
  sdm_ffi::BackwardCall call;
  SDM_RETURN_IF_ERROR(sdm_ffi::PrepareBackward(SDM_FFI_NAMES(SDM_BACKWARD_BUFFERS), &call));
  return RunBackward(call, nullptr);
}

ffi::Error ForwardPackedCpu(SDM_FFI_PARAMS(SDM_FORWARD_PACKED_BUFFERS)) {
  sdm_ffi::ForwardCall call;
  sdm::StepSegments segments;
  SDM_RETURN_IF_ERROR(
      sdm_ffi::PrepareForwardPacked(SDM_FFI_NAMES(SDM_FORWARD_PACKED_BUFFERS), &call, &segments));
  return RunForward(call, &segments);
}

// A slab of the no-grad forward in slabs: the first copies the input bank into its result, the later ones update
// the carried bank in place. The first steps are the CUDA loops' (they read rows from the input until their first
// write); these loops never read them, so the first slab leaves zeros.
ffi::Error ForwardSlabCpu(SDM_FFI_PARAMS(SDM_FORWARD_SLAB_BUFFERS)) {
  sdm_ffi::ForwardCall call;
  sdm::SlabCarry slab;
  SDM_RETURN_IF_ERROR(sdm_ffi::PrepareForwardSlab(SDM_FFI_NAMES(SDM_FORWARD_SLAB_BUFFERS), &call, &slab));
  if (slab.first_slab) std::memset(slab.first, 0, first_out->size_bytes());
  else call.bank_in = call.bank;  // the carried bank, not the input
  return RunForward(call, nullptr);
}

ffi::Error BackwardPackedCpu(SDM_FFI_PARAMS(SDM_BACKWARD_PACKED_BUFFERS)) {
  sdm_ffi::BackwardCall call;
  sdm::StepSegments segments;
  sdm_ffi::SegmentCopies copies;
  SDM_RETURN_IF_ERROR(sdm_ffi::PrepareBackwardPacked(SDM_FFI_NAMES(SDM_BACKWARD_PACKED_BUFFERS), &call,
                                                     &segments, &copies));
  for (int i = 0; i < 2; ++i) AliasCopy(copies.in[i], copies.out[i], copies.bytes[i]);
  return RunBackward(call, &segments);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SdmForwardCpu, ForwardCpu, ffi::Ffi::Bind() SDM_FFI_BINDING(SDM_FORWARD_BUFFERS));
XLA_FFI_DEFINE_HANDLER_SYMBOL(SdmBackwardCpu, BackwardCpu, ffi::Ffi::Bind() SDM_FFI_BINDING(SDM_BACKWARD_BUFFERS));
XLA_FFI_DEFINE_HANDLER_SYMBOL(SdmForwardPackedCpu, ForwardPackedCpu,
                              ffi::Ffi::Bind() SDM_FFI_BINDING(SDM_FORWARD_PACKED_BUFFERS));
XLA_FFI_DEFINE_HANDLER_SYMBOL(SdmBackwardPackedCpu, BackwardPackedCpu,
                              ffi::Ffi::Bind() SDM_FFI_BINDING(SDM_BACKWARD_PACKED_BUFFERS));
XLA_FFI_DEFINE_HANDLER_SYMBOL(SdmForwardSlabCpu, ForwardSlabCpu,
                              ffi::Ffi::Bind() SDM_FFI_BINDING(SDM_FORWARD_SLAB_BUFFERS));
