// Argument checks and kernel-argument assembly shared by the CPU and CUDA chunk-step handlers
// (docs/DESIGN.md "Forward steps", "Backward steps"): a handler binds its buffers, calls one of these, then
// calls its platform's kernel.
#ifndef JAX_SDM_FFI_CHUNK_STEPS_COMMON_H_
#define JAX_SDM_FFI_CHUNK_STEPS_COMMON_H_

#include <cstdint>
#include <cstring>
#include <string>

#include "ffi/common.h"
#include "kernels/bf16.h"
#include "kernels/chunk_steps.h"

// The buffers of the chunk-step targets, in order (docs/DESIGN.md "Forward steps", "Backward steps", "Packed
// sequences"; ffi/common.h SDM_FFI_PARAMS), shared by the CPU and CUDA handlers. `sdm_forward`: the initial bank,
// the forward's inputs and Phase 1's arrays; the final bank (bank_out, a buffer of its own), y, the residuals
// (empty for a no-grad call: delta, vg, the snapshot, its scales and the links) and the workspace; the attribute
// snapshot_dtype, how the snapshot is stored (kernels/snapshot_codec.h SnapshotDtype; the backward takes the
// forward's). `sdm_backward`: the forward's input bank (read only), dbank (the final bank's cotangent; dbank_out,
// the initial bank's gradient, a buffer of its own or aliased to it), dy, the forward's inputs but v, and its
// residuals with snapshot_dtype; the gradients and the workspace. The packed targets take those buffers, then the
// packed sequences' (kernels/chunk_steps.h StepSegments).
#define SDM_FORWARD_BUFFERS(X, SEP)                                                                             \
  X(Arg, ::sdm_ffi::AnyBuffer, bank) SEP() X(Arg, ::sdm_ffi::S32, k_idx) SEP() X(Arg, ::sdm_ffi::S32, q_idx)    \
  SEP() X(Arg, ::sdm_ffi::AnyBuffer, v) SEP() X(Arg, ::sdm_ffi::F32, beta) SEP() X(Arg, ::sdm_ffi::F32, k_eff)  \
  SEP() X(Arg, ::sdm_ffi::F32, w) SEP() X(Arg, ::sdm_ffi::F32, cpe) SEP() X(Arg, ::sdm_ffi::F32, q_w)           \
  SEP() X(Arg, ::sdm_ffi::F32, QK) SEP() X(Arg, ::sdm_ffi::S32, w_order) SEP() X(Arg, ::sdm_ffi::S32, w_group)  \
  SEP() X(Arg, ::sdm_ffi::F32, minv) SEP() X(Ret, ::sdm_ffi::AnyBuffer, bank_out)                               \
  SEP() X(Ret, ::sdm_ffi::AnyBuffer, y) SEP() X(Ret, ::sdm_ffi::F32, delta) SEP() X(Ret, ::sdm_ffi::F32, vg)    \
  SEP() X(Ret, ::sdm_ffi::AnyBuffer, snapshot) SEP() X(Ret, ::sdm_ffi::F32, snapshot_scale)                     \
  SEP() X(Ret, ::sdm_ffi::S32, link_k) SEP() X(Ret, ::sdm_ffi::S32, link_q)                                     \
  SEP() X(Ret, ::sdm_ffi::F32, workspace) SEP() X(Attr, int64_t, snapshot_dtype)

