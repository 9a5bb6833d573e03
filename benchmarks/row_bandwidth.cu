// Random-row bandwidth of this GPU at the access pattern of the chunk steps' row kernels: one warp per bank row
// (D bfloat16 columns, 16 bytes per lane and segment), rows picked at random from a bank of K rows per stream, P
// streams. It measures what a row kernel can reach at best, for each kind of access the steps make:
//
//   read    a warp reads its rows                        (the gathers)
//   write   a warp writes its rows                       (stores only)
//   rmw     a warp reads its rows and writes them back    (the forward write)
//   rmw2    two rows per group: both read, both written   (Phase A: gradient row and bank row)
//   copy    cudaMemcpyAsync of the whole bank             (the sequential ceiling)
//
// for several warps per block, blocks per SM and rows in flight per warp. GB/s counts the bytes a kernel moves
// (reads + writes). Standalone (no jax_sdm code): build and run on the GPU machine with
//
//   nvcc -O3 -std=c++17 -arch=sm_90 benchmarks/row_bandwidth.cu -o /tmp/row_bandwidth && /tmp/row_bandwidth [D K P rows]
//
// Times: CUDA events around 20 launches after 3 warm-up launches, the median of 5 such runs. `rows` per launch
// (default 16384: one chunk of the flagship's groups) are a window of a table that holds every row of the bank once,
// in random order; successive launches take successive windows, so none finds its rows in the L2 (with one fixed
// window, 32 MiB, every launch after the first hit the L2 and "read" 5.5 TB/s).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "cuda_check.h"

enum Mode { kRead, kWrite, kRmw, kRmw2 };

// Rows `rows[i]` (bank row index, over all streams) for i in the warp's share, kInFlight of them loaded before the
// first is used. Each lane moves 16 bytes per segment, segments 512 bytes apart (a 2 KB row is 4 segments).
template <Mode kMode, int kInFlight>
__global__ void rows_kernel(uint4* bank, uint4* bank2, const int32_t* rows, int64_t n_rows, int row_vecs,
                            float* sink) {
  const int lane = threadIdx.x % 32;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  const int segs = row_vecs / 32;  // 16-byte vectors per lane and row
  float acc = 0.f;
  for (int64_t base = warp * kInFlight; base < n_rows; base += warps * kInFlight) {
    for (int s0 = 0; s0 < segs; s0 += 4) {  // at most 4 segments of each row at once
      uint4 x[kInFlight][4], y[kInFlight][4];
      // body(j, k, at) for segment k of the warp's row j at vector index `at`, rows and segments that exist only
      const auto each = [&](auto body) {
#pragma unroll
        for (int j = 0; j < kInFlight; ++j) {
          if (base + j >= n_rows) break;
          const int64_t r = rows[base + j];
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            if (s0 + k >= segs) break;
            body(j, k, r * row_vecs + (s0 + k) * 32 + lane);
          }
        }
      };
      each([&](int j, int k, int64_t at) {  // all loads first
        if (kMode != kWrite) x[j][k] = bank[at];
        if (kMode == kRmw2) y[j][k] = bank2[at];
      });
      each([&](int j, int k, int64_t at) {
        if (kMode == kRead) {
          acc += __uint_as_float(x[j][k].x ^ x[j][k].w);
        } else if (kMode == kWrite) {
          bank[at] = make_uint4(lane, j, k, 7);
        } else {
          x[j][k].x ^= 1u;
          bank[at] = x[j][k];
          if (kMode == kRmw2) {
            y[j][k].y ^= 1u;
            bank2[at] = y[j][k];
          }
        }
      });
    }
  }
  if (kMode == kRead && acc == 1.2345f) sink[0] = acc;  // keeps the loads
}

template <Mode kMode, int kInFlight>
float time_rows(uint4* bank, uint4* bank2, const int32_t* rows, int64_t windows, int64_t n_rows, int row_vecs,
                float* sink, int blocks, int threads) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  std::vector<float> ms;
  // Launch i reads window i % windows of the row table: no launch finds the rows of the one before in the L2.
  const auto window = [&](int i) { return rows + (i % windows) * n_rows; };
  for (int i = 0; i < 3; ++i)
    rows_kernel<kMode, kInFlight><<<blocks, threads>>>(bank, bank2, window(i), n_rows, row_vecs, sink);
  CHECK(cudaGetLastError());
  for (int run = 0; run < 5; ++run) {
    CHECK(cudaEventRecord(a));
    for (int i = 0; i < 20; ++i)
      rows_kernel<kMode, kInFlight><<<blocks, threads>>>(bank, bank2, window(i), n_rows, row_vecs, sink);
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float t = 0.f;
    CHECK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t / 20);
  }
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

