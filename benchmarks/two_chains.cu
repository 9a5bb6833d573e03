// Whether the chunk loop gains from running each stream's chain of kernels on a CUDA stream of its own. The loop is
// a chain per chunk, gather -> apply-inverse -> write, each kernel waiting for the one before (programmatic
// dependent launch), and every boundary drains the GPU: the carveout probe puts a row kernel -> staged kernel
// boundary at about 6 us on an H100, a chunk has three. The P streams of a call do not depend on one another, so
// with one CUDA stream a chain (each kernel a P-th of the grid) one chain's drain could be filled by another's work.
//
// It runs `chunks` chunks of the paper's pattern (chunk_probe.cuh: the gather of both sides, a staged kernel of
// P * D / 32 blocks with 217 KB of shared memory as fwd_apply_inverse_kernel's grid, the write with last-use loads
// and stores) as one chain over all P streams, and as P chains on P CUDA streams forked from and joined to the
// first, and prints the time a chunk of each, beside each kernel's time alone. On the GPU machine, from the
// repository's root:
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -I. benchmarks/two_chains.cu -o /tmp/two_chains && /tmp/two_chains [P C D K W]
//
// Times: CUDA events around a loop of 32 chunks (or 50 launches of a kernel alone) after 5 warm-up ones, the
// median of 5 such runs.
#include <cuda_runtime.h>

#include <cstdio>
#include <vector>

#include "chunk_probe.cuh"

namespace {

constexpr int kSliceCols = 32;         // columns a block of the apply-inverse kernels (kernels/chunk_steps/dense.cuh)
constexpr int kStagedBytes = 217 * 1024;  // their shared memory at C 128 on an H100 or H200

}  // namespace

int main(int argc, char** argv) {
  const probe::Problem pb = probe::make_problem(argc, argv);
  const probe::Shape& sh = pb.sh;
  const int slices = sh.D / kSliceCols;  // staged blocks a stream
  const int floats = kStagedBytes / 4 / 4 * 4;
  float *src, *staged_out;
  CHECK(cudaMalloc(&src, sizeof(float) * floats * sh.P * slices));
  CHECK(cudaMemset(src, 0, sizeof(float) * floats * sh.P * slices));
  CHECK(cudaMalloc(&staged_out, sizeof(float) * probe::kStagedThreads * sh.P * slices));
  CHECK(cudaFuncSetAttribute(probe::staged_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kStagedBytes));
  std::vector<cudaStream_t> streams(sh.P);
  for (auto& s : streams) CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t fork;  // streams[0] forks the others, each joins it back with its own event
  CHECK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  std::vector<cudaEvent_t> join(sh.P);
  for (auto& e : join) CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  const auto ok = [](int rc) { CHECK(static_cast<cudaError_t>(rc)); };
  const auto write = probe::write_kernel<true, true>;
  const int threads = probe::kRowWarps * 32;

  // Streams [s0, s0 + n) of chunk c on `stream`: the three kernels, each a chain link.
  const auto chunk = [&](cudaStream_t stream, int c, int s0, int n) {
    probe::Shape part = sh;
    part.P = n;
    const float4* staged_src = reinterpret_cast<const float4*>(src) + static_cast<int64_t>(s0) * slices * floats / 4;
    // Outputs apart for each chain (the gather's are [side, token, stream] blocks).
    float* gather_out = pb.out + static_cast<int64_t>(s0) * 2 * sh.C * threads;
    ok(sdm::launch(true, probe::gather_kernel, dim3(n, sh.C, 2), threads, 0, stream, part,
                   static_cast<const uint4*>(pb.bank_at(s0)), pb.read_at(c, s0), pb.write_at(c, s0), gather_out));
    ok(sdm::launch(true, probe::staged_kernel, n * slices, probe::kStagedThreads, kStagedBytes, stream, staged_src,
                   floats, staged_out + static_cast<int64_t>(s0) * slices * probe::kStagedThreads));
    ok(sdm::launch(true, write, dim3(n, sh.C), threads, 0, stream, part, pb.bank_at(s0), pb.write_at(c, s0),
                   static_cast<const float*>(pb.delta + static_cast<int64_t>(s0) * sh.C * sh.D)));
  };
  constexpr int kLoop = 32;
  int next = 0;
  const float one = probe::time_us(streams[0], 1, [&](int) {
    for (int i = 0; i < kLoop; ++i) chunk(streams[0], next++, 0, sh.P);
  });
  const float several = probe::time_us(streams[0], 1, [&](int) {
    CHECK(cudaEventRecord(fork, streams[0]));
    for (int s = 1; s < sh.P; ++s) CHECK(cudaStreamWaitEvent(streams[s], fork));
    for (int i = 0; i < kLoop; ++i, ++next)
      for (int s = 0; s < sh.P; ++s) chunk(streams[s], next, s, 1);
    for (int s = 1; s < sh.P; ++s) {
      CHECK(cudaEventRecord(join[s], streams[s]));
      CHECK(cudaStreamWaitEvent(streams[0], join[s]));
    }
  });
  // Each kernel alone, over all P streams.
  const float gather = probe::time_us(streams[0], 50, [&](int c) {
    ok(sdm::launch(true, probe::gather_kernel, dim3(sh.P, sh.C, 2), threads, 0, streams[0], sh,
                   static_cast<const uint4*>(pb.bank), pb.read_at(c), pb.write_at(c), pb.out));
  });
  const float staged = probe::time_us(streams[0], 50, [&](int) {
    ok(sdm::launch(true, probe::staged_kernel, sh.P * slices, probe::kStagedThreads, kStagedBytes, streams[0],
                   reinterpret_cast<const float4*>(src), floats, staged_out));
  });
  const float written = probe::time_us(streams[0], 50, [&](int c) {
    ok(sdm::launch(true, write, dim3(sh.P, sh.C), threads, 0, streams[0], sh, pb.bank, pb.write_at(c),
                   static_cast<const float*>(pb.delta)));
  });
  CHECK(cudaGetLastError());
  std::printf("| chains | us a chunk | over the kernels alone (gather %.2f + staged %.2f + write %.2f us) |\n",
              gather, staged, written);
  std::printf("|---|---:|---:|\n");
  std::printf("| one | %.2f | %.2f |\n", one / kLoop, one / kLoop - gather - staged - written);
  std::printf("| %d | %.2f | %.2f |\n", sh.P, several / kLoop, several / kLoop - gather - staged - written);
  return 0;
}
