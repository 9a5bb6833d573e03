// Argument checks shared by the CPU and CUDA handlers `sdm_product_key_topk` and `sdm_product_key_topk_bwd`
// (docs/DESIGN.md "Product-key top-k"): a handler binds its buffers, calls one of these, then calls its platform's
// kernel. Rows may carry any number of leading batch dims (their product is the row count).
#ifndef JAX_SDM_FFI_PRODUCT_KEY_TOPK_COMMON_H_
#define JAX_SDM_FFI_PRODUCT_KEY_TOPK_COMMON_H_

#include <cstdint>
#include <string>

#include "ffi/common.h"
#include "kernels/product_key_topk.h"

namespace sdm_ffi {

using Factors = ffi::Span<const int64_t>;

// The attributes `factors` (n_0, ..., n_{F-1}) and `k` with C candidates (-1: no table, the backward), as kernel
// dims of `rows` rows.
inline ffi::Error ReadProductKeyDims(const char* op, int64_t rows, Factors factors, int64_t k, int64_t C,
                                     sdm::ProductKeyDims* d) {
  const int64_t F = static_cast<int64_t>(factors.size());
  if (F < 1 || F > sdm::kProductKeyMaxFactors) {
    return ffi::Error::InvalidArgument(std::string(op) + ": factors must list 1 to " +
                                       std::to_string(sdm::kProductKeyMaxFactors) + " sizes, got " +
                                       std::to_string(F));
  }
  int64_t slots = 1;
  for (int64_t n : factors) {
    if (n < 1 || n > sdm::kProductKeyMaxSlots) {
      return ffi::Error::InvalidArgument(std::string(op) + ": factor sizes must be >= 1, got " +
                                         DimsToString(factors));
    }
    slots *= n;
    if (slots > sdm::kProductKeyMaxSlots) {
      return ffi::Error::InvalidArgument(std::string(op) + ": the factors " + DimsToString(factors) +
                                         " give more than 2^31 slots (the ids are int32)");
    }
  }
  const int64_t max_k = slots < sdm::kProductKeyMaxK ? slots : sdm::kProductKeyMaxK;
  if (k < 1 || k > max_k) {
    return ffi::Error::InvalidArgument(std::string(op) + ": k must be in [1, " + std::to_string(max_k) + "], got " +
                                       std::to_string(k));
  }
  if (C >= 0 && F > 1 && (C < k || C > slots)) {
    return ffi::Error::InvalidArgument(std::string(op) + ": the candidate table has " + std::to_string(C) +
                                       " candidates, expected between k = " + std::to_string(k) + " and " +
                                       std::to_string(slots));
  }
  *d = sdm::product_key_dims(rows, factors.begin(), static_cast<int>(F), k, C < 0 ? 0 : C);
  return ffi::Error::Success();
}

inline ffi::Error CheckRowType(const char* op, const char* name, const ffi::AnyBuffer& a) {
  if (a.element_type() == ffi::DataType::F32 || a.element_type() == ffi::DataType::BF16)
    return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string(op) + ": " + name + " must be float32 or bfloat16");
}

// Forward: x [..., width] (float32 or bfloat16), table [..., F, C] (int32 ranks; its leading dims, which a vmap
// adds, are ignored: every copy is the same table), results scores [..., k] (float32) and ids [..., k] (int32).
inline ffi::Error PrepareProductKeyTopk(const char* op, const ffi::AnyBuffer& x, const S32& table, Factors factors,
                                        int64_t k, R32 scores, RS32 ids, sdm::ProductKeyDims* d) {
  SDM_RETURN_IF_ERROR(CheckRowType(op, "factor_scores", x));
  auto xd = x.dimensions();
  auto td = table.dimensions();
  if (xd.size() < 1) return ffi::Error::InvalidArgument(std::string(op) + ": factor_scores must be [..., width]");
  if (td.size() < 2) {
    return ffi::Error::InvalidArgument(std::string(op) + ": the candidate table must be [..., F, C], got shape " +
                                       DimsToString(td));
  }
  SDM_RETURN_IF_ERROR(ReadProductKeyDims(op, LeadingProduct(xd, 1), factors, k, td.back(), d));
  SDM_RETURN_IF_ERROR(CheckShape(op, "factor_scores", x, d->rows, {d->width}));
  if (td[td.size() - 2] != d->F) {
    return ffi::Error::InvalidArgument(std::string(op) + ": the candidate table has shape " + DimsToString(td) +
                                       ", expected [..., F=" + std::to_string(d->F) + ", C]");
  }
  SDM_RETURN_IF_ERROR(CheckShape(op, "scores (result)", *scores, d->rows, {d->k}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "ids (result)", *ids, d->rows, {d->k}));
  return ffi::Error::Success();
}

// Backward: dscores [..., k] (float32), ids [..., k] (int32), result dx [..., width] (float32 or bfloat16).
inline ffi::Error PrepareProductKeyTopkBwd(const char* op, const F32& dscores, const S32& ids, Factors factors,
                                           const ffi::AnyBuffer& dx, sdm::ProductKeyDims* d) {
  SDM_RETURN_IF_ERROR(CheckRowType(op, "dx (result)", dx));
  auto sd = dscores.dimensions();
  if (sd.size() < 1) return ffi::Error::InvalidArgument(std::string(op) + ": dscores must be [..., k]");
  SDM_RETURN_IF_ERROR(ReadProductKeyDims(op, LeadingProduct(sd, 1), factors, sd.back(), -1, d));
  SDM_RETURN_IF_ERROR(CheckShape(op, "ids", ids, d->rows, {d->k}));
  SDM_RETURN_IF_ERROR(CheckShape(op, "dx (result)", dx, d->rows, {d->width}));
  return ffi::Error::Success();
}

}  // namespace sdm_ffi

// The buffers and attributes of the two targets, in order (ffi/common.h SDM_FFI_PARAMS), shared by the CPU and
// CUDA handlers: the factor scores [..., width] and the candidate table [..., F, C], the scores and ids [..., k];
// the backward's dscores and ids [..., k] and dx [..., width].
#define SDM_PKTOPK_BUFFERS(X, SEP)                                                                              \
  X(Arg, ::sdm_ffi::AnyBuffer, x) SEP() X(Arg, ::sdm_ffi::S32, table) SEP() X(Attr, ::sdm_ffi::Factors, factors) \
  SEP() X(Attr, int64_t, k) SEP() X(Ret, ::sdm_ffi::F32, scores) SEP() X(Ret, ::sdm_ffi::S32, ids)
#define SDM_PKTOPK_BWD_BUFFERS(X, SEP)                                                                          \
  X(Arg, ::sdm_ffi::F32, dscores) SEP() X(Arg, ::sdm_ffi::S32, ids) SEP() X(Attr, ::sdm_ffi::Factors, factors)   \
  SEP() X(Ret, ::sdm_ffi::AnyBuffer, dx)

#endif  // JAX_SDM_FFI_PRODUCT_KEY_TOPK_COMMON_H_
