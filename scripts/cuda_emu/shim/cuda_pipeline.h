// The CUDA pipeline header (asynchronous copies to shared memory), for the host emulation (scripts/cuda_emu): a
// copy completes at once, so committing and waiting do nothing.
#pragma once
#include <cstring>

#include "cuda_emu.h"

inline void __pipeline_memcpy_async(void* dst, const void* src, size_t bytes) { std::memcpy(dst, src, bytes); }
inline void __pipeline_commit() {}
inline void __pipeline_wait_prior(size_t) {}
