// What a change of the SM's shared-memory carveout costs between kernels, at the chunk loop's pattern: a row
// kernel (little shared memory, one warp per 4 KB row, random rows that miss the L2, as the gathers) followed by a
// staged kernel (one block an SM with most of the SM's shared memory, as the in-loop apply-inverse kernels), both
// with programmatic dependent launch as the chunk steps launch them. An SM changes how it splits its L1 and shared
// memory only when idle, so if the two kernels run with different splits each boundary may drain the SM.
//
// For each carveout preference given to both kernels (`default`: none set, the driver picks per kernel; `max`:
// cudaSharedmemCarveoutMaxShared on both; `split`: the row kernel max L1, the staged kernel max shared), it times
// launches of the row kernel alone, the staged kernel alone and the pair in turn, and prints the pair's time minus
// the two alone: what the boundaries cost. It launches as the chunk steps do (kernels/chunk_steps/launch.cuh); on
// the GPU machine, from the repository's root:
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -I. benchmarks/carveout.cu -o /tmp/carveout && /tmp/carveout [rows smem_kb]
//
// Times: CUDA events around 50 launches (or pairs) after 5 warm-up ones, the median of 5 such runs.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "chunk_probe.cuh"

namespace {

constexpr int kD = 2048;            // bfloat16 columns a row (4 KB), the paper shape's
constexpr int kK = 262144;          // rows of the bank (1 GiB): a launch's rows miss the L2

// One warp a row: each lane reads its 16-byte segments and the warp writes the row's sum (so no load is dropped).
__global__ void __launch_bounds__(256) row_kernel(const uint4* __restrict__ bank, const int32_t* __restrict__ rows,
                                                  int n, float* __restrict__ out) {
  sdm::chain_start();
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
  if (warp >= n) return;
  const uint4* row = bank + static_cast<int64_t>(rows[warp]) * (kD / 8);
  uint4 v[kD / 8 / 32];
#pragma unroll
  for (int i = 0; i < kD / 8 / 32; ++i) v[i] = row[lane + 32 * i];
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < kD / 8 / 32; ++i) s += probe::sum8(v[i]);
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  if (lane == 0) out[warp] = s;
}

}  // namespace

int main(int argc, char** argv) {
  const int rows = argc > 1 ? std::atoi(argv[1]) : 16384;  // a chunk's gather rows (one stream of the paper shape)
  const int smem_kb = argc > 2 ? std::atoi(argv[2]) : 217;
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const size_t smem = static_cast<size_t>(smem_kb) * 1024;
  const int floats = static_cast<int>(smem / sizeof(float)) / 4 * 4;
  std::printf("%s, %d SMs; row kernel %d rows of %d bytes a launch, staged kernel %d KB of shared memory a block\n",
              prop.name, sms, rows, kD * 2, smem_kb);

  // Every row once, in random order; each launch takes the next window of `rows`.
  std::vector<int32_t> table(kK);
  for (int i = 0; i < kK; ++i) table[i] = i;
  std::shuffle(table.begin(), table.end(), std::mt19937(7));
  uint4* bank;
  int32_t* d_table;
  float *src, *out_rows, *out_staged;
  CHECK(cudaMalloc(&bank, static_cast<size_t>(kK) * kD * 2));
  CHECK(cudaMemset(bank, 0, static_cast<size_t>(kK) * kD * 2));
  CHECK(cudaMalloc(&d_table, sizeof(int32_t) * kK));
  CHECK(cudaMemcpy(d_table, table.data(), sizeof(int32_t) * kK, cudaMemcpyHostToDevice));
  CHECK(cudaMalloc(&src, sizeof(float) * static_cast<size_t>(floats) * sms));
  CHECK(cudaMemset(src, 0, sizeof(float) * static_cast<size_t>(floats) * sms));
  CHECK(cudaMalloc(&out_rows, sizeof(float) * rows));
  CHECK(cudaMalloc(&out_staged, sizeof(float) * probe::kStagedThreads * sms));
  CHECK(cudaFuncSetAttribute(probe::staged_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(smem)));
  cudaStream_t stream;
  CHECK(cudaStreamCreate(&stream));

  const int windows = kK / rows;
  auto rows_launch = [&](int call) {
    CHECK(static_cast<cudaError_t>(sdm::launch(true, row_kernel, (rows * 32 + 255) / 256, 256, 0, stream,
                                               static_cast<const uint4*>(bank),
                                               static_cast<const int32_t*>(d_table + (call % windows) * rows),
                                               rows, out_rows)));
  };
  auto staged_launch = [&](int) {
    CHECK(static_cast<cudaError_t>(sdm::launch(true, probe::staged_kernel, sms, probe::kStagedThreads, smem, stream,
                                               reinterpret_cast<const float4*>(src), floats, out_staged)));
  };
  struct Mode {
    const char* name;
    int rows_pref, staged_pref;
  };
  const Mode modes[] = {{"default", cudaSharedmemCarveoutDefault, cudaSharedmemCarveoutDefault},
                        {"max", cudaSharedmemCarveoutMaxShared, cudaSharedmemCarveoutMaxShared},
                        {"split", cudaSharedmemCarveoutMaxL1, cudaSharedmemCarveoutMaxShared}};
  std::printf("| carveout | row kernel us | staged kernel us | pair us | pair - both alone us |\n");
  std::printf("|---|---:|---:|---:|---:|\n");
  for (const Mode& m : modes) {
    // Each mode sets both attributes: cudaSharedmemCarveoutDefault gives the choice back to the driver.
    CHECK(cudaFuncSetAttribute(row_kernel, cudaFuncAttributePreferredSharedMemoryCarveout, m.rows_pref));
    CHECK(cudaFuncSetAttribute(probe::staged_kernel, cudaFuncAttributePreferredSharedMemoryCarveout, m.staged_pref));
    const float t_rows = probe::time_us(stream, 50, rows_launch);
    const float t_staged = probe::time_us(stream, 50, staged_launch);
    const float t_pair = probe::time_us(stream, 50, [&](int call) {
      rows_launch(call);
      staged_launch(call);
    });
    std::printf("| %s | %.2f | %.2f | %.2f | %.2f |\n", m.name, t_rows, t_staged, t_pair, t_pair - t_rows - t_staged);
  }
  CHECK(cudaGetLastError());
  return 0;
}
