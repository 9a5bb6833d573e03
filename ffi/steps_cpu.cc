// XLA FFI handlers `sdm_forward` and `sdm_backward` (platform cpu): check, then run the chunk loops of
// kernels/steps_cpu.cc (docs/DESIGN.md "Forward steps", "Backward steps"). The bank is updated in place: it
// arrives aliased to the first result (input_output_aliases).
#include <cstring>
#include <exception>
#include <string>

#include "ffi/steps_common.h"
#include "kernels/bf16.h"

namespace ffi = xla::ffi;
using sdm_ffi::F32;
using sdm_ffi::S32;

namespace {

// The result aliases the input; copy only if XLA handed two buffers.
void AliasCopy(const void* in, void* out, size_t bytes) {
  if (in != out) std::memcpy(out, in, bytes);
}

ffi::Error ForwardCpu(ffi::AnyBuffer bank, S32 k_idx, S32 q_idx, F32 v, F32 beta, F32 k_eff, F32 w, F32 cpe, F32 q_w,
                      F32 QK, S32 w_order, S32 w_group, F32 minv, ffi::Result<ffi::AnyBuffer> bank_out,
                      ffi::ResultBuffer<ffi::F32> y, ffi::ResultBuffer<ffi::F32> delta,
                      ffi::ResultBuffer<ffi::F32> G, ffi::Result<ffi::AnyBuffer> snapshot) {
  const char* op = "sdm_forward";
  sdm::StepDims dm;
  bool save = false;
  SDM_RETURN_IF_ERROR(sdm_ffi::StepDimsOf(op, bank, k_idx, q_idx, &dm));
  SDM_RETURN_IF_ERROR(sdm_ffi::CheckPhase1(op, dm, v, beta, k_eff, w, cpe, q_w, QK, w_order, w_group, minv));
  SDM_RETURN_IF_ERROR(
      sdm_ffi::CheckForwardResults(op, dm, bank, *bank_out, *y, *delta, *G, *snapshot, &save));
  const sdm::StepPhase1 p1 =
      sdm_ffi::Phase1View(k_idx, q_idx, k_eff, w, cpe, q_w, nullptr, QK, w_order, w_group, nullptr, nullptr, minv);
  const sdm::ForwardIO io{v.typed_data(), beta.typed_data(), y->typed_data(),
                          save ? delta->typed_data() : nullptr, save ? G->typed_data() : nullptr,
                          save ? snapshot->untyped_data() : nullptr};
  AliasCopy(bank.untyped_data(), bank_out->untyped_data(), bank.size_bytes());
  try {
    if (bank.element_type() == ffi::DataType::F32)
      sdm::forward_cpu(dm, p1, io, static_cast<float*>(bank_out->untyped_data()));
    else
      sdm::forward_cpu(dm, p1, io, static_cast<sdm::bf16*>(bank_out->untyped_data()));
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string(op) + ": " + e.what());
  }
  return ffi::Error::Success();
}

