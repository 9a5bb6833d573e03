// The fused decode step on the CPU (kernels/decode_step.h): streams in parallel blocks, each stream's token in
// lane order over whole rows. Compiled with -ffp-contract=off (no fused multiply-add), like the other CPU kernels.
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/bf16.h"
#include "kernels/decode_step.h"
#include "kernels/parallel.h"

namespace sdm {

template <typename BankT>
void decode_step_cpu(const DecodeDims& dm, const DecodeToken<BankT>& tok, BankT* bank) {
  const int64_t K = dm.K, D = dm.D, W = dm.W, R = dm.R;
  // Threads only pay off when a block of streams is much more work than starting a thread.
  const int64_t per_stream = (W + R + 2) * D;
  parallel_blocks(dm.S, std::max<int64_t>(1, (int64_t{1} << 20) / per_stream), [&](int64_t begin, int64_t end) {
    std::vector<int32_t> first(static_cast<size_t>(W)), read_lane(static_cast<size_t>(R));
    std::vector<float> cur(static_cast<size_t>(W * D)), delta(static_cast<size_t>(D)),
        reading(static_cast<size_t>(D));
    for (int64_t s = begin; s < end; ++s) {
      const int32_t* k_idx = tok.k_idx + s * W;
      const int32_t* q_idx = tok.q_idx + s * R;
      const BankT* k_val = tok.k_val + s * W;
      const BankT* q_val = tok.q_val + s * R;
      const float* x = tok.x + (dm.per_write_gates ? s * W : s);
      BankT* rows = bank + s * K * D;
      // The rows are scattered over a bank far larger than the caches: ask for all of them at once, so that their
      // cache misses overlap instead of following one another.
      for (const int32_t* ids : {k_idx, q_idx}) {
        for (int64_t n = 0; n < (ids == k_idx ? W : R); ++n) {
          if (ids[n] < 0 || ids[n] >= K) continue;
          const char* row = reinterpret_cast<const char*>(rows + static_cast<int64_t>(ids[n]) * D);
          for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(BankT)); b += 64) __builtin_prefetch(row + b);
        }
      }
      for (int64_t n = 0; n < W; ++n) first[n] = first_write_lane(k_idx, W, K, k_idx[n]);
      for (int64_t m = 0; m < R; ++m) read_lane[m] = first_write_lane(k_idx, W, K, q_idx[m]);

      // Decay each distinct written row once, into the working rows of its first lane.
      for (int64_t n = 0; n < W; ++n) {
        if (first[n] != n) continue;
        const float decay = std::exp(x[dm.per_write_gates ? n : 0]);
        const BankT* row = rows + static_cast<int64_t>(k_idx[n]) * D;
        for (int64_t j = 0; j < D; ++j) cur[n * D + j] = decay * to_float(row[j]);
      }
      // pred, then in its place the delta-rule correction d.
      std::fill(delta.begin(), delta.end(), 0.0f);
      for (int64_t n = 0; n < W; ++n) {
        if (first[n] < 0) continue;
        const float k = to_float(k_val[n]);
        const float* c = cur.data() + first[n] * D;
        for (int64_t j = 0; j < D; ++j) delta[j] += k * c[j];
      }
      const float beta = tok.beta[s];
      const BankT* v = tok.v + s * D;
      for (int64_t j = 0; j < D; ++j) delta[j] = beta * (to_float(v[j]) - delta[j]);
      for (int64_t n = 0; n < W; ++n) {
        if (first[n] < 0) continue;
        const float k = to_float(k_val[n]);
        float* c = cur.data() + first[n] * D;
        for (int64_t j = 0; j < D; ++j) c[j] += k * delta[j];
      }
      for (int64_t n = 0; n < W; ++n) {
        if (first[n] != n) continue;
        BankT* row = rows + static_cast<int64_t>(k_idx[n]) * D;
        for (int64_t j = 0; j < D; ++j) row[j] = from_float<BankT>(cur[n * D + j]);
      }
      // Reads after the write: a written row from its float32 working row, any other from the bank.
      std::fill(reading.begin(), reading.end(), 0.0f);
      for (int64_t m = 0; m < R; ++m) {
        const int32_t r = q_idx[m];
        if (r < 0 || r >= K) continue;
        const float q = to_float(q_val[m]);
        if (read_lane[m] >= 0) {
          const float* c = cur.data() + read_lane[m] * D;
          for (int64_t j = 0; j < D; ++j) reading[j] += q * c[j];
        } else {
          const BankT* row = rows + static_cast<int64_t>(r) * D;
          for (int64_t j = 0; j < D; ++j) reading[j] += q * to_float(row[j]);
        }
      }
      BankT* y = tok.y + s * D;
      for (int64_t j = 0; j < D; ++j) y[j] = from_float<BankT>(reading[j]);
    }
  });
}

template void decode_step_cpu<float>(const DecodeDims&, const DecodeToken<float>&, float*);
template void decode_step_cpu<bf16>(const DecodeDims&, const DecodeToken<bf16>&, bf16*);

}  // namespace sdm
