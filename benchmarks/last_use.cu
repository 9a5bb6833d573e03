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
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "chunk_probe.cuh"

using probe::Shape;

int main(int argc, char** argv) {
  const probe::Problem pb = probe::make_problem(argc, argv);
  const Shape& sh = pb.sh;
  cudaStream_t stream;
  CHECK(cudaStreamCreate(&stream));
  constexpr int kChunks = 32, kWarm = 4, kRuns = 5;
  std::vector<cudaEvent_t> ev(3 * kChunks);
  for (auto& e : ev) CHECK(cudaEventCreate(&e));

  struct Mode {
    const char* name;
    void (*write)(Shape, uint4*, const int32_t*, const float*);
  };
  const Mode modes[] = {{"plain", probe::write_kernel<false, false>},
                        {"loads", probe::write_kernel<true, false>},
                        {"both", probe::write_kernel<true, true>}};
  std::printf("| write kernel | gather us | write us | chunk us |\n|---|---:|---:|---:|\n");
  int chunk = 0;
  for (const Mode& m : modes) {
    const auto run_chunk = [&](cudaEvent_t* e) {
      const int c = chunk++;
      if (e) CHECK(cudaEventRecord(e[0], stream));
      probe::gather_kernel<<<dim3(sh.P, sh.C, 2), probe::kRowWarps * 32, 0, stream>>>(sh, pb.bank, pb.read_at(c),
                                                                                       pb.write_at(c), pb.out);
      if (e) CHECK(cudaEventRecord(e[1], stream));
      m.write<<<dim3(sh.P, sh.C), probe::kRowWarps * 32, 0, stream>>>(sh, pb.bank, pb.write_at(c), pb.delta);
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
