// XLA FFI handler `sdm_phase1` (platform cpu): checks the buffers and the
// attribute, then runs kernels/phase1 (docs/DESIGN.md "Phase 1").
#include <cstdint>
#include <exception>
#include <limits>
#include <string>

#include "kernels/phase1.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

std::string DimsToString(ffi::AnyBuffer::Dimensions dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(dims[i]);
  }
  return s + "]";
}

template <typename B>
bool HasDims(const B& buf, std::initializer_list<int64_t> want) {
  auto dims = buf.dimensions();
  if (dims.size() != want.size()) return false;
  size_t i = 0;
  for (int64_t d : want) {
    if (dims[i++] != d) return false;
  }
  return true;
}

template <typename B>
ffi::Error CheckDims(const char* name, const B& buf,
                     std::initializer_list<int64_t> want) {
  if (HasDims(buf, want)) return ffi::Error::Success();
  std::string expected = "[";
  size_t i = 0;
  for (int64_t d : want) {
    if (i++) expected += ", ";
    expected += std::to_string(d);
  }
  expected += "]";
  return ffi::Error::InvalidArgument(
      std::string("sdm_phase1: ") + name + " has shape " +
      DimsToString(buf.dimensions()) + ", expected " + expected);
}

ffi::Error Phase1Impl(ffi::Buffer<ffi::S32> k_idx, ffi::Buffer<ffi::F32> k_val,
                      ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> q_idx,
                      ffi::Buffer<ffi::F32> q_val, int64_t num_slots,
                      ffi::ResultBuffer<ffi::F32> log_k,
                      ffi::ResultBuffer<ffi::F32> rex,
                      ffi::ResultBuffer<ffi::F32> cpe,
                      ffi::ResultBuffer<ffi::F32> k_eff,
                      ffi::ResultBuffer<ffi::F32> w,
                      ffi::ResultBuffer<ffi::F32> log_q,
                      ffi::ResultBuffer<ffi::F32> q_w,
                      ffi::ResultBuffer<ffi::F32> A,
                      ffi::ResultBuffer<ffi::F32> QK,
                      ffi::ResultBuffer<ffi::S32> w_order,
                      ffi::ResultBuffer<ffi::S32> w_group,
                      ffi::ResultBuffer<ffi::S32> r_order,
                      ffi::ResultBuffer<ffi::S32> r_group,
                      ffi::ResultBuffer<ffi::S32> repeats) {
  auto kd = k_idx.dimensions();
  auto qd = q_idx.dimensions();
  if (kd.size() != 3) {
    return ffi::Error::InvalidArgument(
        "sdm_phase1: k_idx must have rank 3 [N, C, W], got shape " +
        DimsToString(kd));
  }
  if (qd.size() != 3) {
    return ffi::Error::InvalidArgument(
        "sdm_phase1: q_idx must have rank 3 [N, C, R], got shape " +
        DimsToString(qd));
  }
  const int64_t N = kd[0], C = kd[1], W = kd[2], R = qd[2];
  const int64_t K = num_slots;
  if (qd[0] != N || qd[1] != C) {
    return ffi::Error::InvalidArgument(
        "sdm_phase1: q_idx shape " + DimsToString(qd) +
        " does not match k_idx shape " + DimsToString(kd) +
        " in the leading dims [N, C]");
  }
  if (K < 0 || K > std::numeric_limits<int32_t>::max()) {
    return ffi::Error::InvalidArgument(
        "sdm_phase1: num_slots must be in [0, 2^31 - 1], got " +
        std::to_string(K));
  }
  constexpr int64_t kMax32 = std::numeric_limits<int32_t>::max();
  if (C > 0 && (W + R) > (kMax32 - 1) / C) {
    return ffi::Error::InvalidArgument(
        "sdm_phase1: C * (W + R) must be below 2^31, got C=" +
        std::to_string(C) + ", W=" + std::to_string(W) +
        ", R=" + std::to_string(R));
  }

  const int64_t CW = C * W, CR = C * R;
  ffi::Error err;
#define SDM_CHECK(name, buf, ...)                        \
  if ((err = CheckDims(name, buf, __VA_ARGS__)).failure()) \
    return err;
  SDM_CHECK("k_val", k_val, {N, C, W});
  SDM_CHECK("x", x, {N, C, W});
  SDM_CHECK("q_val", q_val, {N, C, R});
  SDM_CHECK("log_k (result)", *log_k, {N, C, W});
  SDM_CHECK("rex (result)", *rex, {N, C, W});
  SDM_CHECK("cpe (result)", *cpe, {N, C, W});
  SDM_CHECK("k_eff (result)", *k_eff, {N, C, W});
  SDM_CHECK("w (result)", *w, {N, C, W});
  SDM_CHECK("log_q (result)", *log_q, {N, C, R});
  SDM_CHECK("q_w (result)", *q_w, {N, C, R});
  SDM_CHECK("A (result)", *A, {N, C, C});
  SDM_CHECK("QK (result)", *QK, {N, C, C});
  SDM_CHECK("w_order (result)", *w_order, {N, CW});
  SDM_CHECK("w_group (result)", *w_group, {N, CW + 1});
  SDM_CHECK("r_order (result)", *r_order, {N, CR});
  SDM_CHECK("r_group (result)", *r_group, {N, CR + 1});
  SDM_CHECK("repeats (result)", *repeats, {N});
#undef SDM_CHECK

  try {
    sdm::phase1_cpu(k_idx.typed_data(), k_val.typed_data(), x.typed_data(),
                    q_idx.typed_data(), q_val.typed_data(), N, C, W, R, K,
                    log_k->typed_data(), rex->typed_data(), cpe->typed_data(),
                    k_eff->typed_data(), w->typed_data(), log_q->typed_data(),
                    q_w->typed_data(), A->typed_data(), QK->typed_data(),
                    w_order->typed_data(), w_group->typed_data(),
                    r_order->typed_data(), r_group->typed_data(),
                    repeats->typed_data());
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string("sdm_phase1: ") + e.what());
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SdmPhase1Cpu, Phase1Impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // k_idx
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_val
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q_idx
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q_val
                                  .Attr<int64_t>("num_slots")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // log_k
                                  .Ret<ffi::Buffer<ffi::F32>>()  // rex
                                  .Ret<ffi::Buffer<ffi::F32>>()  // cpe
                                  .Ret<ffi::Buffer<ffi::F32>>()  // k_eff
                                  .Ret<ffi::Buffer<ffi::F32>>()  // w
                                  .Ret<ffi::Buffer<ffi::F32>>()  // log_q
                                  .Ret<ffi::Buffer<ffi::F32>>()  // q_w
                                  .Ret<ffi::Buffer<ffi::F32>>()  // A
                                  .Ret<ffi::Buffer<ffi::F32>>()  // QK
                                  .Ret<ffi::Buffer<ffi::S32>>()  // w_order
                                  .Ret<ffi::Buffer<ffi::S32>>()  // w_group
                                  .Ret<ffi::Buffer<ffi::S32>>()  // r_order
                                  .Ret<ffi::Buffer<ffi::S32>>()  // r_group
                                  .Ret<ffi::Buffer<ffi::S32>>()  // repeats
);
