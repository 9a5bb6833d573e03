// XLA FFI handlers `sdm_phase1` and `sdm_phase1_bwd` (platform CUDA): the buffers and attribute of the CPU
// handlers (ffi/phase1_cpu.cc, same order and shapes, any leading batch dims whose product is N), then
// kernels/phase1_cuda.cu on XLA's stream. An optional trailing result is a workspace (any dtype and shape,
// counted in bytes) of at least sdm::phase1_cuda_workspace_bytes(N, C, W, R, backward) bytes: the kernels'
// scratch when it does not fit in shared memory; it may be left out when that is 0 (the CPU handlers accept it
// too and ignore it; jax_sdm/ffi_ops.py always passes it). No allocation, no host synchronisation, launch
// configuration from the shapes only: safe to capture in a CUDA graph (kCmdBufferCompatible).
#include <cuda_runtime_api.h>

#include <cstdint>
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

// Sizes from k_idx [..., C, W], q_idx [..., C, R] and num_slots; the limits of kernels/phase1.h.
ffi::Error Phase1Dims(const char* op, const S32& k_idx, const S32& q_idx, int64_t num_slots, UnitDims* u) {
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
  *u = UnitDims{LeadingProduct(kd, 2), kd[kd.size() - 2], kd.back(), qd.back(), num_slots};
  SDM_RETURN_IF_ERROR(CheckShape(op, "q_idx", q_idx, u->N, {u->C, u->R}));
  constexpr int64_t kMax32 = std::numeric_limits<int32_t>::max();
  if (u->K < 0 || u->K > kMax32) {
    return ffi::Error::InvalidArgument(std::string(op) + ": num_slots must be in [0, 2^31 - 1], got " +
                                       std::to_string(u->K));
  }
  if (u->C * (u->W + u->R) > sdm::kPhase1CudaMaxEntries) {
    return ffi::Error::InvalidArgument(
        std::string(op) + ": C * (W + R) = " + std::to_string(u->C * (u->W + u->R)) +
        " exceeds the CUDA kernel's limit of " + std::to_string(sdm::kPhase1CudaMaxEntries) + " (C=" +
        std::to_string(u->C) + ", W=" + std::to_string(u->W) + ", R=" + std::to_string(u->R) + ")");
  }
  return ffi::Error::Success();
}

// The optional trailing result: the workspace (any type and shape, counted in bytes). It must hold
// phase1_cuda_workspace_bytes(...) bytes; it may be left out when that is 0.
ffi::Error GetWorkspace(const char* op, const ffi::RemainingRets& rest, const UnitDims& u, bool backward,
                        void** data, int64_t* bytes) {
  *data = nullptr;
  *bytes = 0;
  if (rest.size() > 1) {
    return ffi::Error::InvalidArgument(std::string(op) + ": expected at most one result after the outputs " +
                                       "(the workspace), got " + std::to_string(rest.size()));
  }
  if (rest.size() == 1) {
    auto ws = rest.get<ffi::AnyBuffer>(0);
    if (ws.has_error()) return ws.error();
    *data = (*ws)->untyped_data();
    *bytes = static_cast<int64_t>((*ws)->size_bytes());
  }
  const int64_t need = sdm::phase1_cuda_workspace_bytes(u.N, u.C, u.W, u.R, backward);
  if (*bytes < need) {
    return ffi::Error::InvalidArgument(std::string(op) + ": the workspace has " + std::to_string(*bytes) +
                                       " bytes, expected at least " + std::to_string(need) +
                                       " (kernels/phase1.h phase1_cuda_workspace_bytes)");
  }
  if (need > 0 && reinterpret_cast<uintptr_t>(*data) % 16 != 0) {
    return ffi::Error::InvalidArgument(std::string(op) + ": the workspace is not 16-byte aligned");
  }
  return ffi::Error::Success();
}

ffi::Error Status(const char* op, int rc) {
  if (rc == 0) return ffi::Error::Success();
  const cudaError_t e = static_cast<cudaError_t>(rc);
  return ffi::Error::Internal(std::string(op) + ": launch failed: " + cudaGetErrorName(e) + ": " +
                              cudaGetErrorString(e));
}

