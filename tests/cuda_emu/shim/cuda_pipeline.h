// The CUDA pipeline header (asynchronous copies to shared memory), for the host emulation (tests/cuda_emu): a
// thread's copies wait in its queue (emu::async_open, emu::async_groups) until __pipeline_wait_prior covers their
// group, and land then, so that a read before the wait (a missing or too short wait) sees the old contents.
#pragma once
#include <cstring>

#include "cuda_emu.h"

inline void __pipeline_memcpy_async(void* dst, const void* src, size_t bytes) {
  emu::async_open.push_back({dst, src, bytes});
}
inline void __pipeline_commit() {
  emu::async_groups.push_back(std::move(emu::async_open));
  emu::async_open.clear();
}
// Complete all but the `prior` most recent committed groups (CUDA counts up to 8).
inline void __pipeline_wait_prior(size_t prior) {
  while (emu::async_groups.size() > std::min<size_t>(prior, 8)) {
    for (const emu::AsyncCopy& c : emu::async_groups.front()) std::memcpy(c.dst, c.src, c.bytes);
    emu::async_groups.pop_front();
  }
}
