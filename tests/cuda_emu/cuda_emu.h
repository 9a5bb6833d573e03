// Host emulation of the CUDA features the kernels of kernels/phase1_cuda.cu and kernels/chunk_steps/ use
// (tests/cuda_emu/run.sh): one block at a time, one std::thread per CUDA thread (the threads of a launch are
// started once and walk its blocks in turn), std::barrier for __syncthreads / __syncwarp and the warp collectives.
// 1-3D grids and blocks (threads numbered x fastest, warps of 32 consecutive threads), dynamic shared memory (one
// buffer of exactly the launch's size, refilled with a byte pattern before every block: 0xff, a float NaN, so that
// a read of a cell no thread of the block wrote shows), vector types, __ldg, __ldcs, __stwb and __stcs, bfloat16
// (round to nearest even, 16 bits; the float8 conversion in shim/cuda_fp8.h) and the few runtime calls the launchers
// make.
// Only what the kernels' logic needs: nothing about speed.
#pragma once
#include <algorithm>
#include <atomic>
#include <barrier>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
  unsigned count() const { return x * y * z; }
};
inline thread_local dim3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __grid_constant__
struct CUstream_st;
typedef CUstream_st* cudaStream_t;
typedef int cudaError_t;
constexpr int cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorInvalidConfiguration = 9,
              cudaErrorLaunchFailure = 719, cudaFuncAttributeMaxDynamicSharedMemorySize = 8;
namespace emu {
// A prefetch hint's address, read (transform.py): ASan reports one outside every buffer, as a GPU would not.
inline void touch(const void* p) {
  const volatile char c = *static_cast<const volatile char*>(p);
  (void)c;
}
// The launch limits of the GPUs the kernels are built for (sm_80 / sm_90): a launch past them fails on the GPU
// (cudaGetLastError), so it fails here too, with a line on stderr naming it.
constexpr unsigned kMaxThreads = 1024, kMaxBlockZ = 64, kMaxGridYZ = 65535;
constexpr int kDefaultDynSmem = 48 * 1024, kMaxDynSmem = 227 * 1024;
constexpr int kSms = 132;  // an H100's SMs: the cases' grids are small enough that the group kernels split lanes
inline int last_error = 0;
inline std::map<const void*, int> dyn_smem_allowed;  // per kernel, from cudaFuncSetAttribute
}  // namespace emu
template <typename F> int cudaFuncSetAttribute(F kernel, int attr, int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize) return 0;
  if (value < 0 || value > emu::kMaxDynSmem) return cudaErrorInvalidValue;
  emu::dyn_smem_allowed[reinterpret_cast<const void*>(kernel)] = value;
  return 0;
}
inline int cudaGetLastError() { return std::exchange(emu::last_error, 0); }
inline int cudaMemsetAsync(void* p, int v, size_t bytes, cudaStream_t) {
  if (bytes) std::memset(p, v, bytes);
  return 0;
}
enum cudaMemcpyKind { cudaMemcpyDeviceToDevice = 3 };
inline int cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind, cudaStream_t) {
  if (bytes) std::memcpy(dst, src, bytes);
  return 0;
}
// Integer atomics: the threads of a block run at once here too.
inline unsigned atomicMin(unsigned* p, unsigned v) {
  std::atomic_ref<unsigned> a(*p);
  unsigned old = a.load();
  while (v < old && !a.compare_exchange_weak(old, v)) {
  }
  return old;
}
// CUDA's integer min/max, for mixed widths too (int with int64_t: the common type).
template <typename A, typename B>
inline std::common_type_t<A, B> min(A a, B b) { return a < b ? a : b; }
template <typename A, typename B>
inline std::common_type_t<A, B> max(A a, B b) { return a > b ? a : b; }

struct alignas(16) float4 { float x, y, z, w; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) int4 { int x, y, z, w; };
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
inline float2 make_float2(float x, float y) { return float2{x, y}; }
inline int4 make_int4(int x, int y, int z, int w) { return int4{x, y, z, w}; }
template <typename T> inline T __ldg(const T* p) { return *p; }
template <typename T> inline void __stwb(T* p, T v) { *p = v; }
template <typename T> inline void __stcs(T* p, T v) { *p = v; }
template <typename T> inline T __ldcs(const T* p) { return *p; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
// Separately rounded float operations (the host compiles in ISO C++ mode: no contraction into fused multiply-adds).
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }

// bfloat16: the high 16 bits of a float32, rounded to nearest even (NaN stays a quiet NaN).
struct __nv_bfloat16 { uint16_t bits; };
inline float __bfloat162float(__nv_bfloat16 h) { return std::bit_cast<float>(static_cast<uint32_t>(h.bits) << 16); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16{static_cast<uint16_t>((u >> 16) | 0x40)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return __nv_bfloat16{static_cast<uint16_t>(u >> 16)};
}

namespace emu {
inline std::unique_ptr<std::barrier<>> block_bar;
inline std::vector<std::unique_ptr<std::barrier<>>> warp_bar;
inline std::vector<unsigned> wvals;  // [warp * 32 + lane]
inline std::vector<uint32_t> mvals;  // [warp * 32 + lane][6]: mma_tf32's A and B fragments
inline std::vector<unsigned char> smem;
inline unsigned char smem_fill = 0xff;  // the pattern dynamic shared memory holds when a block starts
inline thread_local int tid;            // linear thread index in the block (x fastest)
// A thread's asynchronous copies (shim/cuda_pipeline.h): issued and not yet committed, then committed groups,
// oldest first. A copy lands when a wait covers its group, not before: a read of its destination before the wait
// sees what was there (on a GPU it may see either).
struct AsyncCopy {
  void* dst;
  const void* src;
  size_t bytes;
};
inline thread_local std::vector<AsyncCopy> async_open;
inline thread_local std::deque<std::vector<AsyncCopy>> async_groups;
// The order the blocks of a launch run in, from CUDA_EMU_BLOCKS: forward (the default), reverse or shuffle (a
// fixed permutation per launch). A GPU runs them in any order and at once: results that change with the order
// show a dependence between the blocks of one launch (a row with two writers, a read of another block's write).
inline std::vector<unsigned> block_order(unsigned blocks) {
  static const std::string mode = [] {
    const char* e = std::getenv("CUDA_EMU_BLOCKS");
    return std::string(e ? e : "forward");
  }();
  static unsigned launches = 0;
  std::vector<unsigned> order(blocks);
  for (unsigned b = 0; b < blocks; ++b) order[b] = b;
  if (mode == "reverse") std::reverse(order.begin(), order.end());
  if (mode == "shuffle") std::shuffle(order.begin(), order.end(), std::mt19937(++launches));
  return order;
}
inline unsigned char* dyn_smem() { return smem.data(); }
inline int lane() { return tid & 31; }
inline int warp() { return tid >> 5; }
inline void warp_sync() { warp_bar[warp()]->arrive_and_wait(); }

template <typename K, typename... A>
void launch(K kernel, dim3 grid, dim3 block, size_t shmem, cudaStream_t, A... args) {
  const int threads = static_cast<int>(block.count());
  const unsigned blocks = grid.count();
  const auto allowed = dyn_smem_allowed.find(reinterpret_cast<const void*>(kernel));
  const size_t smem_max = std::max<size_t>(kDefaultDynSmem, allowed == dyn_smem_allowed.end() ? 0 : allowed->second);
  if (threads == 0 || blocks == 0 || block.x > kMaxThreads || block.y > kMaxThreads || block.z > kMaxBlockZ ||
      static_cast<unsigned>(threads) > kMaxThreads || grid.x > 0x7fffffffu || grid.y > kMaxGridYZ ||
      grid.z > kMaxGridYZ || shmem > smem_max) {
    std::fprintf(stderr, "emu::launch: invalid configuration: grid (%u, %u, %u), block (%u, %u, %u), %zu bytes of "
                 "dynamic shared memory (at most %zu)\n", grid.x, grid.y, grid.z, block.x, block.y, block.z, shmem,
                 smem_max);
    if (!last_error) last_error = cudaErrorInvalidConfiguration;
    return;
  }
  blockDim = block;
  gridDim = grid;
  smem.assign(shmem, smem_fill);
  block_bar = std::make_unique<std::barrier<>>(threads);
  warp_bar.clear();
  for (int w = 0; w < threads; w += 32) warp_bar.push_back(std::make_unique<std::barrier<>>(std::min(32, threads - w)));
  wvals.assign((threads + 31) / 32 * 32, 0);
  mvals.assign((threads + 31) / 32 * 32 * 6, 0);
  const std::vector<unsigned> order = block_order(blocks);
  std::vector<std::thread> ts;
  std::atomic<bool> unwaited{false};
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([=, &order, &unwaited] {
      tid = t;
      threadIdx = dim3(t % block.x, t / block.x % block.y, t / (block.x * block.y));
      for (unsigned b = 0; b < blocks; ++b) {
        const unsigned id = order[b];
        blockIdx = dim3(id % grid.x, id / grid.x % grid.y, id / (grid.x * grid.y));
        kernel(args...);
        bool pending = !async_open.empty();
        for (const auto& g : async_groups) pending = pending || !g.empty();
        if (pending) {  // a copy the block never waited for: it may land in the next block's shared memory
          std::fprintf(stderr, "emu::launch: thread %d of block %u ended with asynchronous copies not waited for\n", t,
                       id);
          unwaited = true;
        }
        async_open.clear();
        async_groups.clear();
        block_bar->arrive_and_wait();  // the block is done: its shared memory is refilled for the next
        if (t == 0 && b + 1 < blocks) std::fill(smem.begin(), smem.end(), smem_fill);
        block_bar->arrive_and_wait();
      }
    });
  }
  for (auto& t : ts) t.join();
  if (unwaited && !last_error) last_error = cudaErrorLaunchFailure;
}
}  // namespace emu

