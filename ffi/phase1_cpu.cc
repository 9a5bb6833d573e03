// XLA FFI handlers `sdm_phase1` and `sdm_phase1_bwd` (platform cpu): check the
// buffers and the attribute, then run kernels/phase1 (docs/DESIGN.md "Phase 1",
// "Phase-1 backward"). Every buffer may carry any number of leading batch dims in
// front of the per-unit shape; their product is the unit count N (vmap with
// vmap_method="broadcast_all" adds them).
#include <cstdint>
#include <exception>
#include <limits>
#include <string>

#include "ffi/common.h"
#include "kernels/phase1.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using sdm_ffi::CheckShape;
using sdm_ffi::DimsToString;
using sdm_ffi::LeadingProduct;

using F32 = ffi::Buffer<ffi::F32>;
using S32 = ffi::Buffer<ffi::S32>;
using RetF32 = ffi::ResultBuffer<ffi::F32>;
using RetS32 = ffi::ResultBuffer<ffi::S32>;

struct UnitDims {
  int64_t N, C, W, R, K;
};

// Sizes from k_idx [..., C, W], q_idx [..., C, R] and num_slots, and the limits of
// kernels/phase1.h.
ffi::Error Phase1Dims(const char* op, const S32& k_idx, const S32& q_idx,
                      int64_t num_slots, UnitDims* u) {
  auto kd = k_idx.dimensions();
  auto qd = q_idx.dimensions();
  if (kd.size() < 2) {
    return ffi::Error::InvalidArgument(std::string(op) +
                                       ": k_idx must be [..., C, W], got shape " +
                                       DimsToString(kd));
  }
  if (qd.size() < 1) {
    return ffi::Error::InvalidArgument(std::string(op) +
                                       ": q_idx must be [..., C, R], got shape " +
                                       DimsToString(qd));
  }
  *u = UnitDims{LeadingProduct(kd, 2), kd[kd.size() - 2], kd.back(), qd.back(), num_slots};
  SDM_RETURN_IF_ERROR(CheckShape(op, "q_idx", q_idx, u->N, {u->C, u->R}));
  constexpr int64_t kMax32 = std::numeric_limits<int32_t>::max();
  if (u->K < 0 || u->K > kMax32) {
    return ffi::Error::InvalidArgument(std::string(op) +
                                       ": num_slots must be in [0, 2^31 - 1], got " +
                                       std::to_string(u->K));
  }
  if (u->C > 0 && (u->W + u->R) > (kMax32 - 1) / u->C) {
    return ffi::Error::InvalidArgument(
        std::string(op) + ": C * (W + R) must be below 2^31, got C=" +
        std::to_string(u->C) + ", W=" + std::to_string(u->W) +
        ", R=" + std::to_string(u->R));
  }
  return ffi::Error::Success();
}

