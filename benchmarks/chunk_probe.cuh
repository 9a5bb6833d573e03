// The standalone probes' stand-ins for the chunk loop's kernels (benchmarks/carveout.cu, last_use.cu,
// two_chains.cu): a gather of a chunk's rows, a write of its written rows, a staged kernel with most of an SM's
// shared memory (as the apply-inverse kernels), and a timer. Each kernel begins with sdm::chain_start, so that
// launched with programmatic dependent launch (sdm::launch) it waits for its predecessor as the package's kernels do;
// launched without, the wait is a no-op.
#ifndef JAX_SDM_BENCHMARKS_CHUNK_PROBE_CUH_
#define JAX_SDM_BENCHMARKS_CHUNK_PROBE_CUH_

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "kernels/chunk_steps/launch.cuh"

#include "cuda_check.h"

namespace probe {

constexpr int kRowWarps = 8;         // a row kernel's warps a block
constexpr int kStagedThreads = 512;  // 16 warps, as the apply-inverse kernels

// A chunk's rows: P streams of K bfloat16 rows of D columns; C tokens, each with W read and W write lanes.
struct Shape {
  int P, C, D, K, W;
  __host__ __device__ int row_vecs() const { return D / 8; }  // 16-byte segments a row
};

__device__ __forceinline__ float sum8(uint4 v) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
  float s = 0.f;
  for (int j = 0; j < 4; ++j) s += __low2float(h[j]) + __high2float(h[j]);
  return s;
}

// Blocks (stream, token, side), the side last as fwd_gather_kernel's grid: side 0 reads the token's read rows, side
// 1 its write rows ([stream, token, lane] tables); each warp reads its share of the rows (all segments of a row
// loaded before the first is used) and stores its lanes' sums. At most 8 segments (D 2048) a lane.
__global__ void __launch_bounds__(kRowWarps * 32) gather_kernel(Shape sh, const uint4* __restrict__ bank,
                                                                const int32_t* __restrict__ read_rows,
                                                                const int32_t* __restrict__ write_rows,
                                                                float* __restrict__ out) {
  sdm::chain_start();
  const int s = blockIdx.x, t = blockIdx.y, side = blockIdx.z, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int32_t* ids = (side ? write_rows : read_rows) + (static_cast<int64_t>(s) * sh.C + t) * sh.W;
  const uint4* S = bank + static_cast<int64_t>(s) * sh.K * sh.row_vecs();
  float acc = 0.f;
  for (int j = warp; j < sh.W; j += kRowWarps) {
    const uint4* row = S + static_cast<int64_t>(ids[j]) * sh.row_vecs();
    uint4 v[8];
#pragma unroll
    for (int k = 0; k < 8; ++k)
      if (lane + 32 * k < sh.row_vecs()) v[k] = row[lane + 32 * k];
#pragma unroll
    for (int k = 0; k < 8; ++k)
      if (lane + 32 * k < sh.row_vecs()) acc += sum8(v[k]);
  }
  out[((static_cast<int64_t>(blockIdx.z) * gridDim.y + t) * gridDim.x + s) * blockDim.x + threadIdx.x] = acc;
}

// Blocks (stream, token): each warp takes its share of the token's W write rows, in order, and writes row +
// delta[t] back (rounded to bfloat16; delta float32 [stream, token, D]). kLastLoads / kLastStores: the row's
// loads / stores as last uses (ld.global.cs / st.global.cs).
template <bool kLastLoads, bool kLastStores>
__global__ void __launch_bounds__(kRowWarps * 32) write_kernel(Shape sh, uint4* __restrict__ bank,
                                                               const int32_t* __restrict__ write_rows,
                                                               const float* __restrict__ delta) {
  sdm::chain_start();
  const int s = blockIdx.x, t = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int32_t* ids = write_rows + (static_cast<int64_t>(s) * sh.C + t) * sh.W;
  uint4* S = bank + static_cast<int64_t>(s) * sh.K * sh.row_vecs();
  const float* dl = delta + (static_cast<int64_t>(s) * sh.C + t) * sh.D;
  for (int j = warp; j < sh.W; j += kRowWarps) {
    uint4* row = S + static_cast<int64_t>(ids[j]) * sh.row_vecs();
    uint4 v[8];
#pragma unroll
    for (int k = 0; k < 8; ++k)
      if (lane + 32 * k < sh.row_vecs()) v[k] = kLastLoads ? __ldcs(row + lane + 32 * k) : row[lane + 32 * k];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int seg = lane + 32 * k;
      if (seg >= sh.row_vecs()) break;
      __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v[k]);
      for (int j2 = 0; j2 < 4; ++j2) {
        const float2 d = *reinterpret_cast<const float2*>(dl + seg * 8 + 2 * j2);
        h[j2] = __floats2bfloat162_rn(__low2float(h[j2]) + d.x, __high2float(h[j2]) + d.y);
      }
      if (kLastStores) __stcs(row + seg, v[k]);
      else row[seg] = v[k];
    }
  }
}

// One block an SM: stage `floats` floats from global into shared memory, then each thread sums a strided share.
__global__ void __launch_bounds__(kStagedThreads) staged_kernel(const float4* __restrict__ src, int floats,
                                                                float* __restrict__ out) {
  extern __shared__ float4 smem[];
  sdm::chain_start();
  const float4* s = src + static_cast<int64_t>(blockIdx.x) * (floats / 4);
  for (int i = threadIdx.x; i < floats / 4; i += blockDim.x) smem[i] = s[i];
  __syncthreads();
  float acc = 0.f;
  for (int i = threadIdx.x; i < floats / 4; i += blockDim.x) {
    const float4 q = smem[(i * 7) % (floats / 4)];
    acc += q.x + q.y + q.z + q.w;
  }
  out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}

