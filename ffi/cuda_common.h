// Shared by the CUDA handlers: the error a kernel launch returned, as an XLA FFI error.
#ifndef JAX_SDM_FFI_CUDA_COMMON_H_
#define JAX_SDM_FFI_CUDA_COMMON_H_

#include <cuda_runtime_api.h>

#include <string>

#include "ffi/common.h"
#include "xla/ffi/api/ffi.h"

namespace sdm_ffi {

// `rc` is the cudaError_t a kernels/*_cuda function returned (0 on success).
inline xla::ffi::Error CudaStatus(const char* op, int rc) {
  if (rc == 0) return xla::ffi::Error::Success();
  const cudaError_t e = static_cast<cudaError_t>(rc);
  return xla::ffi::Error::Internal(std::string(op) + ": CUDA error " + cudaGetErrorName(e) + ": " +
                                   cudaGetErrorString(e));
}

}  // namespace sdm_ffi

// Defines the CUDA handler `symbol`: `fn(stream, buffers of LIST...)` (ffi/common.h SDM_FFI_PARAMS) on XLA's stream,
// capturable in command buffers (CUDA graphs).
#define SDM_CUDA_HANDLER(symbol, fn, LIST)                                                                   \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                                             \
      symbol, fn, ::xla::ffi::Ffi::Bind().Ctx<::xla::ffi::PlatformStream<cudaStream_t>>() SDM_FFI_BINDING(LIST), \
      {::xla::ffi::Traits::kCmdBufferCompatible})

#endif  // JAX_SDM_FFI_CUDA_COMMON_H_
