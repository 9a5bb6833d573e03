// XLA FFI handlers `sdm_phase1` and `sdm_phase1_bwd` (platform cpu): check the
// buffers and the attribute (ffi/phase1_common.h), then run kernels/phase1
// (docs/DESIGN.md "Phase 1", "Phase-1 backward"). Every buffer may carry any
// number of leading batch dims in front of the per-unit shape; their product is
// the unit count N (vmap with vmap_method="broadcast_all" adds them).
#include <cstdint>
#include <exception>
#include <limits>
#include <string>

#include "ffi/phase1_common.h"
#include "kernels/phase1.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The CPU kernels' limit: C * (W + R) below 2^31.
ffi::Error CpuLimits(const char* op, const sdm_ffi::UnitDims& u) {
  constexpr int64_t kMax32 = std::numeric_limits<int32_t>::max();
  if (u.C > 0 && (u.W + u.R) > (kMax32 - 1) / u.C) {
    return ffi::Error::InvalidArgument(
        std::string(op) + ": C * (W + R) must be below 2^31, got C=" +
        std::to_string(u.C) + ", W=" + std::to_string(u.W) +
        ", R=" + std::to_string(u.R));
  }
  return ffi::Error::Success();
}

ffi::Error Phase1Impl(SDM_PHASE1_PARAMS,
                      ffi::RemainingRets /*workspace of the CUDA handler, if passed: ignored*/) {
  constexpr const char* op = "sdm_phase1";
  sdm_ffi::UnitDims u;
  SDM_RETURN_IF_ERROR(
      sdm_ffi::CheckPhase1Args(op, CpuLimits, SDM_PHASE1_NAMES, &u));

  try {
    sdm::phase1_cpu(k_idx.typed_data(), k_val.typed_data(), x.typed_data(),
                    q_idx.typed_data(), q_val.typed_data(), u.N, u.C, u.W, u.R,
                    u.K, log_k->typed_data(), rex->typed_data(), cpe->typed_data(),
                    k_eff->typed_data(), w->typed_data(), log_q->typed_data(),
                    q_w->typed_data(), A->typed_data(), QK->typed_data(),
                    w_order->typed_data(), w_group->typed_data(),
                    r_order->typed_data(), r_group->typed_data(),
                    repeats->typed_data());
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string(op) + ": " + e.what());
  }
  return ffi::Error::Success();
}

ffi::Error Phase1BwdImpl(SDM_PHASE1_BWD_PARAMS,
                         ffi::RemainingRets /*workspace of the CUDA handler, if passed: ignored*/) {
  constexpr const char* op = "sdm_phase1_bwd";
  sdm_ffi::UnitDims u;
  SDM_RETURN_IF_ERROR(
      sdm_ffi::CheckPhase1BwdArgs(op, CpuLimits, SDM_PHASE1_BWD_NAMES, &u));

  try {
    sdm::phase1_bwd_cpu(k_idx.typed_data(), k_val.typed_data(), q_idx.typed_data(),
                        q_val.typed_data(), u.N, u.C, u.W, u.R, u.K,
                        log_k.typed_data(), rex.typed_data(), cpe.typed_data(),
                        log_q.typed_data(), dk_eff.typed_data(), dw.typed_data(),
                        dcpe.typed_data(), dq_w.typed_data(), dA.typed_data(),
                        dQK.typed_data(), dk_val->typed_data(), dx->typed_data(),
                        dq_val->typed_data());
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string(op) + ": " + e.what());
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SdmPhase1Cpu, Phase1Impl,
                              ffi::Ffi::Bind()
                                  .SDM_PHASE1_BUFFERS
                                  .RemainingRets()  // the CUDA handler's trailing workspace (optional here, ignored)
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(SdmPhase1BwdCpu, Phase1BwdImpl,
                              ffi::Ffi::Bind()
                                  .SDM_PHASE1_BWD_BUFFERS
                                  .RemainingRets()  // the CUDA handler's trailing workspace (optional here, ignored)
);
