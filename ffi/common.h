// Shared checks for the FFI handlers: shapes with any number of leading batch dims (what vmap adds through
// vmap_method="broadcast_all"), and readable error messages.
#ifndef JAX_SDM_FFI_COMMON_H_
#define JAX_SDM_FFI_COMMON_H_

#include <cstdint>
#include <exception>
#include <initializer_list>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace sdm_ffi {

namespace ffi = xla::ffi;

// The buffer types of the handlers' bindings: float32 and int32 arguments and results.
using F32 = ffi::Buffer<ffi::F32>;
using S32 = ffi::Buffer<ffi::S32>;
using R32 = ffi::ResultBuffer<ffi::F32>;
using RS32 = ffi::ResultBuffer<ffi::S32>;

inline std::string DimsToString(ffi::Span<const int64_t> dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

inline std::string ListToString(std::initializer_list<int64_t> dims) {
  std::string s = "[..., ";
  size_t i = 0;
  for (int64_t d : dims) s += (i++ ? ", " : "") + std::to_string(d);
  return s + "]";
}

// Product of all dims but the last `trailing` (1 for none); -1 if the rank is below `trailing`.
inline int64_t LeadingProduct(ffi::Span<const int64_t> dims, size_t trailing) {
  if (dims.size() < trailing) return -1;
  int64_t p = 1;
  for (size_t i = 0; i + trailing < dims.size(); ++i) p *= dims[i];
  return p;
}

// `buf` must be [lead..., trailing...] whose leading dims multiply to `lead`.
template <typename B>
ffi::Error CheckShape(const char* op, const char* name, const B& buf, int64_t lead,
                      std::initializer_list<int64_t> trailing) {
  auto dims = buf.dimensions();
  bool ok = LeadingProduct(dims, trailing.size()) == lead;
  size_t i = dims.size() - (ok ? trailing.size() : 0);
  for (int64_t d : trailing) {
    if (!ok) break;
    ok = dims[i++] == d;
  }
  if (ok) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string(op) + ": " + name + " has shape " + DimsToString(dims) +
                                     ", expected " + ListToString(trailing) + " with leading dims of product " +
                                     std::to_string(lead));
}

// Runs a CPU kernel; a C++ exception (the std::bad_alloc of its scratch) becomes an Internal error of `op`.
template <typename Kernel>
ffi::Error RunCatching(const char* op, Kernel&& kernel) {
  try {
    kernel();
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string(op) + ": " + e.what());
  }
  return ffi::Error::Success();
}

}  // namespace sdm_ffi

// Return the error of a check if it failed.
#define SDM_RETURN_IF_ERROR(expr)            \
  do {                                       \
    ::xla::ffi::Error sdm_err_ = (expr);     \
    if (sdm_err_.failure()) return sdm_err_; \
  } while (0)

#endif  // JAX_SDM_FFI_COMMON_H_