ffi::Error BackwardCpu(ffi::AnyBuffer bank, F32 dbank, F32 dy, S32 k_idx, S32 q_idx, F32 v, F32 beta, F32 k_eff,
                       F32 w, F32 cpe, F32 q_w, F32 A, F32 QK, S32 w_order, S32 w_group, S32 r_order, S32 r_group,
                       F32 minv, F32 delta, F32 G, ffi::AnyBuffer snapshot, ffi::Result<ffi::AnyBuffer> bank_out,
                       ffi::ResultBuffer<ffi::F32> dbank_out, ffi::ResultBuffer<ffi::F32> dk_eff,
                       ffi::ResultBuffer<ffi::F32> dw, ffi::ResultBuffer<ffi::F32> dcpe,
                       ffi::ResultBuffer<ffi::F32> dq_w, ffi::ResultBuffer<ffi::F32> dA,
                       ffi::ResultBuffer<ffi::F32> dQK, ffi::ResultBuffer<ffi::F32> dbeta,
                       ffi::ResultBuffer<ffi::F32> dv) {
  const char* op = "sdm_backward";
  sdm::StepDims dm;
  bool save = false;
  SDM_RETURN_IF_ERROR(sdm_ffi::StepDimsOf(op, bank, k_idx, q_idx, &dm));
  SDM_RETURN_IF_ERROR(sdm_ffi::CheckPhase1(op, dm, v, beta, k_eff, w, cpe, q_w, QK, w_order, w_group, minv));
  SDM_RETURN_IF_ERROR(sdm_ffi::CheckForwardResults(op, dm, bank, bank, dy, delta, G, snapshot, &save));
  if (!save) return ffi::Error::InvalidArgument(std::string(op) + ": the forward residuals are empty");
  const int64_t V = dm.V, NC = dm.NC, P = dm.P, C = dm.C, W = dm.W, R = dm.R;
  SDM_RETURN_IF_ERROR(sdm_ffi::CheckShape(op, "dbank", dbank, V, {P, dm.K, dm.D}));
  SDM_RETURN_IF_ERROR(sdm_ffi::CheckShape(op, "A", A, V, {NC, P, C, C}));
  SDM_RETURN_IF_ERROR(sdm_ffi::CheckShape(op, "r_order", r_order, V, {NC, P, C * R}));
  SDM_RETURN_IF_ERROR(sdm_ffi::CheckShape(op, "r_group", r_group, V, {NC, P, C * R + 1}));
  SDM_RETURN_IF_ERROR(sdm_ffi::CheckShape(op, "bank (result)", *bank_out, V, {P, dm.K, dm.D}));
  SDM_RETURN_IF_ERROR(sdm_ffi::CheckShape(op, "dbank (result)", *dbank_out, V, {P, dm.K, dm.D}));
  for (auto [name, buf] : {std::pair{"dk_eff", &dk_eff}, std::pair{"dw", &dw}, std::pair{"dcpe", &dcpe}})
    SDM_RETURN_IF_ERROR(sdm_ffi::CheckShape(op, name, **buf, V, {NC, P, C, W}));
  SDM_RETURN_IF_ERROR(sdm_ffi::CheckShape(op, "dq_w", *dq_w, V, {NC, P, C, R}));
  SDM_RETURN_IF_ERROR(sdm_ffi::CheckShape(op, "dA", *dA, V, {NC, P, C, C}));
  SDM_RETURN_IF_ERROR(sdm_ffi::CheckShape(op, "dQK", *dQK, V, {NC, P, C, C}));
  SDM_RETURN_IF_ERROR(sdm_ffi::CheckShape(op, "dbeta", *dbeta, V, {NC, P, C}));
  SDM_RETURN_IF_ERROR(sdm_ffi::CheckShape(op, "dv", *dv, V, {NC, P, C, dm.D}));

  const sdm::StepPhase1 p1 =
      sdm_ffi::Phase1View(k_idx, q_idx, k_eff, w, cpe, q_w, &A, QK, w_order, w_group, &r_order, &r_group, minv);
  AliasCopy(bank.untyped_data(), bank_out->untyped_data(), bank.size_bytes());
  AliasCopy(dbank.typed_data(), dbank_out->typed_data(), dbank.size_bytes());
  const sdm::BackwardIO io{v.typed_data(),       beta.typed_data(),   dy.typed_data(),     delta.typed_data(),
                           G.typed_data(),       snapshot.untyped_data(), dbank_out->typed_data(),
                           dk_eff->typed_data(), dw->typed_data(),    dcpe->typed_data(),  dq_w->typed_data(),
                           dA->typed_data(),     dQK->typed_data(),   dbeta->typed_data(), dv->typed_data()};
  try {
    if (bank.element_type() == ffi::DataType::F32)
      sdm::backward_cpu(dm, p1, io, static_cast<float*>(bank_out->untyped_data()));
    else
      sdm::backward_cpu(dm, p1, io, static_cast<sdm::bf16*>(bank_out->untyped_data()));
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string(op) + ": " + e.what());
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SdmForwardCpu, ForwardCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // bank
                                  .Arg<S32>()             // k_idx
                                  .Arg<S32>()             // q_idx
                                  .Arg<F32>()             // v
                                  .Arg<F32>()             // beta
                                  .Arg<F32>()             // k_eff
                                  .Arg<F32>()             // w
                                  .Arg<F32>()             // cpe
                                  .Arg<F32>()             // q_w
                                  .Arg<F32>()             // QK
                                  .Arg<S32>()             // w_order
                                  .Arg<S32>()             // w_group
                                  .Arg<F32>()             // Minv
                                  .Ret<ffi::AnyBuffer>()  // bank (aliased)
                                  .Ret<F32>()             // y
                                  .Ret<F32>()             // delta
                                  .Ret<F32>()             // G
                                  .Ret<ffi::AnyBuffer>()  // snapshot
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(SdmBackwardCpu, BackwardCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // bank (final; aliased)
                                  .Arg<F32>()             // dbank (aliased)
                                  .Arg<F32>()             // dy
                                  .Arg<S32>()             // k_idx
                                  .Arg<S32>()             // q_idx
                                  .Arg<F32>()             // v
                                  .Arg<F32>()             // beta
                                  .Arg<F32>()             // k_eff
                                  .Arg<F32>()             // w
                                  .Arg<F32>()             // cpe
                                  .Arg<F32>()             // q_w
                                  .Arg<F32>()             // A
                                  .Arg<F32>()             // QK
                                  .Arg<S32>()             // w_order
                                  .Arg<S32>()             // w_group
                                  .Arg<S32>()             // r_order
                                  .Arg<S32>()             // r_group
                                  .Arg<F32>()             // Minv
                                  .Arg<F32>()             // delta
                                  .Arg<F32>()             // G
                                  .Arg<ffi::AnyBuffer>()  // snapshot
                                  .Ret<ffi::AnyBuffer>()  // bank (initial, aliased)
                                  .Ret<F32>()             // dbank (initial, aliased)
                                  .Ret<F32>()             // dk_eff
                                  .Ret<F32>()             // dw
                                  .Ret<F32>()             // dcpe
                                  .Ret<F32>()             // dq_w
                                  .Ret<F32>()             // dA
                                  .Ret<F32>()             // dQK
                                  .Ret<F32>()             // dbeta
                                  .Ret<F32>()             // dv
);
