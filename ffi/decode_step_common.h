// Argument checks shared by the CPU and CUDA handlers `sdm_decode_step` (docs/DESIGN.md "Decode step"): a handler
// binds its buffers, calls PrepareDecodeStep, then calls its platform's kernel.
#ifndef JAX_SDM_FFI_DECODE_STEP_COMMON_H_
#define JAX_SDM_FFI_DECODE_STEP_COMMON_H_

#include <cstdint>
#include <string>

#include "ffi/common.h"
#include "kernels/decode_step.h"

// The buffers of `sdm_decode_step`, in order (docs/DESIGN.md "Decode step"; ffi/common.h SDM_FFI_PARAMS), shared
// by the CPU and CUDA handlers; the bank arrives aliased to its result.
#define SDM_DECODE_BUFFERS(X, SEP)                                                                              \
  X(Arg, ::sdm_ffi::AnyBuffer, bank) SEP() X(Arg, ::sdm_ffi::S32, k_idx) SEP()                                  \
  X(Arg, ::sdm_ffi::AnyBuffer, k_val) SEP() X(Arg, ::sdm_ffi::F32, x) SEP() X(Arg, ::sdm_ffi::AnyBuffer, v)     \
  SEP() X(Arg, ::sdm_ffi::F32, beta) SEP() X(Arg, ::sdm_ffi::S32, q_idx) SEP()                                  \
  X(Arg, ::sdm_ffi::AnyBuffer, q_val) SEP() X(Ret, ::sdm_ffi::AnyBuffer, bank_out) SEP()                        \
  X(Ret, ::sdm_ffi::AnyBuffer, y)

namespace sdm_ffi {

// A checked call, ready for a platform's kernel.
struct DecodeCall {
  sdm::DecodeDims dm;
  ffi::DataType type;  // the bank's (and the values') dtype
  const int32_t* k_idx;
  const void* k_val;
  const float* x;
  const void* v;
  const float* beta;
  const int32_t* q_idx;
  const void* q_val;
  void* y;
  const void* bank_in;
  void* bank;  // the result, aliased to bank_in unless XLA handed two buffers
  size_t bank_bytes;

  template <typename T>
  sdm::DecodeToken<T> token() const {
    return sdm::DecodeToken<T>{k_idx, static_cast<const T*>(k_val), x, static_cast<const T*>(v), beta, q_idx,
                               static_cast<const T*>(q_val), static_cast<T*>(y)};
  }
};

// Shapes: bank [S..., K, D], k_idx / k_val [S..., W], x [S...] or [S..., W], v [S..., D], beta [S...],
// q_idx / q_val [S..., R]; results bank [S..., K, D] and y [S..., D] in the bank's dtype. S... is any batch shape
// (the streams, and a leading axis per vmap).
inline ffi::Error PrepareDecodeStep(const char* op, SDM_FFI_PARAMS(SDM_DECODE_BUFFERS), DecodeCall* call) {
  auto bd = bank.dimensions();
  if (bd.size() < 2 || k_idx.dimensions().size() < 1 || q_idx.dimensions().size() < 1)
    return ffi::Error::InvalidArgument(std::string(op) + ": bank must be [..., K, D] and k_idx, q_idx [..., W|R]");
  const ffi::DataType type = bank.element_type();
  if (type != ffi::DataType::F32 && type != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument(std::string(op) + ": the bank must be float32 or bfloat16");
  sdm::DecodeDims& dm = call->dm;
  dm.S = LeadingProduct(bd, 2);
  dm.K = bd[bd.size() - 2];
  dm.D = bd.back();
  dm.W = k_idx.dimensions().back();
  dm.R = q_idx.dimensions().back();
  dm.per_write_gates = x.dimensions().size() == k_idx.dimensions().size();
  SDM_RETURN_IF_ERROR(CheckShape(op, "k_idx", k_idx, dm.S, {dm.W}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "k_val", k_val, dm.S, {dm.W}));
  if (dm.per_write_gates) {
    SDM_RETURN_IF_ERROR(CheckShape(op, "x (per write)", x, dm.S, {dm.W}));
  } else {
    SDM_RETURN_IF_ERROR(CheckShape(op, "x (per token)", x, dm.S, {}));
  }
  SDM_RETURN_IF_ERROR(CheckShape(op, "v", v, dm.S, {dm.D}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "beta", beta, dm.S, {}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "q_idx", q_idx, dm.S, {dm.R}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "q_val", q_val, dm.S, {dm.R}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "bank (result)", *bank_out, dm.S, {dm.K, dm.D}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "y (result)", *y, dm.S, {dm.D}));
  for (auto [name, a] : {std::pair<const char*, const ffi::AnyBuffer*>{"k_val", &k_val}, {"v", &v},
                         {"q_val", &q_val}, {"bank (result)", &*bank_out}, {"y (result)", &*y}}) {
    SDM_RETURN_IF_ERROR(CheckValueType(op, name, *a, type));
  }
  *call = DecodeCall{dm,
                     type,
                     k_idx.typed_data(),
                     k_val.untyped_data(),
                     x.typed_data(),
                     v.untyped_data(),
                     beta.typed_data(),
                     q_idx.typed_data(),
                     q_val.untyped_data(),
                     y->untyped_data(),
                     bank.untyped_data(),
                     bank_out->untyped_data(),
                     bank.size_bytes()};
  return ffi::Error::Success();
}

}  // namespace sdm_ffi

#endif  // JAX_SDM_FFI_DECODE_STEP_COMMON_H_