#define SDM_BACKWARD_BUFFERS(X, SEP)                                                                            \
  X(Arg, ::sdm_ffi::AnyBuffer, bank) SEP() X(Arg, ::sdm_ffi::AnyBuffer, dbank) SEP()                            \
  X(Arg, ::sdm_ffi::AnyBuffer, dy) SEP() X(Arg, ::sdm_ffi::S32, k_idx) SEP() X(Arg, ::sdm_ffi::S32, q_idx)      \
  SEP() X(Arg, ::sdm_ffi::F32, beta) SEP() X(Arg, ::sdm_ffi::F32, k_eff) SEP() X(Arg, ::sdm_ffi::F32, w) SEP()  \
  X(Arg, ::sdm_ffi::F32, cpe) SEP() X(Arg, ::sdm_ffi::F32, q_w) SEP() X(Arg, ::sdm_ffi::F32, A) SEP()           \
  X(Arg, ::sdm_ffi::F32, QK) SEP() X(Arg, ::sdm_ffi::S32, w_order) SEP() X(Arg, ::sdm_ffi::S32, w_group) SEP()  \
  X(Arg, ::sdm_ffi::S32, r_order) SEP() X(Arg, ::sdm_ffi::S32, r_group) SEP() X(Arg, ::sdm_ffi::F32, minv)      \
  SEP() X(Arg, ::sdm_ffi::F32, delta) SEP() X(Arg, ::sdm_ffi::F32, vg) SEP()                                    \
  X(Arg, ::sdm_ffi::AnyBuffer, snapshot) SEP() X(Arg, ::sdm_ffi::F32, snapshot_scale) SEP()                   \
  X(Arg, ::sdm_ffi::S32, link_k) SEP() X(Arg, ::sdm_ffi::S32, link_q) SEP()                                     \
  X(Attr, int64_t, snapshot_dtype) SEP() X(Ret, ::sdm_ffi::AnyBuffer, dbank_out) SEP()                          \
  X(Ret, ::sdm_ffi::F32, dk_eff) SEP() X(Ret, ::sdm_ffi::F32, dw) SEP() X(Ret, ::sdm_ffi::F32, dcpe) SEP()       \
  X(Ret, ::sdm_ffi::F32, dq_w) SEP() X(Ret, ::sdm_ffi::F32, dA) SEP()                                             \
  X(Ret, ::sdm_ffi::F32, dQK) SEP() X(Ret, ::sdm_ffi::F32, dbeta) SEP() X(Ret, ::sdm_ffi::AnyBuffer, dv) SEP()  \
  X(Ret, ::sdm_ffi::F32, workspace)

// Packed sequences: the initial bank, each token's segment within its chunk (local) and each chunk's first segment
// (seg0); the forward's results the stamps and (with residuals) their snapshot, the backward's the stamps restored
// (aliased to stamp) and the initial bank's gradient (aliased to dinitial).
#define SDM_FORWARD_SEGMENT_BUFFERS(X, SEP)                                                                     \
  X(Arg, ::sdm_ffi::AnyBuffer, initial) SEP() X(Arg, ::sdm_ffi::S32, local) SEP() X(Arg, ::sdm_ffi::S32, seg0)  \
  SEP() X(Ret, ::sdm_ffi::S32, stamp) SEP() X(Ret, ::sdm_ffi::S32, stamp_snapshot)
#define SDM_BACKWARD_SEGMENT_BUFFERS(X, SEP)                                                                    \
  X(Arg, ::sdm_ffi::AnyBuffer, initial) SEP() X(Arg, ::sdm_ffi::S32, local) SEP() X(Arg, ::sdm_ffi::S32, seg0)  \
  SEP() X(Arg, ::sdm_ffi::S32, stamp) SEP() X(Arg, ::sdm_ffi::S32, stamp_snapshot) SEP()                        \
  X(Arg, ::sdm_ffi::AnyBuffer, dinitial) SEP() X(Ret, ::sdm_ffi::S32, stamp_out) SEP()                          \
  X(Ret, ::sdm_ffi::AnyBuffer, dinitial_out)
// A slab of a no-grad forward in slabs (kernels/chunk_steps.h SlabCarry; `sdm_forward_slab`): `bank` is the
// sequence's input bank; carry the bank the earlier slabs left (aliased to bank_out) and first their first writing
// steps (int32 [..., P, K], aliased to first_out), both empty for the first slab; last_slab (0 or 1): this slab
// copies the rows no slab writes.
#define SDM_FORWARD_SLAB_EXTRA_BUFFERS(X, SEP)                                                                  \
  X(Arg, ::sdm_ffi::AnyBuffer, carry) SEP() X(Arg, ::sdm_ffi::S32, first) SEP()                                 \
  X(Ret, ::sdm_ffi::S32, first_out) SEP() X(Attr, int64_t, last_slab)
