// The CUDA kernels' name for a bank element type: sdm::bf16 (the host code's bfloat16, kernels/bf16.h) is
// __nv_bfloat16 in device code, with the same layout.
#ifndef JAX_SDM_KERNELS_BF16_CUDA_CUH_
#define JAX_SDM_KERNELS_BF16_CUDA_CUH_

#include <cuda_bf16.h>

#include "kernels/bf16.h"

namespace sdm {

template <typename T>
struct Device {
  using type = T;
};
template <>
struct Device<bf16> {
  using type = __nv_bfloat16;
};

}  // namespace sdm

#endif  // JAX_SDM_KERNELS_BF16_CUDA_CUH_
