// XLA FFI handlers `sdm_phase1` and `sdm_phase1_bwd` (platform cpu): check the buffers and the attribute
// (ffi/phase1_common.h), then run kernels/phase1 (docs/DESIGN.md "Phase 1", "Phase-1 backward"). Every buffer may
// carry any number of leading batch dims in front of the per-unit shape; their product is the unit count N (vmap
// with vmap_method="broadcast_all" adds them). The trailing workspace is the CUDA handlers': ignored here.
#include <cstdint>
#include <limits>
#include <string>

#include "ffi/phase1_common.h"
#include "kernels/phase1.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The CPU kernels' limit: C * (W + R) below 2^31.
ffi::Error CpuLimits(const char* op, const sdm::Phase1Dims& u) {
  constexpr int64_t kMax32 = std::numeric_limits<int32_t>::max();
  if (u.C > 0 && (u.W + u.R) > (kMax32 - 1) / u.C) {
    return ffi::Error::InvalidArgument(std::string(op) + ": C * (W + R) must be below 2^31, got C=" +
                                       std::to_string(u.C) + ", W=" + std::to_string(u.W) +
                                       ", R=" + std::to_string(u.R));
  }
  return ffi::Error::Success();
}

ffi::Error Phase1Impl(SDM_FFI_PARAMS(SDM_PHASE1_BUFFERS)) {
  constexpr const char* op = "sdm_phase1";
  sdm::Phase1Dims u;
  SDM_RETURN_IF_ERROR(sdm_ffi::CheckPhase1Args(op, CpuLimits, SDM_FFI_NAMES(SDM_PHASE1_BUFFERS), &u));
  return sdm_ffi::RunCatching(
      op, [&] { sdm::phase1_cpu(sdm_ffi::Phase1ArraysOf(SDM_FFI_NAMES(SDM_PHASE1_BUFFERS)), u); });
}

ffi::Error Phase1BwdImpl(SDM_FFI_PARAMS(SDM_PHASE1_BWD_BUFFERS)) {
  constexpr const char* op = "sdm_phase1_bwd";
  sdm::Phase1Dims u;
  SDM_RETURN_IF_ERROR(sdm_ffi::CheckPhase1BwdArgs(op, CpuLimits, SDM_FFI_NAMES(SDM_PHASE1_BWD_BUFFERS), &u));
  return sdm_ffi::RunCatching(
      op, [&] { sdm::phase1_bwd_cpu(sdm_ffi::Phase1GradArraysOf(SDM_FFI_NAMES(SDM_PHASE1_BWD_BUFFERS)), u); });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SdmPhase1Cpu, Phase1Impl, ffi::Ffi::Bind() SDM_FFI_BINDING(SDM_PHASE1_BUFFERS));
XLA_FFI_DEFINE_HANDLER_SYMBOL(SdmPhase1BwdCpu, Phase1BwdImpl,
                              ffi::Ffi::Bind() SDM_FFI_BINDING(SDM_PHASE1_BWD_BUFFERS));
