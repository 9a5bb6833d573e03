// XLA FFI handler `sdm_token_recurrence` (platform cpu): check, then run the token recurrence of every stream
// (kernels/token_recurrence_cpu.cc), the CPU's no-grad forward (docs/DESIGN.md "No-grad forward on the CPU"). The
// final bank is a buffer of its own: each stream's thread copies the stream's rows into it (in parallel, and into
// that thread's cache), cheaper than XLA's one copy of the whole bank for an input it may not overwrite.
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
  if (kd.size() < 4 || bd.size() < 3 || q_idx.dimensions().size() < 1)
    return ffi::Error::InvalidArgument(std::string(op) + ": k_idx must be [..., NC, P, C, W], q_idx [..., R] and "
                                       "the bank [..., P, K, D]");
  const ffi::DataType type = bank.element_type();
  if (type != ffi::DataType::F32 && type != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument(std::string(op) + ": the bank must be float32 or bfloat16");
  if (bank_out->element_type() != type)
    return ffi::Error::InvalidArgument(std::string(op) + ": the result bank must have the input bank's dtype");
  const size_t r = kd.size();
  const sdm::TokenRecurrenceDims dm{sdm_ffi::LeadingProduct(kd, 4), kd[r - 4], kd[r - 3], kd[r - 2],
                                    bd[bd.size() - 2], bd.back(), kd[r - 1], q_idx.dimensions().back()};
  const int64_t V = dm.V, NC = dm.NC, P = dm.P, C = dm.C;
  SDM_RETURN_IF_ERROR(CheckShape(op, "bank", bank, V, {P, dm.K, dm.D}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "k_val", k_val, V, {NC, P, C, dm.W}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "x", x, V, {NC, P, C, dm.W}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "v", v, V, {NC, P, C, dm.D}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "beta", beta, V, {NC, P, C}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "q_idx", q_idx, V, {NC, P, C, dm.R}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "q_val", q_val, V, {NC, P, C, dm.R}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "bank (result)", *bank_out, V, {P, dm.K, dm.D}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "y (result)", *y, V, {NC, P, C, dm.D}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "repeats (result)", *repeats, V, {NC, P}));
  const sdm::TokenRecurrenceIO io{k_idx.typed_data(), k_val.typed_data(), x.typed_data(),  v.typed_data(),
                                  beta.typed_data(),  q_idx.typed_data(), q_val.typed_data(), y->typed_data(),
                                  repeats->typed_data()};
  return sdm_ffi::RunCatching(op, [&] {
    if (type == ffi::DataType::F32)
      sdm::token_recurrence_cpu(dm, io, static_cast<const float*>(bank.untyped_data()),
                                static_cast<float*>(bank_out->untyped_data()));
    else
      sdm::token_recurrence_cpu(dm, io, static_cast<const sdm::bf16*>(bank.untyped_data()),
                                static_cast<sdm::bf16*>(bank_out->untyped_data()));
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SdmTokenRecurrenceCpu, TokenRecurrenceCpu,
                              ffi::Ffi::Bind() SDM_FFI_BINDING(SDM_TOKEN_RECURRENCE_BUFFERS));
