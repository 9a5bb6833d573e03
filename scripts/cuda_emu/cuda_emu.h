// Host emulation of the CUDA features kernels/phase1_cuda.cu uses (scripts/cuda_emu/run.sh): one block at a time,
// one std::thread per CUDA thread, std::barrier for __syncthreads / __syncwarp and the warp collectives.
#pragma once
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>
#include <memory>

struct dim3 { unsigned x = 1, y = 1, z = 1; };
inline thread_local dim3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
struct CUstream_st;
typedef CUstream_st* cudaStream_t;
typedef int cudaError_t;
constexpr int cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaFuncAttributeMaxDynamicSharedMemorySize = 8;
template <typename F> int cudaFuncSetAttribute(F, int, int) { return 0; }
inline int cudaGetLastError() { return 0; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }

namespace emu {
inline std::unique_ptr<std::barrier<>> block_bar;
inline std::vector<std::unique_ptr<std::barrier<>>> warp_bar;
inline std::vector<unsigned> wvals;  // [warp * 32 + lane]
inline std::vector<unsigned char> smem;
inline unsigned char* dyn_smem() { return smem.data(); }
inline int lane() { return threadIdx.x & 31; }
inline int warp() { return threadIdx.x >> 5; }
inline void warp_sync() { warp_bar[warp()]->arrive_and_wait(); }

template <typename K, typename... A>
void launch(K kernel, unsigned blocks, int threads, size_t shmem, cudaStream_t, A... args) {
  blockDim.x = threads;
  gridDim.x = blocks;
  smem.assign(shmem, 0xcd);
  block_bar = std::make_unique<std::barrier<>>(threads);
  warp_bar.clear();
  for (int w = 0; w < threads / 32; ++w) warp_bar.push_back(std::make_unique<std::barrier<>>(32));
  wvals.assign(threads, 0);
  for (unsigned b = 0; b < blocks; ++b) {
    std::vector<std::thread> ts;
    for (int t = 0; t < threads; ++t) {
      ts.emplace_back([=] {
        threadIdx.x = t;
        blockIdx.x = b;
        kernel(args...);
      });
    }
    for (auto& t : ts) t.join();
  }
}
}  // namespace emu

inline void __syncthreads() { emu::block_bar->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::warp_sync(); }
inline int __ffs(unsigned v) { return __builtin_ffs(static_cast<int>(v)); }
inline int __popc(unsigned v) { return __builtin_popcount(v); }

namespace emu {
// A warp collective: each lane posts v; f(the 32 posted values) runs once all have posted, and every lane waits
// again before the slots are reused.
template <typename F>
auto collective(unsigned v, F f) {
  unsigned* w = &wvals[warp() * 32];
  w[lane()] = v;
  warp_sync();
  const auto r = f(static_cast<const unsigned*>(w));
  warp_sync();
  return r;
}
inline unsigned lanes_where(const unsigned* w, unsigned v, bool nonzero) {
  unsigned m = 0;
  for (int l = 0; l < 32; ++l) m |= ((nonzero ? w[l] != 0 : w[l] == v) ? 1u : 0u) << l;
  return m;
}
}  // namespace emu

inline unsigned __match_any_sync(unsigned, unsigned v) {
  return emu::collective(v, [&](const unsigned* w) { return emu::lanes_where(w, v, false); });
}
inline unsigned __ballot_sync(unsigned, bool p) {
  return emu::collective(p, [](const unsigned* w) { return emu::lanes_where(w, 0, true); });
}
inline int __shfl_up_sync(unsigned, int x, int o) {
  return emu::collective(static_cast<unsigned>(x), [&](const unsigned* w) {
    return emu::lane() >= o ? static_cast<int>(w[emu::lane() - o]) : x;
  });
}
inline int __shfl_sync(unsigned, int x, int src) {
  return emu::collective(static_cast<unsigned>(x), [&](const unsigned* w) { return static_cast<int>(w[src]); });
}