ffi::Error Phase1Impl(S32 k_idx, F32 k_val, F32 x, S32 q_idx, F32 q_val,
                      int64_t num_slots, RetF32 log_k, RetF32 rex, RetF32 cpe,
                      RetF32 k_eff, RetF32 w, RetF32 log_q, RetF32 q_w, RetF32 A,
                      RetF32 QK, RetS32 w_order, RetS32 w_group, RetS32 r_order,
                      RetS32 r_group, RetS32 repeats,
                      ffi::RemainingRets /*workspace of the CUDA handler, if passed: ignored*/) {
  constexpr const char* op = "sdm_phase1";
  UnitDims u;
  SDM_RETURN_IF_ERROR(Phase1Dims(op, k_idx, q_idx, num_slots, &u));
  const int64_t N = u.N, C = u.C, W = u.W, R = u.R, CW = C * W, CR = C * R;
  SDM_RETURN_IF_ERROR(CheckShape(op, "k_val", k_val, N, {C, W}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "x", x, N, {C, W}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "q_val", q_val, N, {C, R}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "log_k (result)", *log_k, N, {C, W}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "rex (result)", *rex, N, {C, W}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "cpe (result)", *cpe, N, {C, W}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "k_eff (result)", *k_eff, N, {C, W}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "w (result)", *w, N, {C, W}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "log_q (result)", *log_q, N, {C, R}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "q_w (result)", *q_w, N, {C, R}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "A (result)", *A, N, {C, C}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "QK (result)", *QK, N, {C, C}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "w_order (result)", *w_order, N, {CW}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "w_group (result)", *w_group, N, {CW + 1}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "r_order (result)", *r_order, N, {CR}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "r_group (result)", *r_group, N, {CR + 1}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "repeats (result)", *repeats, N, {}));

  try {
    sdm::phase1_cpu(k_idx.typed_data(), k_val.typed_data(), x.typed_data(),
                    q_idx.typed_data(), q_val.typed_data(), N, C, W, R, u.K,
                    log_k->typed_data(), rex->typed_data(), cpe->typed_data(),
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

ffi::Error Phase1BwdImpl(S32 k_idx, F32 k_val, S32 q_idx, F32 q_val, F32 log_k,
                         F32 rex, F32 cpe, F32 log_q, F32 dk_eff, F32 dw, F32 dcpe,
                         F32 dq_w, F32 dA, F32 dQK, int64_t num_slots,
                         RetF32 dk_val, RetF32 dx, RetF32 dq_val,
                         ffi::RemainingRets /*workspace of the CUDA handler, if passed: ignored*/) {
  constexpr const char* op = "sdm_phase1_bwd";
  UnitDims u;
  SDM_RETURN_IF_ERROR(Phase1Dims(op, k_idx, q_idx, num_slots, &u));
  const int64_t N = u.N, C = u.C, W = u.W, R = u.R;
  SDM_RETURN_IF_ERROR(CheckShape(op, "k_val", k_val, N, {C, W}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "q_val", q_val, N, {C, R}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "log_k", log_k, N, {C, W}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "rex", rex, N, {C, W}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "cpe", cpe, N, {C, W}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "log_q", log_q, N, {C, R}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "dk_eff", dk_eff, N, {C, W}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "dw", dw, N, {C, W}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "dcpe", dcpe, N, {C, W}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "dq_w", dq_w, N, {C, R}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "dA", dA, N, {C, C}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "dQK", dQK, N, {C, C}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "dk_val (result)", *dk_val, N, {C, W}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "dx (result)", *dx, N, {C, W}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "dq_val (result)", *dq_val, N, {C, R}));

  try {
    sdm::phase1_bwd_cpu(k_idx.typed_data(), k_val.typed_data(), q_idx.typed_data(),
                        q_val.typed_data(), N, C, W, R, u.K, log_k.typed_data(),
                        rex.typed_data(), cpe.typed_data(), log_q.typed_data(),
                        dk_eff.typed_data(), dw.typed_data(), dcpe.typed_data(),
                        dq_w.typed_data(), dA.typed_data(), dQK.typed_data(),
                        dk_val->typed_data(), dx->typed_data(), dq_val->typed_data());
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string(op) + ": " + e.what());
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SdmPhase1Cpu, Phase1Impl,
                              ffi::Ffi::Bind()
                                  .Arg<S32>()  // k_idx
                                  .Arg<F32>()  // k_val
                                  .Arg<F32>()  // x
                                  .Arg<S32>()  // q_idx
                                  .Arg<F32>()  // q_val
                                  .Attr<int64_t>("num_slots")
                                  .Ret<F32>()  // log_k
                                  .Ret<F32>()  // rex
                                  .Ret<F32>()  // cpe
                                  .Ret<F32>()  // k_eff
                                  .Ret<F32>()  // w
                                  .Ret<F32>()  // log_q
                                  .Ret<F32>()  // q_w
                                  .Ret<F32>()  // A
                                  .Ret<F32>()  // QK
                                  .Ret<S32>()  // w_order
                                  .Ret<S32>()  // w_group
                                  .Ret<S32>()  // r_order
                                  .Ret<S32>()  // r_group
                                  .Ret<S32>()  // repeats
                                  .RemainingRets()  // the CUDA handler's trailing workspace (optional here, ignored)
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(SdmPhase1BwdCpu, Phase1BwdImpl,
                              ffi::Ffi::Bind()
                                  .Arg<S32>()  // k_idx
                                  .Arg<F32>()  // k_val
                                  .Arg<S32>()  // q_idx
                                  .Arg<F32>()  // q_val
                                  .Arg<F32>()  // log_k
                                  .Arg<F32>()  // rex
                                  .Arg<F32>()  // cpe
                                  .Arg<F32>()  // log_q
                                  .Arg<F32>()  // dk_eff
                                  .Arg<F32>()  // dw
                                  .Arg<F32>()  // dcpe
                                  .Arg<F32>()  // dq_w
                                  .Arg<F32>()  // dA
                                  .Arg<F32>()  // dQK
                                  .Attr<int64_t>("num_slots")
                                  .Ret<F32>()  // dk_val
                                  .Ret<F32>()  // dx
                                  .Ret<F32>()  // dq_val
                                  .RemainingRets()  // the CUDA handler's trailing workspace (optional here, ignored)
);