// cudaLaunchKernelEx with its launch attributes (programmatic dependent launch: the order of launches is all the
// host has, so the attribute changes nothing here), and the device queries the launcher makes.
typedef int cudaDeviceAttr;
constexpr int cudaLaunchAttributeProgrammaticStreamSerialization = 4, cudaDevAttrComputeCapabilityMajor = 75,
              cudaDevAttrMaxSharedMemoryPerBlockOptin = 97, cudaDevAttrMultiProcessorCount = 16;
struct cudaLaunchAttribute {
  int id = 0;
  struct {
    int programmaticStreamSerializationAllowed = 0;
  } val;
};
struct cudaLaunchConfig_t {
  dim3 gridDim, blockDim;
  size_t dynamicSmemBytes = 0;
  cudaStream_t stream = nullptr;
  cudaLaunchAttribute* attrs = nullptr;
  unsigned numAttrs = 0;
};
namespace emu {
inline long launches = 0, pdl_launches = 0;  // cudaLaunchKernelEx's launches, and those with the PDL attribute
}  // namespace emu
template <typename... P, typename... A>
int cudaLaunchKernelEx(const cudaLaunchConfig_t* cfg, void (*kernel)(P...), A... args) {
  ++emu::launches;
  for (unsigned i = 0; i < cfg->numAttrs; ++i)
    if (cfg->attrs[i].id == cudaLaunchAttributeProgrammaticStreamSerialization &&
        cfg->attrs[i].val.programmaticStreamSerializationAllowed)
      ++emu::pdl_launches;
  emu::launch(kernel, cfg->gridDim, cfg->blockDim, cfg->dynamicSmemBytes, cfg->stream, static_cast<P>(args)...);
  return cudaGetLastError();
}
inline int cudaGetDevice(int* device) {
  *device = 0;
  return 0;
}
inline int cudaDeviceGetAttribute(int* value, int attr, int) {
  *value = attr == cudaDevAttrComputeCapabilityMajor            ? 9
           : attr == cudaDevAttrMaxSharedMemoryPerBlockOptin ? emu::kMaxDynSmem
           : attr == cudaDevAttrMultiProcessorCount          ? emu::kSms
                                                             : 0;
  return 0;
}

inline void __syncthreads() { emu::block_bar->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::warp_sync(); }
inline int __ffs(unsigned v) { return __builtin_ffs(static_cast<int>(v)); }
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __clz(unsigned v) { return v ? __builtin_clz(v) : 32; }

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

