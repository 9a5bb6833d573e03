// The CUDA decode step (kernels/decode_step_cuda.cu, rewritten for the host by transform.py) against the CPU one
// (kernels/decode_step_cpu.cc) on random tokens: float32 and bfloat16 banks, per-token and per-write gates,
// repeated and out-of-range slot ids, and widths D that leave a partial column tile. Both round every multiply and
// add separately (the CUDA kernel is built with -fmad=false), so the readings and the bank must agree bitwise.
#include "decode_emu.inc"

#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "check_values.h"
#include "kernels/bf16.h"

using namespace sdm;

namespace {

template <typename T>
bool run(const DecodeDims& dm, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int32_t> slot(-2, static_cast<int32_t>(dm.K) + 1);  // some out of range
  std::uniform_int_distribution<int32_t> in_range(0, static_cast<int32_t>(dm.K) - 1);
  const int64_t S = dm.S, W = dm.W, R = dm.R, D = dm.D;
  std::vector<int32_t> k_idx(S * W), q_idx(S * R);
  for (auto& i : k_idx) i = rng() % 4 == 0 ? slot(rng) : in_range(rng);
  for (int64_t s = 0; s < S; ++s)  // reads of written rows, repeats within a token
    for (int64_t m = 0; m < R; ++m) q_idx[s * R + m] = rng() % 2 ? k_idx[s * W + rng() % W] : slot(rng);
  std::vector<T> k_val(S * W), v(S * D), q_val(S * R), bank(S * dm.K * D);
  for (auto& x : k_val) x = value<T>(normal(rng));
  for (auto& x : v) x = value<T>(normal(rng));
  for (auto& x : q_val) x = value<T>(normal(rng));
  for (auto& x : bank) x = value<T>(0.1f * normal(rng));
  std::vector<float> x(dm.per_write_gates ? S * W : S), beta(S);
  for (auto& g : x) g = -0.5f * std::log1p(std::exp(normal(rng)));
  for (auto& b : beta) b = 1.0f / (1.0f + std::exp(-normal(rng)));
  std::vector<T> y_cpu(S * D), y_cuda(S * D, value<T>(-7.0f)), bank_cpu = bank, bank_cuda = bank;
  decode_step_cpu<T>(dm, DecodeToken<T>{k_idx.data(), k_val.data(), x.data(), v.data(), beta.data(), q_idx.data(),
                                        q_val.data(), y_cpu.data()}, bank_cpu.data());
  const int rc = decode_step_cuda<T>(dm, DecodeToken<T>{k_idx.data(), k_val.data(), x.data(), v.data(), beta.data(),
                                                        q_idx.data(), q_val.data(), y_cuda.data()},
                                     bank_cuda.data(), nullptr);
  const bool ok = rc == 0 && same_bits(y_cpu, y_cuda) && same_bits(bank_cpu, bank_cuda);
  std::printf("%s S%lld K%lld D%lld W%lld R%lld %s gates=%s rc=%d\n", ok ? "ok  " : "FAIL", (long long)S,
              (long long)dm.K, (long long)D, (long long)W, (long long)R, std::is_same_v<T, float> ? "f32" : "bf16",
              dm.per_write_gates ? "write" : "token", rc);
  return ok;
}

}  // namespace

int main() {
  int failing = 0;
  unsigned seed = 1;
  // {S, K, D, W, R, per-write gates}
  const DecodeDims cases[] = {{3, 16, 8, 4, 4, false},   {2, 64, 40, 16, 16, true}, {4, 8, 130, 9, 3, false},
                              {1, 300, 33, 20, 12, true}, {2, 5, 16, 1, 1, false},  {1, 1000, 64, 64, 64, false}};
  for (const DecodeDims& dm : cases) {
    failing += !run<float>(dm, seed++);
    failing += !run<bf16>(dm, seed++);
  }
  std::printf("%d failing cases\n", failing);
  return failing != 0;
}