int main(int argc, char** argv) {
  const int64_t D = argc > 1 ? std::atoll(argv[1]) : 1024;
  const int64_t K = argc > 2 ? std::atoll(argv[2]) : 65536;
  const int64_t P = argc > 3 ? std::atoll(argv[3]) : 4;
  const int64_t n_rows = argc > 4 ? std::atoll(argv[4]) : 16384;  // one chunk of the flagship: P * C * W groups
  const int row_vecs = static_cast<int>(D * 2 / 16);
  if (D * 2 % 512 != 0) {
    std::fprintf(stderr, "D * 2 bytes must be a multiple of 512 (whole 16-byte segments for 32 lanes)\n");
    return 2;
  }
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const int64_t bank_bytes = P * K * D * 2;
  uint4 *bank, *bank2, *copy;
  int32_t* rows;
  float* sink;
  CHECK(cudaMalloc(&bank, bank_bytes));
  CHECK(cudaMalloc(&bank2, bank_bytes));
  CHECK(cudaMalloc(&copy, bank_bytes));
  // Windows of n_rows rows over every row of the bank once (at least one window).
  const int64_t windows = std::max<int64_t>(1, P * K / n_rows), table = windows * n_rows;
  CHECK(cudaMalloc(&rows, table * sizeof(int32_t)));
  CHECK(cudaMalloc(&sink, sizeof(float)));
  CHECK(cudaMemset(bank, 1, bank_bytes));
  CHECK(cudaMemset(bank2, 2, bank_bytes));
  // Distinct random rows, each stream's share in its own K rows (as a chunk's groups: distinct slots per stream).
  std::mt19937_64 rng(1);
  std::vector<int32_t> host(table);
  std::vector<int32_t> perm(K);
  for (int64_t p = 0; p < P; ++p) {
    for (int64_t k = 0; k < K; ++k) perm[k] = static_cast<int32_t>(k);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int64_t i = p; i < table; i += P) host[i] = static_cast<int32_t>(p * K + perm[(i / P) % K]);
  }
  CHECK(cudaMemcpy(rows, host.data(), table * sizeof(int32_t), cudaMemcpyHostToDevice));

  std::printf("%s, %d SMs; bank %lld x %lld x %lld bf16 (%.0f MiB), %lld random rows of %lld bytes per launch, "
              "%lld windows\n",
              prop.name, prop.multiProcessorCount, static_cast<long long>(P), static_cast<long long>(K),
              static_cast<long long>(D), bank_bytes / 1048576.0, static_cast<long long>(n_rows),
              static_cast<long long>(D * 2), static_cast<long long>(windows));
  {
    cudaEvent_t a, b;
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));
    CHECK(cudaMemcpy(copy, bank, bank_bytes, cudaMemcpyDeviceToDevice));
    CHECK(cudaEventRecord(a));
    for (int i = 0; i < 10; ++i) CHECK(cudaMemcpyAsync(copy, bank, bank_bytes, cudaMemcpyDeviceToDevice));
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float t = 0.f;
    CHECK(cudaEventElapsedTime(&t, a, b));
    std::printf("copy: %.3f ms, %.0f GB/s (read + write)\n\n", t / 10, 2.0 * bank_bytes / (t / 10 * 1e-3) / 1e9);
  }
  std::printf("| mode | warps/block | blocks/SM launched | resident | rows in flight/warp | us | GB/s |\n"
              "|---|---:|---:|---:|---:|---:|---:|\n");
  const double row_bytes = static_cast<double>(D) * 2 * n_rows;
  const auto report = [&](const char* mode, double moved, int warps, int per_sm, int resident, int in_flight,
                          float ms) {
    std::printf("| %s | %d | %d | %d | %d | %.1f | %.0f |\n", mode, warps, per_sm, resident, in_flight, ms * 1e3,
                moved / (ms * 1e-3) / 1e9);
  };
  // Blocks of `threads` threads of a kernel that fit on one SM at once (registers, threads).
  const auto resident = [](auto kernel, int threads) {
    int n = 0;
    CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, 0));
    return n;
  };
  for (int warps : {8, 16}) {
    for (int per_sm : {1, 2, 4}) {
      const int blocks = prop.multiProcessorCount * per_sm, threads = warps * 32;
#define RUN(MODE, NAME, MOVED, F)                                                                           \
  report(NAME, (MOVED) * row_bytes, warps, per_sm, resident(rows_kernel<MODE, F>, threads), F,              \
         time_rows<MODE, F>(bank, bank2, rows, windows, n_rows, row_vecs, sink, blocks, threads))
      RUN(kRead, "read", 1, 1);
      RUN(kRead, "read", 1, 2);
      RUN(kRead, "read", 1, 4);
      RUN(kWrite, "write", 1, 1);
      RUN(kWrite, "write", 1, 2);
      RUN(kRmw, "rmw", 2, 1);
      RUN(kRmw, "rmw", 2, 2);
      RUN(kRmw, "rmw", 2, 4);
      RUN(kRmw2, "rmw2", 4, 1);
      RUN(kRmw2, "rmw2", 4, 2);
#undef RUN
    }
  }
  CHECK(cudaFree(bank));
  CHECK(cudaFree(bank2));
  CHECK(cudaFree(copy));
  CHECK(cudaFree(rows));
  CHECK(cudaFree(sink));
  return 0;
}