#define SDM_FORWARD_PACKED_BUFFERS(X, SEP) SDM_FORWARD_BUFFERS(X, SEP) SEP() SDM_FORWARD_SEGMENT_BUFFERS(X, SEP)
#define SDM_FORWARD_SLAB_BUFFERS(X, SEP) SDM_FORWARD_BUFFERS(X, SEP) SEP() SDM_FORWARD_SLAB_EXTRA_BUFFERS(X, SEP)
#define SDM_BACKWARD_PACKED_BUFFERS(X, SEP) SDM_BACKWARD_BUFFERS(X, SEP) SEP() SDM_BACKWARD_SEGMENT_BUFFERS(X, SEP)

namespace sdm_ffi {

// Sizes from k_idx [V..., NC, P, C, W], q_idx [.., R], bank [V..., P, K, D]; with `shared_bank` (an input bank:
// the forward's, the backward's) the bank may also be one [P_in, K, D] that the streams share (P_in dividing P;
// kernels/chunk_steps.h StepDims::input_streams).
inline ffi::Error StepDimsOf(const char* op, const ffi::AnyBuffer& bank, const S32& k_idx, const S32& q_idx,
                             sdm::StepDims* dm, bool shared_bank = false) {
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
  // A [P, K, D] bank of V = 1 is the per-stream one (the kernel layout's), not a shared bank of P blocks.
  const int64_t shared = bd.size() == 3 ? bd[0] : 0;
  if (shared_bank && shared > 0 && dm->P % shared == 0 && (shared != dm->P || dm->V != 1)) {
    dm->input_streams = shared;
  } else if (CheckShape(op, "bank", bank, dm->V, {dm->P, dm->K, dm->D}).failure()) {
    return ffi::Error::InvalidArgument(
        std::string(op) + ": bank must be [..., P, K, D] with the leading dims of k_idx (" + DimsToString(kd) + ")" +
        (shared_bank ? ", or [P_in, K, D] shared by the streams with P_in dividing P" : "") + ", got " +
        DimsToString(bd));
  }
  SDM_RETURN_IF_ERROR(CheckShape(op, "q_idx", q_idx, dm->V, {dm->NC, dm->P, dm->C, dm->R}));
  return ffi::Error::Success();
}

// The workspace holds `floats` floats (kernels/chunk_steps.h forward_workspace_floats / backward_workspace_floats; any
// shape: vmap adds a leading dim).
inline ffi::Error CheckWorkspace(const char* op, const ffi::Buffer<ffi::F32>& ws, int64_t floats) {
  if (static_cast<int64_t>(ws.element_count()) == floats) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string(op) + ": the workspace has " + std::to_string(ws.element_count()) +
                                     " floats, expected " + std::to_string(floats));
}

