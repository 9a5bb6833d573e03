// Whether a row kernel that reads again the rows its predecessor gathered keeps more of them in the L2 when it loads
// and stores them as last uses (ld.global.cs / st.global.cs: lines the L2 evicts first), at the chunk loop's
// pattern: the forward write after the gather (and Phase A after GWR). A chunk's gather reads two sides, the read
// lanes' rows and then the write lanes' rows (blocks (stream, token, side), the side last, as fwd_gather_kernel's
// grid); the write kernel then takes the written rows again in token order, one warp a row, reading each, adding a
// token's delta row (float32, a small buffer the L2 should keep) and storing it. A side's rows are more than the L2
// holds (64 MiB at the paper's shape), so in token order the write starts with the rows the L2 dropped first.
//
// For each mode of the write kernel (`plain`; `loads`: last-use loads; `both`: last-use loads and stores) it times
// the gather and the write of successive chunks (fresh random rows each chunk) and prints each kernel's time. On the
// GPU machine, from the repository's root:
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -I. benchmarks/last_use.cu -o /tmp/last_use && /tmp/last_use [P C D K W]
//
// (default: the paper's shape, P 2, C 128, D 2048 bfloat16 columns, K 262144, W = R = 64). Times: CUDA events around
// each kernel of 32 chunks after 4 warm-up chunks, the median over 5 such runs of the per-chunk sums.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "cuda_check.h"

namespace {

constexpr int kWarps = 8;  // a block's warps, in both kernels

struct Shape {
  int P, C, D, K, W;
  __host__ __device__ int row_vecs() const { return D / 8; }  // 16-byte segments a bfloat16 row
};

__device__ __forceinline__ float sum8(uint4 v) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
  float s = 0.f;
  for (int j = 0; j < 4; ++j) s += __low2float(h[j]) + __high2float(h[j]);
  return s;
}

