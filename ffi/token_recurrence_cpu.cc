// XLA FFI handler `sdm_token_recurrence` (platform cpu): check, then run the token recurrence of every stream
// (kernels/token_recurrence_cpu.cc), the CPU's no-grad forward (docs/DESIGN.md "No-grad forward"). The
// final bank is a buffer of its own: each stream's thread copies the stream's rows into it (in parallel, and into
// that thread's cache), cheaper than XLA's one copy of the whole bank for an input it may not overwrite; unless
// the caller aliases it to the input bank, which is then updated in place.
#include <string>

#include "ffi/common.h"
#include "ffi/token_recurrence_common.h"
#include "kernels/bf16.h"
#include "kernels/token_recurrence.h"

namespace ffi = xla::ffi;
using sdm_ffi::CheckShape;
using sdm_ffi::F32;
using sdm_ffi::S32;

namespace {

// The shapes: ffi/token_recurrence_common.h.
ffi::Error TokenRecurrenceCpu(SDM_FFI_PARAMS(SDM_TOKEN_RECURRENCE_BUFFERS)) {
  constexpr const char* op = "sdm_token_recurrence";
  auto kd = k_idx.dimensions();
  auto bd = bank.dimensions();
  if (kd.size() < 4 || bd.size() < 4 || q_idx.dimensions().size() < 1)
    return ffi::Error::InvalidArgument(std::string(op) + ": k_idx must be [..., B, T, H, W], q_idx [..., R] and "
                                       "the bank [..., B, H, K, D]");
  const ffi::DataType type = bank.element_type();
  if (type != ffi::DataType::F32 && type != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument(std::string(op) + ": the bank must be float32 or bfloat16");
  SDM_RETURN_IF_ERROR(sdm_ffi::CheckValueType(op, "k_val", k_val, type));
  SDM_RETURN_IF_ERROR(sdm_ffi::CheckValueType(op, "v", v, type));
  SDM_RETURN_IF_ERROR(sdm_ffi::CheckValueType(op, "q_val", q_val, type));
  SDM_RETURN_IF_ERROR(sdm_ffi::CheckValueType(op, "bank (result)", *bank_out, type));
  SDM_RETURN_IF_ERROR(sdm_ffi::CheckValueType(op, "y (result)", *y, type));
  const size_t r = kd.size();
  const int64_t B = kd[r - 4], T = kd[r - 3], H = kd[r - 2];
  const bool per_write_gates = x.dimensions().size() == r;
  const sdm::TokenRecurrenceDims dm{sdm_ffi::LeadingProduct(kd, 4), B, T, H, bd[bd.size() - 2], bd.back(),
                                    kd[r - 1], q_idx.dimensions().back(), per_write_gates};
  const int64_t V = dm.V;
  SDM_RETURN_IF_ERROR(CheckShape(op, "bank", bank, V, {B, H, dm.K, dm.D}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "k_val", k_val, V, {B, T, H, dm.W}));
  if (per_write_gates) {
    SDM_RETURN_IF_ERROR(CheckShape(op, "x", x, V, {B, T, H, dm.W}));
  } else {
    SDM_RETURN_IF_ERROR(CheckShape(op, "x", x, V, {B, T, H}));
  }
  SDM_RETURN_IF_ERROR(CheckShape(op, "v", v, V, {B, T, H, dm.D}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "beta", beta, V, {B, T, H}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "q_idx", q_idx, V, {B, T, H, dm.R}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "q_val", q_val, V, {B, T, H, dm.R}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "bank (result)", *bank_out, V, {B, H, dm.K, dm.D}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "y (result)", *y, V, {B, T, H, dm.D}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "repeats (result)", *repeats, V, {B, H}));
  auto run = [&](auto zero) {
    using T = decltype(zero);
    const sdm::TokenRecurrenceIO<T> io{k_idx.typed_data(),
                                       static_cast<const T*>(k_val.untyped_data()),
                                       x.typed_data(),
                                       static_cast<const T*>(v.untyped_data()),
                                       beta.typed_data(),
                                       q_idx.typed_data(),
                                       static_cast<const T*>(q_val.untyped_data()),
                                       static_cast<T*>(y->untyped_data()),
                                       repeats->typed_data()};
    sdm::token_recurrence_cpu(dm, io, static_cast<const T*>(bank.untyped_data()),
                              static_cast<T*>(bank_out->untyped_data()));
  };
  return sdm_ffi::RunCatching(op, [&] {
    if (type == ffi::DataType::F32)
      run(0.0f);
    else
      run(sdm::bf16{});
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SdmTokenRecurrenceCpu, TokenRecurrenceCpu,
                              ffi::Ffi::Bind() SDM_FFI_BINDING(SDM_TOKEN_RECURRENCE_BUFFERS));
