// The no-grad forward on the CPU (kernels/token_recurrence.h): streams in parallel blocks, each stream's tokens in
// order, each token by `token_rows_cpu` (kernels/token_rows_cpu.h). Compiled with -ffp-contract=off.
#include <algorithm>
#include <type_traits>
#include <vector>

#include "kernels/bf16.h"
#include "kernels/parallel.h"
#include "kernels/token_recurrence.h"
#include "kernels/token_rows_cpu.h"

namespace sdm {

template <typename BankT>
void token_recurrence_cpu(const TokenRecurrenceDims& dm, const TokenRecurrenceIO<BankT>& io, const BankT* initial,
                          BankT* bank) {
  const int64_t T = dm.T, H = dm.H, K = dm.K, D = dm.D, W = dm.W, R = dm.R;
  const int64_t x_lanes = dm.per_write_gates ? W : 1;
  // Threads only pay off when a block of streams is much more work than starting a thread.
  const int64_t per_stream = T * (2 * W + R + 2) * D;
  parallel_blocks(dm.streams(), std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(1, per_stream)),
                  [&](int64_t begin, int64_t end) {
    // lane_of[slot]: the first write lane of the current token with that slot, -1 if none (reset after each
    // token): each lane finds its slot's first lane in O(1), whatever W.
    std::vector<int32_t> lane_of(static_cast<size_t>(K), -1), first(static_cast<size_t>(W)),
        read_lane(static_cast<size_t>(R));
    // Working rows for a bfloat16 bank only (token_rows_cpu works on a float32 bank's rows in place).
    std::vector<float> cur(std::is_same<BankT, float>::value ? 0 : static_cast<size_t>(W * D)),
        delta(static_cast<size_t>(D)), reading(static_cast<size_t>(D));
    for (int64_t s = begin; s < end; ++s) {
      BankT* rows = bank + s * K * D;
      if (initial != bank) std::copy(initial + s * K * D, initial + (s + 1) * K * D, rows);
      const int64_t first_token = (s / H) * T * H + s % H;  // the stream's tokens are H apart
      int32_t repeats = 0;
      for (int64_t i = 0; i < T; ++i) {
        const int64_t t = first_token + i * H;
        const int32_t* k_idx = io.k_idx + t * W;
        const int32_t* q_idx = io.q_idx + t * R;
        if (i + 1 < T) {  // the next token's rows load while this one runs
          prefetch_rows(rows, k_idx + H * W, W, K, D);
          prefetch_rows(rows, q_idx + H * R, R, K, D);
        }
        for (int64_t n = 0; n < W; ++n) {
          const int32_t slot = k_idx[n];
          if (slot < 0 || slot >= K) {
            first[n] = -1;
          } else if (lane_of[slot] < 0) {
            first[n] = lane_of[slot] = static_cast<int32_t>(n);
          } else {
            first[n] = lane_of[slot];
            ++repeats;
          }
        }
        for (int64_t m = 0; m < R; ++m) read_lane[m] = (q_idx[m] < 0 || q_idx[m] >= K) ? -1 : lane_of[q_idx[m]];
        const TokenRows<BankT, BankT> token{K, D, W, R, k_idx, io.k_val + t * W, io.x + t * x_lanes,
                                            dm.per_write_gates ? 1 : 0, io.v + t * D, io.beta[t], q_idx,
                                            io.q_val + t * R, first.data(), read_lane.data(), rows};
        token_rows_cpu(token, cur.data(), delta.data(), reading.data());
        store_row(io.y + t * D, reading.data(), D);
        for (int64_t n = 0; n < W; ++n) {
          if (first[n] == n) lane_of[k_idx[n]] = -1;
        }
      }
      io.repeats[s] = repeats;
    }
  });
}

template void token_recurrence_cpu<float>(const TokenRecurrenceDims&, const TokenRecurrenceIO<float>&, const float*,
                                          float*);
template void token_recurrence_cpu<bf16>(const TokenRecurrenceDims&, const TokenRecurrenceIO<bf16>&, const bf16*,
                                         bf16*);

}  // namespace sdm