// Blocks (stream, token, side): side 0 reads the token's read rows, side 1 its write rows, W rows each; each warp
// reads its share of the rows (all segments of a row loaded before the first is used) and stores its lanes' sums.
__global__ void __launch_bounds__(kWarps * 32) gather_kernel(Shape sh, const uint4* __restrict__ bank,
                                                             const int32_t* __restrict__ read_rows,
                                                             const int32_t* __restrict__ write_rows,
                                                             float* __restrict__ out) {
  const int s = blockIdx.x, t = blockIdx.y, side = blockIdx.z, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int32_t* ids = (side ? write_rows : read_rows) + (static_cast<int64_t>(s) * sh.C + t) * sh.W;
  const uint4* S = bank + static_cast<int64_t>(s) * sh.K * sh.row_vecs();
  float acc = 0.f;
  for (int j = warp; j < sh.W; j += kWarps) {
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
// delta[t] back (rounded to bfloat16). kLastLoads / kLastStores: the row's loads / stores as last uses.
template <bool kLastLoads, bool kLastStores>
__global__ void __launch_bounds__(kWarps * 32) write_kernel(Shape sh, uint4* __restrict__ bank,
                                                            const int32_t* __restrict__ write_rows,
                                                            const float* __restrict__ delta) {
  const int s = blockIdx.x, t = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int32_t* ids = write_rows + (static_cast<int64_t>(s) * sh.C + t) * sh.W;
  uint4* S = bank + static_cast<int64_t>(s) * sh.K * sh.row_vecs();
  const float* dl = delta + (static_cast<int64_t>(s) * sh.C + t) * sh.D;
  for (int j = warp; j < sh.W; j += kWarps) {
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

}  // namespace

int main(int argc, char** argv) {
  Shape sh{2, 128, 2048, 262144, 64};
  if (argc > 5) sh = Shape{std::atoi(argv[1]), std::atoi(argv[2]), std::atoi(argv[3]), std::atoi(argv[4]),
                           std::atoi(argv[5])};
  if (sh.D % 8 || sh.row_vecs() > 256) {
    std::fprintf(stderr, "D must be a multiple of 8 and at most 2048\n");
    return 2;
  }
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const int64_t lanes = static_cast<int64_t>(sh.C) * sh.W;  // a side's rows a stream and chunk
  const int windows = static_cast<int>(sh.K / (2 * lanes));    // chunks before a row comes again
  std::printf("%s, L2 %d MiB; P %d, C %d, D %d (bfloat16), K %d, W = R = %d: a side's rows %.1f MiB a chunk\n",
              prop.name, prop.l2CacheSize >> 20, sh.P, sh.C, sh.D, sh.K, sh.W,
              static_cast<double>(lanes) * sh.P * sh.D * 2 / (1 << 20));
  if (windows < 2) {
    std::fprintf(stderr, "K too small for two disjoint sides a chunk\n");
    return 2;
  }

  // Per stream every row once, in random order; chunk c reads window 2c (read side) and 2c + 1 (write side), as
  // [stream, token, lane] tables.
  std::vector<int32_t> perm(sh.K);
  std::mt19937 rng(11);
  std::vector<int32_t> read_ids(static_cast<size_t>(windows) * sh.P * lanes), write_ids(read_ids.size());
  for (int s = 0; s < sh.P; ++s) {
    for (int i = 0; i < sh.K; ++i) perm[i] = i;
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int c = 0; c < windows; ++c)
      for (int64_t i = 0; i < lanes; ++i) {
        read_ids[(static_cast<size_t>(c) * sh.P + s) * lanes + i] = perm[(2 * c) * lanes + i];
        write_ids[(static_cast<size_t>(c) * sh.P + s) * lanes + i] = perm[(2 * c + 1) * lanes + i];
      }
  }
  uint4* bank;
  int32_t *d_read, *d_write;
  float *delta, *out;
  const size_t bank_bytes = static_cast<size_t>(sh.P) * sh.K * sh.D * 2;
  CHECK(cudaMalloc(&bank, bank_bytes));
  CHECK(cudaMemset(bank, 0, bank_bytes));
  CHECK(cudaMalloc(&d_read, sizeof(int32_t) * read_ids.size()));
  CHECK(cudaMalloc(&d_write, sizeof(int32_t) * write_ids.size()));
  CHECK(cudaMemcpy(d_read, read_ids.data(), sizeof(int32_t) * read_ids.size(), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_write, write_ids.data(), sizeof(int32_t) * write_ids.size(), cudaMemcpyHostToDevice));
  const size_t delta_n = static_cast<size_t>(sh.P) * sh.C * sh.D;
  std::vector<float> h_delta(delta_n);
  for (auto& x : h_delta) x = std::uniform_real_distribution<float>(-1.f, 1.f)(rng);
  CHECK(cudaMalloc(&delta, sizeof(float) * delta_n));
  CHECK(cudaMemcpy(delta, h_delta.data(), sizeof(float) * delta_n, cudaMemcpyHostToDevice));
  CHECK(cudaMalloc(&out, sizeof(float) * 2 * sh.P * sh.C * kWarps * 32));
  cudaStream_t stream;
  CHECK(cudaStreamCreate(&stream));
  constexpr int kChunks = 32, kWarm = 4, kRuns = 5;
  std::vector<cudaEvent_t> ev(3 * kChunks);
  for (auto& e : ev) CHECK(cudaEventCreate(&e));

  struct Mode {
    const char* name;
    void (*write)(Shape, uint4*, const int32_t*, const float*);
  };
  const Mode modes[] = {{"plain", write_kernel<false, false>},
                        {"loads", write_kernel<true, false>},
                        {"both", write_kernel<true, true>}};
  std::printf("| write kernel | gather us | write us | chunk us |\n|---|---:|---:|---:|\n");
  int chunk = 0;
  for (const Mode& m : modes) {
    const auto run_chunk = [&](cudaEvent_t* e) {
      const int64_t at = static_cast<int64_t>(chunk++ % windows) * sh.P * lanes;
      if (e) CHECK(cudaEventRecord(e[0], stream));
      gather_kernel<<<dim3(sh.P, sh.C, 2), kWarps * 32, 0, stream>>>(sh, bank, d_read + at, d_write + at, out);
      if (e) CHECK(cudaEventRecord(e[1], stream));
      m.write<<<dim3(sh.P, sh.C), kWarps * 32, 0, stream>>>(sh, bank, d_write + at, delta);
      if (e) CHECK(cudaEventRecord(e[2], stream));
    };
    std::vector<float> gathers, writes;
    for (int r = 0; r < kRuns; ++r) {
      for (int i = 0; i < kWarm; ++i) run_chunk(nullptr);
      for (int i = 0; i < kChunks; ++i) run_chunk(&ev[3 * i]);
      CHECK(cudaStreamSynchronize(stream));
      float g = 0.f, w = 0.f;
      for (int i = 0; i < kChunks; ++i) {
        float a = 0.f, b = 0.f;
        CHECK(cudaEventElapsedTime(&a, ev[3 * i], ev[3 * i + 1]));
        CHECK(cudaEventElapsedTime(&b, ev[3 * i + 1], ev[3 * i + 2]));
        g += a;
        w += b;
      }
      gathers.push_back(g * 1000.f / kChunks);
      writes.push_back(w * 1000.f / kChunks);
    }
    std::sort(gathers.begin(), gathers.end());
    std::sort(writes.begin(), writes.end());
    std::printf("| %s | %.2f | %.2f | %.2f |\n", m.name, gathers[kRuns / 2], writes[kRuns / 2],
                gathers[kRuns / 2] + writes[kRuns / 2]);
  }
  CHECK(cudaGetLastError());
  return 0;
}
