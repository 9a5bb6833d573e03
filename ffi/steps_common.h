// Argument checks and kernel-argument assembly shared by the CPU and CUDA chunk-step handlers
// (docs/DESIGN.md "Forward steps", "Backward steps"): a handler binds its buffers, calls one of these, then
// calls its platform's kernel.
#ifndef JAX_SDM_FFI_STEPS_COMMON_H_
#define JAX_SDM_FFI_STEPS_COMMON_H_

#include <cstring>
#include <string>

#include "ffi/common.h"
#include "kernels/steps.h"

namespace sdm_ffi {

using F32 = ffi::Buffer<ffi::F32>;
using S32 = ffi::Buffer<ffi::S32>;

// Sizes from k_idx [V..., NC, P, C, W], q_idx [.., R], bank [V..., P, K, D].
inline ffi::Error StepDimsOf(const char* op, const ffi::AnyBuffer& bank, const S32& k_idx, const S32& q_idx,
                             sdm::StepDims* dm) {
  auto kd = k_idx.dimensions();
  auto bd = bank.dimensions();
  if (kd.size() < 4)
    return ffi::Error::InvalidArgument(std::string(op) + ": k_idx must be [..., NC, P, C, W], got " +
                                       DimsToString(kd));
  if (bd.size() < 3)
    return ffi::Error::InvalidArgument(std::string(op) + ": bank must be [..., P, K, D], got " + DimsToString(bd));
  const size_t r = kd.size();
  *dm = sdm::StepDims{LeadingProduct(kd, 4), kd[r - 4], kd[r - 3], kd[r - 2], kd[r - 1],
                      q_idx.dimensions().size() == 0 ? 0 : q_idx.dimensions().back(), bd[bd.size() - 2], bd.back()};
  const auto type = bank.element_type();
  if (type != ffi::DataType::F32 && type != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument(std::string(op) + ": the bank must be float32 or bfloat16");
  SDM_RETURN_IF_ERROR(CheckShape(op, "bank", bank, dm->V, {dm->P, dm->K, dm->D}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "q_idx", q_idx, dm->V, {dm->NC, dm->P, dm->C, dm->R}));
  return ffi::Error::Success();
}

// The Phase-1 arrays every step reads, checked against the sizes.
inline ffi::Error CheckPhase1(const char* op, const sdm::StepDims& dm, const F32& v, const F32& beta,
                              const F32& k_eff, const F32& w, const F32& cpe, const F32& q_w, const F32& QK,
                              const S32& w_order, const S32& w_group, const F32& minv) {
  const int64_t V = dm.V, NC = dm.NC, P = dm.P, C = dm.C, W = dm.W, R = dm.R;
  SDM_RETURN_IF_ERROR(CheckShape(op, "v", v, V, {NC, P, C, dm.D}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "beta", beta, V, {NC, P, C}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "k_eff", k_eff, V, {NC, P, C, W}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "w", w, V, {NC, P, C, W}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "cpe", cpe, V, {NC, P, C, W}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "q_w", q_w, V, {NC, P, C, R}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "QK", QK, V, {NC, P, C, C}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "w_order", w_order, V, {NC, P, C * W}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "w_group", w_group, V, {NC, P, C * W + 1}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "Minv", minv, V, {NC, P, C, C}));
  return ffi::Error::Success();
}

// Results of the forward: y and (unless all empty, a no-grad call) the residuals.
template <typename SnapshotT>
ffi::Error CheckForwardResults(const char* op, const sdm::StepDims& dm, const ffi::AnyBuffer& bank,
                               const ffi::AnyBuffer& bank_out, const F32& y, const F32& delta, const F32& G,
                               const SnapshotT& snapshot, bool* save) {
  const int64_t V = dm.V, NC = dm.NC, P = dm.P, C = dm.C;
  SDM_RETURN_IF_ERROR(CheckShape(op, "bank (result)", bank_out, dm.V, {dm.P, dm.K, dm.D}));
  if (bank_out.element_type() != bank.element_type())
    return ffi::Error::InvalidArgument(std::string(op) + ": the result bank must have the input bank's dtype");
  SDM_RETURN_IF_ERROR(CheckShape(op, "y (result)", y, V, {NC, P, C, dm.D}));
  *save = delta.element_count() + G.element_count() + snapshot.element_count() > 0;
  if (!*save) return ffi::Error::Success();
  SDM_RETURN_IF_ERROR(CheckShape(op, "delta (result)", delta, V, {NC, P, C, dm.D}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "G (result)", G, V, {NC, P, C, dm.D}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "snapshot (result)", snapshot, V, {NC, P, C * dm.W, dm.D}));
  if (snapshot.element_type() != bank.element_type())
    return ffi::Error::InvalidArgument(std::string(op) + ": the snapshot must have the bank's dtype");
  return ffi::Error::Success();
}

inline sdm::StepPhase1 Phase1View(const S32& k_idx, const S32& q_idx, const F32& k_eff, const F32& w,
                                  const F32& cpe, const F32& q_w, const F32* A, const F32& QK, const S32& w_order,
                                  const S32& w_group, const S32* r_order, const S32* r_group, const F32& minv) {
  return sdm::StepPhase1{k_idx.typed_data(), q_idx.typed_data(), k_eff.typed_data(), w.typed_data(),
                         cpe.typed_data(), q_w.typed_data(), A ? A->typed_data() : nullptr, QK.typed_data(),
                         w_order.typed_data(), w_group.typed_data(), r_order ? r_order->typed_data() : nullptr,
                         r_group ? r_group->typed_data() : nullptr, minv.typed_data()};
}

}  // namespace sdm_ffi

#endif  // JAX_SDM_FFI_STEPS_COMMON_H_
