// CHECK(call): the standalone benchmarks' error check: a failing CUDA runtime call prints where and why, and exits.
#ifndef JAX_SDM_BENCHMARKS_CUDA_CHECK_H_
#define JAX_SDM_BENCHMARKS_CUDA_CHECK_H_

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CHECK(x)                                                                                  \
  do {                                                                                            \
    cudaError_t err_ = (x);                                                                       \
    if (err_ != cudaSuccess) {                                                                    \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(err_));   \
      std::exit(1);                                                                               \
    }                                                                                             \
  } while (0)

#endif  // JAX_SDM_BENCHMARKS_CUDA_CHECK_H_