inline float __uint_as_float(unsigned u) { return std::bit_cast<float>(u); }
inline unsigned __float_as_uint(float x) { return std::bit_cast<unsigned>(x); }

namespace emu {
// mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 across the warp (kernels/chunk_steps/dense.cuh mma_tf32):
// lane 4 g + t holds A's (g, t), (g + 8, t), (g, t + 4), (g + 8, t + 4), B's (t, g), (t + 4, g) and the result's
// (g, 2 t), (g, 2 t + 1), (g + 8, 2 t), (g + 8, 2 t + 1). Each result adds A's row times B's column, k ascending,
// the operands' low 13 bits dropped as the tensor core drops them, each sum rounded to float32. A GPU's order and
// rounding inside a step are its own: this checks the fragments' indexing, not the GPU's bits.
inline void mma_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  uint32_t* w = &mvals[warp() * 32 * 6];
  for (int i = 0; i < 4; ++i) w[lane() * 6 + i] = a[i];
  for (int i = 0; i < 2; ++i) w[lane() * 6 + 4 + i] = b[i];
  warp_sync();
  const auto A = [&](int row, int k) {
    return std::bit_cast<float>(w[(4 * (row % 8) + k % 4) * 6 + (row >= 8) + 2 * (k >= 4)] & ~0x1fffu);
  };
  const auto B = [&](int k, int col) {
    return std::bit_cast<float>(w[(4 * col + k % 4) * 6 + 4 + (k >= 4)] & ~0x1fffu);
  };
  const int g = lane() / 4, t = lane() % 4;
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i / 2), col = 2 * t + i % 2;
    for (int k = 0; k < 8; ++k) d[i] += A(row, k) * B(k, col);
  }
  warp_sync();
}
}  // namespace emu

inline unsigned __match_any_sync(unsigned, unsigned v) {
  return emu::collective(v, [&](const unsigned* w) { return emu::lanes_where(w, v, false); });
}
inline unsigned __ballot_sync(unsigned, bool p) {
  return emu::collective(p, [](const unsigned* w) { return emu::lanes_where(w, 0, true); });
}
namespace emu {
// A warp reduction: op folded over the 32 posted values in lane order, from init.
template <typename Op>
unsigned reduce_lanes(unsigned v, unsigned init, Op op) {
  return collective(v, [&](const unsigned* w) {
    unsigned r = init;
    for (int l = 0; l < 32; ++l) r = op(r, w[l]);
    return r;
  });
}
}  // namespace emu
inline unsigned __reduce_add_sync(unsigned, unsigned v) {
  return emu::reduce_lanes(v, 0u, [](unsigned a, unsigned b) { return a + b; });
}
inline unsigned __reduce_or_sync(unsigned, unsigned v) {
  return emu::reduce_lanes(v, 0u, [](unsigned a, unsigned b) { return a | b; });
}
inline unsigned __reduce_and_sync(unsigned, unsigned v) {
  return emu::reduce_lanes(v, ~0u, [](unsigned a, unsigned b) { return a & b; });
}
inline int __shfl_up_sync(unsigned, int x, int o) {
  return emu::collective(static_cast<unsigned>(x), [&](const unsigned* w) {
    return emu::lane() >= o ? static_cast<int>(w[emu::lane() - o]) : x;
  });
}
inline int __shfl_sync(unsigned, int x, int src) {
  return emu::collective(static_cast<unsigned>(x), [&](const unsigned* w) { return static_cast<int>(w[src]); });
}
inline float __shfl_sync(unsigned, float x, int src) {
  return std::bit_cast<float>(
      emu::collective(std::bit_cast<unsigned>(x), [&](const unsigned* w) { return w[src]; }));
}
inline int __shfl_xor_sync(unsigned, int x, int mask) {
  return static_cast<int>(emu::collective(static_cast<unsigned>(x), [&](const unsigned* w) {
    return w[emu::lane() ^ mask];
  }));
}
inline float __shfl_xor_sync(unsigned, float x, int mask) {
  return std::bit_cast<float>(emu::collective(std::bit_cast<unsigned>(x), [&](const unsigned* w) {
    return w[emu::lane() ^ mask];
  }));
}
