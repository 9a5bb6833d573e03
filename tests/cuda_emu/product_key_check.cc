// The CUDA product-key top-k (kernels/product_key_topk_cuda.cu, rewritten for the host by transform.py) against the
// CPU kernels (kernels/product_key_topk_cpu.cc), bitwise, forward and backward: one to three factors, float32 and
// bfloat16 scores, continuous and tied values (small integers, all equal, NaN, infinities of one sign, signed
// zeros), lists that take each of the CUDA kernel's key paths (registers up to 256 and up to 1024 elements,
// recomputed beyond) and both selection routes (prefiltered; the threshold search where m > 32 or too many keys
// tie), both composite widths for bfloat16 scores (narrow below 65535 entries a factor, wide from there), both
// launch forms (a block per row for a few rows of 2 to 8 factors; a thread per row for many rows of two short
// bfloat16 factors, k <= 64, in both instances (top lists of 32 and of 64), with its rows of infinities of both
// signs; else a warp per row, in each of its three instances by the longest list kept in registers: 256, 512,
// 1024), row counts that leave a block's last warps idle, and backward rows of several tiles; the backward also
// with ids outside [0, slots) and cotangents of -0.
#include "product_key_emu.inc"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#include "candidate_table.h"
#include "check_values.h"
#include "kernels/bf16.h"

using namespace sdm;
using emu_check::candidate_table;

namespace {


enum Kind { kNormal, kInts, kEqual, kSpecial, kInfinities };
const char* kKindNames[] = {"normal", "ints", "equal", "special", "infinities"};

template <typename T>
bool run(int64_t rows, const std::vector<int64_t>& factors, int64_t k, Kind kind, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  const float special[] = {NAN, -INFINITY, -0.0f, 0.0f, 1.0f, -1.0f, 2.5f};
  const float infinities[] = {INFINITY, -INFINITY, NAN, -0.0f, 0.0f, 1.0f, -1.0f, 0.5f};
  int64_t C = 0;
  const std::vector<int32_t> table = factors.size() > 1 ? candidate_table(factors, k, &C) : [&] {
    std::vector<int32_t> r(k);
    for (int64_t i = 0; i < k; ++i) r[i] = static_cast<int32_t>(i);
    C = k;
    return r;
  }();
  const ProductKeyDims d = product_key_dims(rows, factors.data(), static_cast<int>(factors.size()), k, C);
  std::vector<T> x(rows * d.width);
  for (auto& v : x) {
    const float f = kind == kNormal ? normal(rng)
                    : kind == kInts ? static_cast<float>(static_cast<int>(rng() % 5) - 2)
                    : kind == kEqual   ? 0.75f
                    : kind == kSpecial ? special[rng() % 7]
                                       : infinities[rng() % 8];
    v = value<T>(f);
  }
  std::vector<float> s_cpu(rows * k), s_cuda(rows * k, -7.0f), ds(rows * k);
  std::vector<int32_t> i_cpu(rows * k), i_cuda(rows * k, -7);
  product_key_topk_cpu<T>(d, x.data(), table.data(), s_cpu.data(), i_cpu.data());
  const int rc = product_key_topk_cuda<T>(d, x.data(), table.data(), s_cuda.data(), i_cuda.data(), nullptr);
  for (auto& v : ds) v = normal(rng);
  // The backward's ids: the forward's, and for two kinds some changed: ids outside [0, slots), which contribute
  // nothing, and cotangents of -0 (a sum from +0 gives +0).
  std::vector<int32_t> i_bwd = i_cpu;
  for (size_t t = 3; t < i_bwd.size() && kind == kInts; t += 7)
    i_bwd[t] = t % 2 ? -1 - static_cast<int32_t>(t % 5)
                     : static_cast<int32_t>(std::min<int64_t>(d.slots + t % 5, 0x7fffffff));
  for (size_t t = 2; t < ds.size() && kind == kSpecial; t += 5) ds[t] = -0.0f;
  std::vector<T> dx_cpu(rows * d.width), dx_cuda(rows * d.width, value<T>(-7.0f));
  product_key_topk_bwd_cpu<T>(d, ds.data(), i_bwd.data(), dx_cpu.data());
  const int rc_bwd = product_key_topk_bwd_cuda<T>(d, ds.data(), i_bwd.data(), dx_cuda.data(), nullptr);
  const bool fwd = same_bits(s_cpu, s_cuda) && same_bits(i_cpu, i_cuda);
  const bool bwd = same_bits(dx_cpu, dx_cuda);
  const bool ok = rc == 0 && rc_bwd == 0 && fwd && bwd;
  std::printf("%s rows %lld factors (", ok ? "ok  " : "FAIL", static_cast<long long>(rows));
  for (size_t f = 0; f < factors.size(); ++f) std::printf("%s%lld", f ? ", " : "", static_cast<long long>(factors[f]));
  std::printf(") k %lld C %lld %s %s rc %d/%d%s%s\n", static_cast<long long>(k), static_cast<long long>(C),
              std::is_same_v<T, float> ? "f32" : "bf16", kKindNames[kind], rc, rc_bwd, fwd ? "" : " forward differs",
              bwd ? "" : " backward differs");
  return ok;
}

struct Case {
  int64_t rows;
  std::vector<int64_t> factors;
  int64_t k;
  unsigned kinds = 0xf;  // the value kinds to run, bit `kind` (a case of many rows takes long to emulate;
                         // infinities of both signs only where the thread-per-row kernel runs)
  bool bf16_only = false;  // a case of the thread-per-row kernel, which float32 scores do not take
};

}  // namespace