// The Phase-1 arrays every step reads, checked against the sizes (`v`, or the backward's dy of its shape).
template <typename VT>
ffi::Error CheckPhase1(const char* op, const sdm::StepDims& dm, const VT& v, const F32& beta,
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

// The attribute snapshot_dtype as the kernels' code.
inline ffi::Error SnapshotDtypeOf(const char* op, int64_t code, sdm::SnapshotDtype* type) {
  if (code < 0 || code > static_cast<int64_t>(sdm::SnapshotDtype::kInt4))
    return ffi::Error::InvalidArgument(std::string(op) + ": snapshot_dtype must be 0 (the bank's dtype), 1 (bfloat16), "
                                       "2 (float8_e4m3fn) or 3 (int4), got " + std::to_string(code));
  *type = static_cast<sdm::SnapshotDtype>(code);
  return ffi::Error::Success();
}

// The snapshot as `type` stores it (kernels/snapshot_codec.h), for every chunk but the last
// (StepDims::snapshot_chunks): [V, NC - 1, P, C*W, D] of the bank's dtype or bfloat16, or [V, NC - 1, P, C*W, row
// bytes] uint8; with a scale per row [V, NC - 1, P, C*W] float32 for the scaled codes, else an empty scale.
template <typename ScaleT>
ffi::Error CheckSnapshot(const char* op, const sdm::StepDims& dm, const ffi::AnyBuffer& bank, sdm::SnapshotDtype type,
                         const ffi::AnyBuffer& snapshot, const ScaleT& scale) {
  const int64_t rows = dm.C * dm.W, chunks = dm.snapshot_chunks();
  const bool coded = type == sdm::SnapshotDtype::kFloat8 || type == sdm::SnapshotDtype::kInt4;
  const int64_t cols = coded ? sdm::snapshot_row_bytes(type, dm.D, 1) : dm.D;
  SDM_RETURN_IF_ERROR(CheckShape(op, "snapshot", snapshot, dm.V, {chunks, dm.P, rows, cols}));
  const ffi::DataType want = type == sdm::SnapshotDtype::kBank ? bank.element_type()
                             : type == sdm::SnapshotDtype::kBf16 ? ffi::DataType::BF16
                                                                 : ffi::DataType::U8;
  if (snapshot.element_type() != want)
    return ffi::Error::InvalidArgument(std::string(op) + ": the snapshot's dtype does not match snapshot_dtype " +
                                       std::to_string(static_cast<int>(type)));
  if (sdm::snapshot_scaled(type)) return CheckShape(op, "snapshot_scale", scale, dm.V, {chunks, dm.P, rows});
  if (scale.element_count() != 0)
    return ffi::Error::InvalidArgument(std::string(op) + ": snapshot_scale must be empty for snapshot_dtype " +
                                       std::to_string(static_cast<int>(type)));
  return ffi::Error::Success();
}

// The forward's residuals: delta, vg, the snapshot and the links, all empty for a no-grad call (*save false).
template <typename ScaleT, typename LinkT>
ffi::Error CheckResiduals(const char* op, const sdm::StepDims& dm, const ffi::AnyBuffer& bank, const F32& delta,
                          const F32& vg, const ffi::AnyBuffer& snapshot, const ScaleT& scale, const LinkT& link_k,
                          const LinkT& link_q, sdm::SnapshotDtype type, bool* save) {
  const int64_t V = dm.V, NC = dm.NC, P = dm.P, C = dm.C;
  *save = delta.element_count() + vg.element_count() + snapshot.element_count() + scale.element_count() +
              link_k.element_count() + link_q.element_count() > 0;
  if (!*save) return ffi::Error::Success();
  SDM_RETURN_IF_ERROR(CheckShape(op, "delta", delta, V, {NC, P, C, dm.D}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "vg", vg, V, {NC, P, C, dm.D}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "link_k", link_k, V, {NC, P, C, dm.W}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "link_q", link_q, V, {NC, P, C, dm.R}));
  // A link is a snapshot entry, an int32.
  if (V * NC * P * C * dm.W > INT32_MAX)
    return ffi::Error::InvalidArgument(std::string(op) + ": more than 2^31 - 1 write entries (V * T * P * W) in one "
                                       "call: split the streams or the sequence");
  return CheckSnapshot(op, dm, bank, type, snapshot, scale);
}

inline sdm::StepPhase1 Phase1View(const S32& k_idx, const S32& q_idx, const F32& k_eff, const F32& w,
                                  const F32& cpe, const F32& q_w, const F32* A, const F32& QK, const S32& w_order,
                                  const S32& w_group, const S32* r_order, const S32* r_group, const F32& minv) {
  return sdm::StepPhase1{k_idx.typed_data(), q_idx.typed_data(), k_eff.typed_data(), w.typed_data(),
                         cpe.typed_data(), q_w.typed_data(), A ? A->typed_data() : nullptr, QK.typed_data(),
                         w_order.typed_data(), w_group.typed_data(), r_order ? r_order->typed_data() : nullptr,
                         r_group ? r_group->typed_data() : nullptr, minv.typed_data()};
}

// A checked forward call, ready for a platform's kernel.
struct ForwardCall {
  sdm::StepDims dm;
  sdm::StepPhase1 p1;
  sdm::ForwardIO io;
  ffi::DataType type;
  const void* bank_in;
  size_t bank_in_bytes;  // bank_bytes, or a divisor of it for a bank the streams share (StepDims::input_streams)
  void* bank;
  size_t bank_bytes;
  float* workspace;
};

inline ffi::Error PrepareForward(SDM_FFI_PARAMS(SDM_FORWARD_BUFFERS), ForwardCall* call) {
  const char* op = "sdm_forward";
  sdm::StepDims& dm = call->dm;
  bool save = false;
  sdm::SnapshotDtype type;
  SDM_RETURN_IF_ERROR(StepDimsOf(op, bank, k_idx, q_idx, &dm, /*shared_bank=*/true));
  SDM_RETURN_IF_ERROR(SnapshotDtypeOf(op, snapshot_dtype, &type));
  SDM_RETURN_IF_ERROR(CheckPhase1(op, dm, v, beta, k_eff, w, cpe, q_w, QK, w_order, w_group, minv));
  SDM_RETURN_IF_ERROR(CheckShape(op, "bank (result)", *bank_out, dm.V, {dm.P, dm.K, dm.D}));
  if (bank_out->element_type() != bank.element_type())
    return ffi::Error::InvalidArgument(std::string(op) + ": the result bank must have the input bank's dtype");
  SDM_RETURN_IF_ERROR(CheckShape(op, "y (result)", *y, dm.V, {dm.NC, dm.P, dm.C, dm.D}));
  SDM_RETURN_IF_ERROR(CheckValueType(op, "v", v, bank.element_type()));
  SDM_RETURN_IF_ERROR(CheckValueType(op, "y (result)", *y, bank.element_type()));
  SDM_RETURN_IF_ERROR(CheckResiduals(op, dm, bank, *delta, *vg, *snapshot, *snapshot_scale, *link_k, *link_q, type,
                                     &save));
  SDM_RETURN_IF_ERROR(CheckWorkspace(op, *workspace, sdm::forward_workspace_floats(dm)));
  call->p1 = Phase1View(k_idx, q_idx, k_eff, w, cpe, q_w, nullptr, QK, w_order, w_group, nullptr, nullptr, minv);
  call->io = sdm::ForwardIO{v.untyped_data(), beta.typed_data(), y->untyped_data(),
                            save ? delta->typed_data() : nullptr, save ? vg->typed_data() : nullptr,
                            save ? snapshot->untyped_data() : nullptr, type,
                            save && sdm::snapshot_scaled(type) ? snapshot_scale->typed_data() : nullptr,
                            save ? link_k->typed_data() : nullptr, save ? link_q->typed_data() : nullptr};
  call->type = bank.element_type();
  call->bank_in = bank.untyped_data();
  call->bank_in_bytes = bank.size_bytes();
  call->bank = bank_out->untyped_data();
  call->bank_bytes = bank_out->size_bytes();
  call->workspace = workspace->typed_data();
  return ffi::Error::Success();
}

// A checked backward call, ready for a platform's kernel.
struct BackwardCall {
  sdm::StepDims dm;
  sdm::StepPhase1 p1;
  sdm::BackwardIO io;
  ffi::DataType type;
  const void* bank_in;      // the forward's input bank
  ffi::DataType grad_type;  // the working gradient bank: float32, or the bank's bfloat16
  const void* dbank_in;
  void* dbank;
  size_t dbank_bytes;
  float* workspace;
};

// run(bank_in, dbank) with the buffers typed: (float, float), (bf16, float) or (bf16, bf16).
template <typename Run>
auto WithBankTypes(const BackwardCall& call, Run run) {
  if (call.type == ffi::DataType::F32)
    return run(static_cast<const float*>(call.bank_in), static_cast<float*>(call.dbank));
  if (call.grad_type == ffi::DataType::F32)
    return run(static_cast<const sdm::bf16*>(call.bank_in), static_cast<float*>(call.dbank));
  return run(static_cast<const sdm::bf16*>(call.bank_in), static_cast<sdm::bf16*>(call.dbank));
}

inline ffi::Error PrepareBackward(SDM_FFI_PARAMS(SDM_BACKWARD_BUFFERS), BackwardCall* call) {
  const char* op = "sdm_backward";
  sdm::StepDims& dm = call->dm;
  bool save = false;
  sdm::SnapshotDtype type;
  SDM_RETURN_IF_ERROR(StepDimsOf(op, bank, k_idx, q_idx, &dm, /*shared_bank=*/true));
  SDM_RETURN_IF_ERROR(SnapshotDtypeOf(op, snapshot_dtype, &type));
  // dy has v's shape: the backward needs no v (the forward's residual vg is v - G).
  SDM_RETURN_IF_ERROR(CheckPhase1(op, dm, dy, beta, k_eff, w, cpe, q_w, QK, w_order, w_group, minv));
  SDM_RETURN_IF_ERROR(
      CheckResiduals(op, dm, bank, delta, vg, snapshot, snapshot_scale, link_k, link_q, type, &save));
  if (!save) return ffi::Error::InvalidArgument(std::string(op) + ": the forward residuals are empty");
  SDM_RETURN_IF_ERROR(CheckValueType(op, "dy", dy, bank.element_type()));
  const int64_t V = dm.V, NC = dm.NC, P = dm.P, C = dm.C, W = dm.W, R = dm.R;
  // A zero cotangent comes as [..., P, 0, D]: no buffer, its rows read as zeros.
  const auto dbank_dims = dbank.dimensions();
  const bool zero_cotangent = dbank_dims.size() >= 2 && dbank_dims[dbank_dims.size() - 2] == 0 && dm.K > 0;
  SDM_RETURN_IF_ERROR(CheckShape(op, "dbank", dbank, V, {P, zero_cotangent ? 0 : dm.K, dm.D}));
  if (dbank.element_type() != ffi::DataType::F32 && dbank.element_type() != bank.element_type())
    return ffi::Error::InvalidArgument(std::string(op) + ": dbank must be float32 or have the bank's dtype");
  if (dbank_out->element_type() != dbank.element_type())
    return ffi::Error::InvalidArgument(std::string(op) + ": the result dbank must have dbank's dtype");
  SDM_RETURN_IF_ERROR(CheckShape(op, "A", A, V, {NC, P, C, C}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "r_order", r_order, V, {NC, P, C * R}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "r_group", r_group, V, {NC, P, C * R + 1}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "dbank (result)", *dbank_out, V, {P, dm.K, dm.D}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "dk_eff", *dk_eff, V, {NC, P, C, W}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "dw", *dw, V, {NC, P, C, W}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "dcpe", *dcpe, V, {NC, P, C, W}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "dq_w", *dq_w, V, {NC, P, C, R}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "dA", *dA, V, {NC, P, C, C}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "dQK", *dQK, V, {NC, P, C, C}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "dbeta", *dbeta, V, {NC, P, C}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "dv", *dv, V, {NC, P, C, dm.D}));
  SDM_RETURN_IF_ERROR(CheckValueType(op, "dv (result)", *dv, bank.element_type()));
  SDM_RETURN_IF_ERROR(CheckWorkspace(op, *workspace, sdm::backward_workspace_floats(dm)));
  call->p1 = Phase1View(k_idx, q_idx, k_eff, w, cpe, q_w, &A, QK, w_order, w_group, &r_order, &r_group, minv);
  call->io = sdm::BackwardIO{beta.typed_data(),    dy.untyped_data(),
                             delta.typed_data(),   vg.typed_data(),     snapshot.untyped_data(),
                             dk_eff->typed_data(), dw->typed_data(),
                             dcpe->typed_data(),   dq_w->typed_data(),  dA->typed_data(),
                             dQK->typed_data(),    dbeta->typed_data(), dv->untyped_data(),
                             type,                 sdm::snapshot_scaled(type) ? snapshot_scale.typed_data() : nullptr,
                             link_k.typed_data(),  link_q.typed_data()};
  call->type = bank.element_type();
  call->bank_in = bank.untyped_data();
  call->grad_type = dbank.element_type();
  call->dbank_in = zero_cotangent ? nullptr : dbank.untyped_data();
  call->dbank = dbank_out->untyped_data();
  call->dbank_bytes = dbank_out->size_bytes();
  call->workspace = workspace->typed_data();
  return ffi::Error::Success();
}

// The segment buffers both directions share, checked (the bank per stream, not shared): the initial bank (like the
// bank), each token's segment within its chunk and each chunk's first segment.
inline ffi::Error CheckSegmentInputs(const char* op, const sdm::StepDims& dm, const ffi::AnyBuffer& bank,
                                     const ffi::AnyBuffer& initial, const S32& local, const S32& seg0) {
  if (dm.input_streams)
    return ffi::Error::InvalidArgument(std::string(op) + ": packed sequences need the bank per stream, [..., P, K, D]");
  SDM_RETURN_IF_ERROR(CheckShape(op, "initial", initial, dm.V, {dm.P, dm.K, dm.D}));
  if (initial.element_type() != bank.element_type())
    return ffi::Error::InvalidArgument(std::string(op) + ": the initial bank must have the bank's dtype");
  SDM_RETURN_IF_ERROR(CheckShape(op, "local", local, dm.V, {dm.NC, dm.P, dm.C}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "seg0", seg0, dm.V, {dm.NC, dm.P}));
  return ffi::Error::Success();
}

// The forward's segment buffers, checked (call: PrepareForward's); the stamp snapshot is empty for a no-grad call.
inline ffi::Error PrepareForwardSegments(const ForwardCall& call, const ffi::AnyBuffer& bank,
                                         SDM_FFI_PARAMS(SDM_FORWARD_SEGMENT_BUFFERS), sdm::StepSegments* segments) {
  const char* op = "sdm_forward_packed";
  const sdm::StepDims& dm = call.dm;
  SDM_RETURN_IF_ERROR(CheckSegmentInputs(op, dm, bank, initial, local, seg0));
  SDM_RETURN_IF_ERROR(CheckShape(op, "stamp (result)", *stamp, dm.V, {dm.P, dm.K}));
  // With residuals delta is never empty (the snapshot is, for one chunk: its data may then be null).
  const bool save = call.io.delta != nullptr;
  if (save) {
    SDM_RETURN_IF_ERROR(
        CheckShape(op, "stamp_snapshot (result)", *stamp_snapshot, dm.V, {dm.NC, dm.P, dm.C * dm.W}));
  } else if (stamp_snapshot->element_count() != 0) {
    return ffi::Error::InvalidArgument(std::string(op) +
                                       ": stamp_snapshot must be empty for a call without residuals");
  }
  *segments = sdm::StepSegments{local.typed_data(), seg0.typed_data(), initial.untyped_data(), stamp->typed_data(),
                                save ? stamp_snapshot->typed_data() : nullptr, nullptr};
  return ffi::Error::Success();
}

// The backward's segment buffers, checked (call: PrepareBackward's). The stamps and the gradient of the initial
// bank arrive aliased to their results; *copies lists the (input, result, bytes) to copy if XLA handed two buffers.
struct SegmentCopies {
  const void* in[2];
  void* out[2];
  size_t bytes[2];
};

inline ffi::Error PrepareBackwardSegments(const BackwardCall& call, const ffi::AnyBuffer& bank,
                                          SDM_FFI_PARAMS(SDM_BACKWARD_SEGMENT_BUFFERS), sdm::StepSegments* segments,
                                          SegmentCopies* copies) {
  const char* op = "sdm_backward_packed";
  const sdm::StepDims& dm = call.dm;
  SDM_RETURN_IF_ERROR(CheckSegmentInputs(op, dm, bank, initial, local, seg0));
  SDM_RETURN_IF_ERROR(CheckShape(op, "stamp", stamp, dm.V, {dm.P, dm.K}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "stamp_snapshot", stamp_snapshot, dm.V, {dm.NC, dm.P, dm.C * dm.W}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "dinitial", dinitial, dm.V, {dm.P, dm.K, dm.D}));
  if (dinitial.element_type() != call.grad_type || dinitial_out->element_type() != call.grad_type)
    return ffi::Error::InvalidArgument(std::string(op) + ": dinitial and its result must have dbank's dtype");
  SDM_RETURN_IF_ERROR(CheckShape(op, "stamp (result)", *stamp_out, dm.V, {dm.P, dm.K}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "dinitial (result)", *dinitial_out, dm.V, {dm.P, dm.K, dm.D}));
  // The stamp snapshot is only read: the kernels' struct serves both directions.
  *segments = sdm::StepSegments{local.typed_data(), seg0.typed_data(), initial.untyped_data(), stamp_out->typed_data(),
                                const_cast<int32_t*>(stamp_snapshot.typed_data()), dinitial_out->untyped_data()};
  *copies = SegmentCopies{{stamp.untyped_data(), dinitial.untyped_data()},
                          {stamp_out->untyped_data(), dinitial_out->untyped_data()},
                          {stamp.size_bytes(), dinitial.size_bytes()}};
  return ffi::Error::Success();
}

// The packed-sequence handlers' checks: the plain call's, then the segment buffers'.
inline ffi::Error PrepareForwardPacked(SDM_FFI_PARAMS(SDM_FORWARD_PACKED_BUFFERS), ForwardCall* call,
                                       sdm::StepSegments* segments) {
  SDM_RETURN_IF_ERROR(PrepareForward(SDM_FFI_NAMES(SDM_FORWARD_BUFFERS), call));
  return PrepareForwardSegments(*call, bank, SDM_FFI_NAMES(SDM_FORWARD_SEGMENT_BUFFERS), segments);
}

// A forward slab's buffers, checked (call: PrepareForward's, whose bank_in stays the sequence's input bank), and
// its SlabCarry: the first steps in first_out; a later slab (carry and first given) finds the earlier slabs' rows
// in the result bank.
inline ffi::Error PrepareForwardSlab(SDM_FFI_PARAMS(SDM_FORWARD_SLAB_BUFFERS), ForwardCall* call,
                                     sdm::SlabCarry* slab) {
  const char* op = "sdm_forward_slab";
  SDM_RETURN_IF_ERROR(PrepareForward(SDM_FFI_NAMES(SDM_FORWARD_BUFFERS), call));
  const sdm::StepDims& dm = call->dm;
  if (call->io.delta != nullptr)
    return ffi::Error::InvalidArgument(std::string(op) + ": a slab keeps no residuals (a no-grad forward)");
  if (dm.NC < 1 || dm.C < 1)
    return ffi::Error::InvalidArgument(std::string(op) + ": a slab has at least one chunk of at least one token");
  if (last_slab != 0 && last_slab != 1)
    return ffi::Error::InvalidArgument(std::string(op) + ": last_slab must be 0 or 1");
  SDM_RETURN_IF_ERROR(CheckShape(op, "first (result)", *first_out, dm.V, {dm.P, dm.K}));
  const bool carried = carry.element_count() != 0;
  if (carried) {
    SDM_RETURN_IF_ERROR(CheckShape(op, "carry", carry, dm.V, {dm.P, dm.K, dm.D}));
    SDM_RETURN_IF_ERROR(CheckValueType(op, "carry", carry, call->type));
    SDM_RETURN_IF_ERROR(CheckShape(op, "first", first, dm.V, {dm.P, dm.K}));
  } else if (first.element_count() != 0) {
    return ffi::Error::InvalidArgument(std::string(op) + ": first must be empty when carry is (the first slab)");
  }
  if (carried && (carry.untyped_data() != call->bank || first.untyped_data() != first_out->untyped_data()))
    return ffi::Error::InvalidArgument(std::string(op) + ": carry and first must alias bank_out and first_out");
  if (call->bank_in == call->bank)
    return ffi::Error::InvalidArgument(std::string(op) + ": the input bank must not alias the result");
  *slab = sdm::SlabCarry{reinterpret_cast<uint32_t*>(first_out->typed_data()), !carried, last_slab == 1};
  return ffi::Error::Success();
}

inline ffi::Error PrepareBackwardPacked(SDM_FFI_PARAMS(SDM_BACKWARD_PACKED_BUFFERS), BackwardCall* call,
                                        sdm::StepSegments* segments, SegmentCopies* copies) {
  SDM_RETURN_IF_ERROR(PrepareBackward(SDM_FFI_NAMES(SDM_BACKWARD_BUFFERS), call));
  return PrepareBackwardSegments(*call, bank, SDM_FFI_NAMES(SDM_BACKWARD_SEGMENT_BUFFERS), segments, copies);
}

}  // namespace sdm_ffi

#endif  // JAX_SDM_FFI_CHUNK_STEPS_COMMON_H_
