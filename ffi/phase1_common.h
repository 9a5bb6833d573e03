// Argument checks shared by the CPU and CUDA handlers `sdm_phase1` and `sdm_phase1_bwd` (docs/DESIGN.md
// "Phase 1", "Phase-1 backward"): a handler binds its buffers, calls one of these, then calls its platform's
// kernel. Every buffer may carry any number of leading batch dims in front of the per-unit shape; their product
// is the unit count N (vmap with vmap_method="broadcast_all" adds them).
#ifndef JAX_SDM_FFI_PHASE1_COMMON_H_
#define JAX_SDM_FFI_PHASE1_COMMON_H_

#include <cstdint>
#include <limits>
#include <string>

#include "ffi/common.h"
#include "kernels/phase1.h"

namespace sdm_ffi {

// A platform's limit on the sizes (its kernel's bound on C * (W + R)), checked last by ReadPhase1Dims.
using Phase1Limits = ffi::Error (*)(const char* op, const sdm::Phase1Dims& u);

// Sizes from k_idx [..., C, W], q_idx [..., C, R] and num_slots; the limits of kernels/phase1.h.
inline ffi::Error ReadPhase1Dims(const char* op, const S32& k_idx, const S32& q_idx, int64_t num_slots,
                                 Phase1Limits limits, sdm::Phase1Dims* u) {
  auto kd = k_idx.dimensions();
  auto qd = q_idx.dimensions();
  if (kd.size() < 2) {
    return ffi::Error::InvalidArgument(std::string(op) + ": k_idx must be [..., C, W], got shape " +
                                       DimsToString(kd));
  }
  if (qd.size() < 1) {
    return ffi::Error::InvalidArgument(std::string(op) + ": q_idx must be [..., C, R], got shape " +
                                       DimsToString(qd));
  }
  *u = sdm::Phase1Dims{LeadingProduct(kd, 2), kd[kd.size() - 2], kd.back(), qd.back(), num_slots};
  SDM_RETURN_IF_ERROR(CheckShape(op, "q_idx", q_idx, u->N, {u->C, u->R}));
  constexpr int64_t kMax32 = std::numeric_limits<int32_t>::max();
  if (u->K < 0 || u->K > kMax32) {
    return ffi::Error::InvalidArgument(std::string(op) + ": num_slots must be in [0, 2^31 - 1], got " +
                                       std::to_string(u->K));
  }
  return limits(op, *u);
}

// The buffers and the attribute of the two targets, in order (docs/DESIGN.md "Phase 1", "Phase-1 backward";
// ffi/common.h SDM_FFI_PARAMS), shared by the CPU and CUDA handlers. The last, the optional workspace (any
// remaining results), only the CUDA kernels use (phase1_cuda.cc); the CPU handlers accept it and ignore it.
#define SDM_PHASE1_BUFFERS(X, SEP)                                                                              \
  X(Arg, ::sdm_ffi::S32, k_idx) SEP() X(Arg, ::sdm_ffi::F32, k_val) SEP() X(Arg, ::sdm_ffi::F32, x) SEP()       \
  X(Arg, ::sdm_ffi::S32, q_idx) SEP() X(Arg, ::sdm_ffi::F32, q_val) SEP() X(Attr, int64_t, num_slots) SEP()     \
  X(Ret, ::sdm_ffi::F32, log_k) SEP() X(Ret, ::sdm_ffi::F32, rex) SEP() X(Ret, ::sdm_ffi::F32, cpe) SEP()       \
  X(Ret, ::sdm_ffi::F32, k_eff) SEP() X(Ret, ::sdm_ffi::F32, w) SEP() X(Ret, ::sdm_ffi::F32, log_q) SEP()       \
  X(Ret, ::sdm_ffi::F32, q_w) SEP() X(Ret, ::sdm_ffi::F32, A) SEP() X(Ret, ::sdm_ffi::F32, QK) SEP()            \
  X(Ret, ::sdm_ffi::S32, w_order) SEP() X(Ret, ::sdm_ffi::S32, w_group) SEP() X(Ret, ::sdm_ffi::S32, r_order)   \
  SEP() X(Ret, ::sdm_ffi::S32, r_group) SEP() X(Ret, ::sdm_ffi::S32, repeats) SEP() X(Rest, _, workspace)

#define SDM_PHASE1_BWD_BUFFERS(X, SEP)                                                                          \
  X(Arg, ::sdm_ffi::S32, k_idx) SEP() X(Arg, ::sdm_ffi::F32, k_val) SEP() X(Arg, ::sdm_ffi::F32, x) SEP()       \
  X(Arg, ::sdm_ffi::S32, q_idx) SEP() X(Arg, ::sdm_ffi::F32, q_val) SEP() X(Arg, ::sdm_ffi::F32, log_k) SEP()   \
  X(Arg, ::sdm_ffi::F32, rex) SEP() X(Arg, ::sdm_ffi::F32, cpe) SEP() X(Arg, ::sdm_ffi::F32, log_q) SEP()       \
  X(Arg, ::sdm_ffi::F32, dk_eff) SEP() X(Arg, ::sdm_ffi::F32, dw) SEP() X(Arg, ::sdm_ffi::F32, dcpe) SEP()      \
  X(Arg, ::sdm_ffi::F32, dq_w) SEP() X(Arg, ::sdm_ffi::F32, dA) SEP() X(Arg, ::sdm_ffi::F32, dQK) SEP()         \
  X(Attr, int64_t, num_slots) SEP() X(Ret, ::sdm_ffi::F32, dk_val) SEP() X(Ret, ::sdm_ffi::F32, dx) SEP()       \
  X(Ret, ::sdm_ffi::F32, dq_val) SEP() X(Rest, _, workspace)

// The Phase-1 arguments and results, checked against the sizes (`limits`: the platform's, see ReadPhase1Dims).
inline ffi::Error CheckPhase1Args(const char* op, Phase1Limits limits, SDM_FFI_PARAMS(SDM_PHASE1_BUFFERS),
                                  sdm::Phase1Dims* u) {
  (void)workspace;
  SDM_RETURN_IF_ERROR(ReadPhase1Dims(op, k_idx, q_idx, num_slots, limits, u));
  const int64_t N = u->N, C = u->C, W = u->W, R = u->R, CW = C * W, CR = C * R;
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
  return ffi::Error::Success();
}

// The Phase-1 backward's arguments and results, checked against the sizes.
inline ffi::Error CheckPhase1BwdArgs(const char* op, Phase1Limits limits, SDM_FFI_PARAMS(SDM_PHASE1_BWD_BUFFERS),
                                     sdm::Phase1Dims* u) {
  (void)workspace;
  SDM_RETURN_IF_ERROR(ReadPhase1Dims(op, k_idx, q_idx, num_slots, limits, u));
  const int64_t N = u->N, C = u->C, W = u->W, R = u->R;
  SDM_RETURN_IF_ERROR(CheckShape(op, "k_val", k_val, N, {C, W}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "x", x, N, {C, W}));
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
  return ffi::Error::Success();
}

// The kernels' view of the buffers (kernels/phase1.h), the same for both platforms.
inline sdm::Phase1Arrays Phase1ArraysOf(SDM_FFI_PARAMS(SDM_PHASE1_BUFFERS)) {
  (void)num_slots, (void)workspace;
  return {k_idx.typed_data(),    k_val.typed_data(),    x.typed_data(),        q_idx.typed_data(),
          q_val.typed_data(),    log_k->typed_data(),   rex->typed_data(),     cpe->typed_data(),
          k_eff->typed_data(),   w->typed_data(),       log_q->typed_data(),   q_w->typed_data(),
          A->typed_data(),       QK->typed_data(),      w_order->typed_data(), w_group->typed_data(),
          r_order->typed_data(), r_group->typed_data(), repeats->typed_data()};
}

inline sdm::Phase1GradArrays Phase1GradArraysOf(SDM_FFI_PARAMS(SDM_PHASE1_BWD_BUFFERS)) {
  (void)num_slots, (void)workspace;
  return {k_idx.typed_data(),  k_val.typed_data(), x.typed_data(),     q_idx.typed_data(),  q_val.typed_data(),
          log_k.typed_data(),  rex.typed_data(),   cpe.typed_data(),   log_q.typed_data(),  dk_eff.typed_data(),
          dw.typed_data(),     dcpe.typed_data(),  dq_w.typed_data(),  dA.typed_data(),     dQK.typed_data(),
          dk_val->typed_data(), dx->typed_data(),  dq_val->typed_data()};
}

}  // namespace sdm_ffi

#endif  // JAX_SDM_FFI_PHASE1_COMMON_H_
