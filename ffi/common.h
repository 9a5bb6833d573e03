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
using AnyBuffer = ffi::AnyBuffer;

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

// `a` has the bank's dtype.
inline ffi::Error CheckValueType(const char* op, const char* name, const ffi::AnyBuffer& a, ffi::DataType type) {
  if (a.element_type() == type) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string(op) + ": " + name + " must have the bank's dtype");
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

// The interface of a handler, declared once: a list macro LIST(X, SEP) names its buffers and attributes in order,
// X(kind, type, name) per entry with SEP() between entries. kind is Arg (an operand of that buffer type), Ret (a
// result), Attr (an attribute of that type, by name) or Rest (any remaining results, ffi::RemainingRets). From the
// list: the handler's parameters (SDM_FFI_PARAMS), their names as arguments (SDM_FFI_NAMES), the binding
// (SDM_FFI_BINDING, after ffi::Ffi::Bind() and any context) and the description of the target that the extension
// modules give Python (ffi/targets.h), so that jax_sdm/ffi_ops.py passes operands and reads results by name.
#define SDM_FFI_COMMA() ,
#define SDM_FFI_NOTHING()
#define SDM_FFI_PARAM_Arg(T, name) T name
#define SDM_FFI_PARAM_Ret(T, name) ::xla::ffi::Result<T> name
#define SDM_FFI_PARAM_Attr(T, name) T name
#define SDM_FFI_PARAM_Rest(T, name) ::xla::ffi::RemainingRets name
#define SDM_FFI_PARAM(kind, T, name) SDM_FFI_PARAM_##kind(T, name)
#define SDM_FFI_NAME(kind, T, name) name
#define SDM_FFI_BIND_Arg(T, name) .Arg<T>()
#define SDM_FFI_BIND_Ret(T, name) .Ret<T>()
#define SDM_FFI_BIND_Attr(T, name) .Attr<T>(#name)
#define SDM_FFI_BIND_Rest(T, name) .RemainingRets()
#define SDM_FFI_BIND(kind, T, name) SDM_FFI_BIND_##kind(T, name)
#define SDM_FFI_PARAMS(LIST) LIST(SDM_FFI_PARAM, SDM_FFI_COMMA)
#define SDM_FFI_NAMES(LIST) LIST(SDM_FFI_NAME, SDM_FFI_COMMA)
#define SDM_FFI_BINDING(LIST) LIST(SDM_FFI_BIND, SDM_FFI_NOTHING)

// Return the error of a check if it failed.
#define SDM_RETURN_IF_ERROR(expr)            \
  do {                                       \
    ::xla::ffi::Error sdm_err_ = (expr);     \
    if (sdm_err_.failure()) return sdm_err_; \
  } while (0)

#endif  // JAX_SDM_FFI_COMMON_H_
