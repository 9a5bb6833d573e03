// The CUDA solve (kernels/solve_cuda.cu, rewritten for the host by transform.py) against the CPU one
// (kernels/solve_cpu.cc) on random units: both sum j ascending with separately rounded multiplies and adds (the CUDA
// kernel is built with -fmad=false), so Minv must agree bitwise. C up to 282 takes the shared-memory kernel
// (solve_panel_kernel) on a device with sm_90's 227 KB per block, C = 283 the global-memory one.
#include "solve_emu.inc"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

using namespace sdm;

namespace {

bool run(int64_t N, int64_t C, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<float> A(N * C * C), beta(N * C);
  for (auto& a : A) a = normal(rng) / std::sqrt(static_cast<float>(C));
  for (auto& b : beta) b = 1.0f / (1.0f + std::exp(-normal(rng)));
  std::vector<float> cpu(N * C * C), cuda(N * C * C, -7.0f);  // poisoned: every cell must be written
  solve_cpu(A.data(), beta.data(), N, C, cpu.data());
  const int rc = solve_cuda(A.data(), beta.data(), N, C, cuda.data(), nullptr);
  const bool ok = rc == 0 && std::memcmp(cpu.data(), cuda.data(), cpu.size() * sizeof(float)) == 0;
  std::printf("%s N%lld C%lld rc=%d\n", ok ? "ok  " : "FAIL", (long long)N, (long long)C, rc);
  return ok;
}

}  // namespace

int main() {
  int failing = 0;
  unsigned seed = 1;
  const int64_t cases[][2] = {{3, 1}, {2, 5}, {4, 17}, {3, 64}, {2, 128}, {2, 33}, {1, 100}, {2, 256}, {1, 282}, {1, 283}};  // {N, C}
  for (const auto& c : cases) failing += !run(c[0], c[1], seed++);
  std::printf("%d failing cases\n", failing);
  return failing != 0;
}