ffi::Error Phase1CudaImpl(cudaStream_t stream, S32 k_idx, F32 k_val, F32 x, S32 q_idx, F32 q_val,
                          int64_t num_slots, RetF32 log_k, RetF32 rex, RetF32 cpe, RetF32 k_eff, RetF32 w,
                          RetF32 log_q, RetF32 q_w, RetF32 A, RetF32 QK, RetS32 w_order, RetS32 w_group,
                          RetS32 r_order, RetS32 r_group, RetS32 repeats, ffi::RemainingRets rest) {
  constexpr const char* op = "sdm_phase1 (CUDA)";
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
  void* ws;
  int64_t ws_bytes;
  SDM_RETURN_IF_ERROR(GetWorkspace(op, rest, u, /*backward=*/false, &ws, &ws_bytes));

  const int rc = sdm::phase1_cuda(
      k_idx.typed_data(), k_val.typed_data(), x.typed_data(), q_idx.typed_data(), q_val.typed_data(), N, C, W,
      R, u.K, log_k->typed_data(), rex->typed_data(), cpe->typed_data(), k_eff->typed_data(), w->typed_data(),
      log_q->typed_data(), q_w->typed_data(), A->typed_data(), QK->typed_data(), w_order->typed_data(),
      w_group->typed_data(), r_order->typed_data(), r_group->typed_data(), repeats->typed_data(),
      ws, ws_bytes, stream);
  return Status(op, rc);
}

ffi::Error Phase1BwdCudaImpl(cudaStream_t stream, S32 k_idx, F32 k_val, S32 q_idx, F32 q_val, F32 log_k,
                             F32 rex, F32 cpe, F32 log_q, F32 dk_eff, F32 dw, F32 dcpe, F32 dq_w, F32 dA,
                             F32 dQK, int64_t num_slots, RetF32 dk_val, RetF32 dx, RetF32 dq_val,
                             ffi::RemainingRets rest) {
  constexpr const char* op = "sdm_phase1_bwd (CUDA)";
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
  void* ws;
  int64_t ws_bytes;
  SDM_RETURN_IF_ERROR(GetWorkspace(op, rest, u, /*backward=*/true, &ws, &ws_bytes));

  const int rc = sdm::phase1_bwd_cuda(
      k_idx.typed_data(), k_val.typed_data(), q_idx.typed_data(), q_val.typed_data(), N, C, W, R, u.K,
      log_k.typed_data(), rex.typed_data(), cpe.typed_data(), log_q.typed_data(), dk_eff.typed_data(),
      dw.typed_data(), dcpe.typed_data(), dq_w.typed_data(), dA.typed_data(), dQK.typed_data(),
      dk_val->typed_data(), dx->typed_data(), dq_val->typed_data(), ws, ws_bytes, stream);
  return Status(op, rc);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SdmPhase1Cuda, Phase1CudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<S32>()  // k_idx
                                  .Arg<F32>()  // k_val
                                  .Arg<F32>()  // x
                                  .Arg<S32>()  // q_idx
                                  .Arg<F32>()  // q_val
                                  .Attr<int64_t>("num_slots")
                                  .Ret<F32>()              // log_k
                                  .Ret<F32>()              // rex
                                  .Ret<F32>()              // cpe
                                  .Ret<F32>()              // k_eff
                                  .Ret<F32>()              // w
                                  .Ret<F32>()              // log_q
                                  .Ret<F32>()              // q_w
                                  .Ret<F32>()              // A
                                  .Ret<F32>()              // QK
                                  .Ret<S32>()              // w_order
                                  .Ret<S32>()              // w_group
                                  .Ret<S32>()              // r_order
                                  .Ret<S32>()              // r_group
                                  .Ret<S32>()              // repeats
                                  .RemainingRets(),  // workspace (optional when not needed)
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(SdmPhase1BwdCuda, Phase1BwdCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
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
                                  .Ret<F32>()              // dk_val
                                  .Ret<F32>()              // dx
                                  .Ret<F32>()              // dq_val
                                  .RemainingRets(),  // workspace (optional when not needed)
                              {xla::ffi::Traits::kCmdBufferCompatible});
