// SDM_HOST_DEVICE marks a small inline function that both the C++ and the CUDA kernels call (one definition of
// the arithmetic for both platforms).
#ifndef JAX_SDM_KERNELS_HOST_DEVICE_H_
#define JAX_SDM_KERNELS_HOST_DEVICE_H_

#if defined(__CUDACC__)
#define SDM_HOST_DEVICE __host__ __device__
#else
#define SDM_HOST_DEVICE
#endif

#endif  // JAX_SDM_KERNELS_HOST_DEVICE_H_