// A chunk loop's rows on the device: the bank ([P, K, D] bfloat16, zeros), for each of `windows` chunks the read and
// write lanes' rows ([chunk, stream, token, lane]: per stream every row once in random order, chunk c's read side
// window 2c and write side window 2c + 1, so that no row comes again within `windows` chunks), delta rows
// ([P, C, D] float32, random) and the gather's output.
struct Problem {
  Shape sh;
  int windows = 0;
  int64_t lanes = 0;  // a side's rows a stream and chunk
  uint4* bank = nullptr;
  int32_t* read = nullptr;
  int32_t* write = nullptr;
  float* delta = nullptr;
  float* out = nullptr;
  // Chunk `c`'s tables from stream `s` on.
  const int32_t* read_at(int c, int s = 0) const {
    return read + (static_cast<int64_t>(c % windows) * sh.P + s) * lanes;
  }
  const int32_t* write_at(int c, int s = 0) const {
    return write + (static_cast<int64_t>(c % windows) * sh.P + s) * lanes;
  }
  uint4* bank_at(int s) const { return bank + static_cast<int64_t>(s) * sh.K * sh.row_vecs(); }
};

// The shape from argv (P C D K W; default the paper's: 2 128 2048 262144 64), checked, and its problem; prints the
// device and the shape. Exits with 2 on a shape the kernels do not take.
inline Problem make_problem(int argc, char** argv) {
  Problem pb;
  Shape& sh = pb.sh;
  sh = Shape{2, 128, 2048, 262144, 64};
  if (argc > 5) sh = Shape{std::atoi(argv[1]), std::atoi(argv[2]), std::atoi(argv[3]), std::atoi(argv[4]),
                           std::atoi(argv[5])};
  pb.lanes = static_cast<int64_t>(sh.C) * sh.W;
  pb.windows = static_cast<int>(sh.K / (2 * pb.lanes));
  if (sh.D % 8 || sh.row_vecs() > 256 || pb.windows < 2) {
    std::fprintf(stderr, "D must be a multiple of 8 and at most 2048, and K at least 4 C W\n");
    std::exit(2);
  }
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, %d SMs, L2 %d MiB; P %d, C %d, D %d (bfloat16), K %d, W = R = %d: a side's rows %.1f MiB a chunk\n",
              prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20, sh.P, sh.C, sh.D, sh.K, sh.W,
              static_cast<double>(pb.lanes) * sh.P * sh.D * 2 / (1 << 20));
  std::vector<int32_t> perm(sh.K);
  std::mt19937 rng(11);
  std::vector<int32_t> read_ids(static_cast<size_t>(pb.windows) * sh.P * pb.lanes), write_ids(read_ids.size());
  for (int s = 0; s < sh.P; ++s) {
    for (int i = 0; i < sh.K; ++i) perm[i] = i;
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int c = 0; c < pb.windows; ++c)
      for (int64_t i = 0; i < pb.lanes; ++i) {
        read_ids[(static_cast<size_t>(c) * sh.P + s) * pb.lanes + i] = perm[(2 * c) * pb.lanes + i];
        write_ids[(static_cast<size_t>(c) * sh.P + s) * pb.lanes + i] = perm[(2 * c + 1) * pb.lanes + i];
      }
  }
  const size_t bank_bytes = static_cast<size_t>(sh.P) * sh.K * sh.D * 2;
  CHECK(cudaMalloc(&pb.bank, bank_bytes));
  CHECK(cudaMemset(pb.bank, 0, bank_bytes));
  CHECK(cudaMalloc(&pb.read, sizeof(int32_t) * read_ids.size()));
  CHECK(cudaMalloc(&pb.write, sizeof(int32_t) * write_ids.size()));
  CHECK(cudaMemcpy(pb.read, read_ids.data(), sizeof(int32_t) * read_ids.size(), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(pb.write, write_ids.data(), sizeof(int32_t) * write_ids.size(), cudaMemcpyHostToDevice));
  const size_t delta_n = static_cast<size_t>(sh.P) * sh.C * sh.D;
  std::vector<float> h_delta(delta_n);
  for (auto& x : h_delta) x = std::uniform_real_distribution<float>(-1.f, 1.f)(rng);
  CHECK(cudaMalloc(&pb.delta, sizeof(float) * delta_n));
  CHECK(cudaMemcpy(pb.delta, h_delta.data(), sizeof(float) * delta_n, cudaMemcpyHostToDevice));
  CHECK(cudaMalloc(&pb.out, sizeof(float) * 2 * sh.P * sh.C * kRowWarps * 32));
  return pb;
}

// Median over 5 runs of the time of `calls` calls of `body(i)` (after 5 warm-up calls), in us a call: CUDA events
// on `stream`, around work that `body` may spread over other streams as long as it joins `stream`.
template <typename Body>
float time_us(cudaStream_t stream, int calls, Body body) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  int call = 0;
  for (int i = 0; i < 5; ++i) body(call++);
  std::vector<float> runs;
  for (int r = 0; r < 5; ++r) {
    CHECK(cudaEventRecord(a, stream));
    for (int i = 0; i < calls; ++i) body(call++);
    CHECK(cudaEventRecord(b, stream));
    CHECK(cudaEventSynchronize(b));
    float ms = 0.f;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    runs.push_back(ms * 1000.f / calls);
  }
  std::sort(runs.begin(), runs.end());
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  return runs[2];
}

}  // namespace probe

#endif  // JAX_SDM_BENCHMARKS_CHUNK_PROBE_CUH_