int main() {
  const Case cases[] = {
      {6, {256, 256}, 64},   // the layer's shape; C = 280 in registers
      {5, {128, 128}, 32},   // C = 119
      {3, {64, 32, 32}, 64}, // C = 732: the 1024-element register path
      {2, {3, 5, 7}, 105},   // k = prod(factors): every list taken whole
      {4, {8, 512}, 64},     // k > n_1; n_2 in the 1024-element path
      {3, {300}, 64},        // one factor
      {2, {1500}, 200},      // one factor past 1024: keys recomputed on every pass
      {2, {256, 256}, 256},  // C = 1466: candidates recomputed on every pass
      {1, {1500, 1500}, 64}, // a backward row of two tiles
      {3, {4, 1, 6}, 10},    // a factor of one entry
      {9, {16, 16}, 1},      // k = 1; three blocks, the last with one row
      {5, {1024, 1024}, 16}, // a decode step at K = 2^20: prefiltered factors (32 keys a lane) and candidates
      {3, {64, 64}, 16},     // a decode step at K = 2^12
      {3, {40, 70}, 20},     // prefiltered with lanes of no element (n = 40) and m in (16, 32]
      {515, {12, 20}, 8, 0x1},  // more rows than the block-per-row kernel takes: a warp per row
      {2, {4, 4, 4, 4, 4, 4, 4, 4}, 600, 0x1},  // eight sort buffers of 1024 exceed shared memory: a warp per row
      {520, {128, 128}, 32, 0x1f},  // the layer's many rows (config b): float32 by the warp-per-row kernel of
                                    // 256-element keys, bfloat16 by the thread-per-row kernel (both merge routes)
      {520, {40, 72}, 20, 0x1f},    // a thread a row: chunks cut short (one lane of a loading pair out of the
                                    // factor), m in (16, 32]
      {530, {3, 5}, 15, 0x1f},      // a thread a row: k = prod(factors), every list taken whole; scalar loads
                                    // and stores
      {515, {256, 16}, 1, 0x3},     // a thread a row: k = 1, the largest factor it takes; an odd row count (the
                                    // last row loaded for its pair's idle lane)
      {520, {256, 256}, 64, 0x3},   // config a: C = 280; float32 by the warp-per-row kernel of 512-element keys,
                                    // bfloat16 by the thread-per-row kernel's instance of top lists of 64
      {530, {100, 37}, 50, 0x13, true},   // a thread a row, lists of 64: s = 7 row and column lists, m_1 = 37 < k
      {520, {256, 5}, 64, 0x11, true},    // a thread a row: m_1 = 5 < s = 8, the columns cut at m_1
      {515, {7, 9}, 63, 0x11, true},      // a thread a row: k = prod(factors) = 63, every list taken whole
      {515, {33, 64}, 33, 0x1, true},     // a thread a row: k = 33, the smallest k of the lists of 64
      {2, {65534}, 16, 0x3},        // the largest factor of narrow composites (16-bit scores)
      {2, {65535}, 16, 0x3},        // the smallest of wide ones
  };
  int failing = 0;
  unsigned seed = 1;
  for (const Case& c : cases) {
    for (int kind = 0; kind < 5; ++kind) {
      if (!(c.kinds >> kind & 1u)) continue;
      if (!c.bf16_only) failing += !run<float>(c.rows, c.factors, c.k, static_cast<Kind>(kind), seed);
      ++seed;
      failing += !run<bf16>(c.rows, c.factors, c.k, static_cast<Kind>(kind), seed++);
    }
  }
  std::printf("%d failing cases\n", failing);
  return failing != 0;
}
