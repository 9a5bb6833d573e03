// The fused decode step on the CPU (kernels/decode_step.h): streams in parallel blocks, each stream's token in
// lane order over whole rows (kernels/token_rows_cpu.h: the arithmetic of the CPU's no-grad forward too).
// Compiled with -ffp-contract=off (no fused multiply-add), like the other CPU kernels.
#include <algorithm>
#include <vector>

#include "kernels/bf16.h"
#include "kernels/decode_step.h"
#include "kernels/parallel.h"
#include "kernels/token_rows_cpu.h"

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
      prefetch_rows(rows, k_idx, W, K, D);
      prefetch_rows(rows, q_idx, R, K, D);
      for (int64_t n = 0; n < W; ++n) first[n] = first_write_lane(k_idx, W, K, k_idx[n]);
      for (int64_t m = 0; m < R; ++m) read_lane[m] = first_write_lane(k_idx, W, K, q_idx[m]);

      const TokenRows<BankT, BankT> token{K, D, W, R, k_idx, k_val, x, dm.per_write_gates ? 1 : 0, tok.v + s * D,
                                          tok.beta[s], q_idx, q_val, first.data(), read_lane.data(), rows};
      token_rows_cpu(token, cur.data(), delta.data(), reading.data());
      BankT* y = tok.y + s * D;
      for (int64_t j = 0; j < D; ++j) y[j] = from_float<BankT>(reading[j]);
    }
  });
}

namespace {

// `pk` null: the lists are in.ids and in.scores; else the product-key top-k of the projection's address rows.
template <typename BankT>
void layer_decode_step_typed(const LayerDecodeDims& dm, const LayerDecodeInputs& in, BankT* bank,
                             const ProductKeyDims* pk, const int32_t* table) {
  const int64_t K = dm.K, D = dm.D, W = dm.W, R = dm.R;
  const int64_t per_stream = (W + R + 2) * D;
  parallel_blocks(dm.S, std::max<int64_t>(1, (int64_t{1} << 20) / per_stream), [&](int64_t begin, int64_t end) {
    std::vector<int32_t> k_idx(static_cast<size_t>(W)), q_idx(static_cast<size_t>(R)), first(static_cast<size_t>(W)),
        read_lane(static_cast<size_t>(R));
    std::vector<int32_t> ranked_ids(pk ? 2 * dm.k : 0);
    std::vector<float> ranked_scores(pk ? 2 * dm.k : 0);
    std::vector<float> k_val(static_cast<size_t>(W)), q_val(static_cast<size_t>(R)), x(static_cast<size_t>(W)),
        v(static_cast<size_t>(D)), cur(static_cast<size_t>(W * D)), delta(static_cast<size_t>(D)),
        reading(static_cast<size_t>(D));
    for (int64_t s = begin; s < end; ++s) {
      const int64_t row = proj_row(dm, s);
      const int32_t* ids = in.ids + write_list(dm, s);
      const float* scores = in.scores + write_list(dm, s);
      if (pk) {
        for (int q = 0; q < 2; ++q) {
          product_key_topk_cpu(*pk, static_cast<const BankT*>(in.proj) + row + dm.rank_off[q], table,
                               ranked_scores.data() + q * dm.k, ranked_ids.data() + q * dm.k);
        }
        ids = ranked_ids.data();
        scores = ranked_scores.data();
      }
      for (int64_t n = 0; n < W; ++n) {
        k_idx[n] = ids[n];
        k_val[n] = scores[n];
      }
      for (int64_t m = 0; m < R; ++m) {
        q_idx[m] = ids[dm.k + m];
        q_val[m] = scores[dm.k + m];
      }
      float beta;
      lane_values(dm, in.gates + gate_params(dm, s), value_at(in.proj, row + dm.b_off, dm.bf16),
                  value_at(in.proj, row + dm.a_off, dm.bf16), k_val.data(), q_val.data(), x.data(), &beta);
      BankT* rows = bank + s * K * D;
      prefetch_rows(rows, k_idx.data(), W, K, D);
      prefetch_rows(rows, q_idx.data(), R, K, D);
      for (int64_t n = 0; n < W; ++n) first[n] = first_write_lane(k_idx.data(), W, K, k_idx[n]);
      for (int64_t m = 0; m < R; ++m) read_lane[m] = first_write_lane(k_idx.data(), W, K, q_idx[m]);
      for (int64_t j = 0; j < D; ++j) v[j] = value_at(in.proj, row + dm.v_off + j, dm.bf16);
      const TokenRows<BankT, float> token{K, D, W, R, k_idx.data(), k_val.data(), x.data(),
                                          dm.per_write_gates ? 1 : 0, v.data(), beta, q_idx.data(), q_val.data(),
                                          first.data(), read_lane.data(), rows};
      token_rows_cpu(token, cur.data(), delta.data(), reading.data());
      for (int64_t j = 0; j < D; ++j) reading[j] = rounded_value(reading[j], dm.bf16);
      float shift = 0.0f, mul = 1.0f;
      if (dm.norm != kNoNorm) {
        float sum, sum_sq;
        warp_order_sums(reading.data(), D, &sum, &sum_sq);
        norm_stats(dm, sum, sum_sq, &shift, &mul);
      }
      BankT* out = static_cast<BankT*>(in.out) + s * D;
      for (int64_t j = 0; j < D; ++j)
        out[j] = from_float<BankT>(layer_out(dm, out_column(dm, in, s, j), reading[j], shift, mul));
    }
  });
}

}  // namespace

void layer_decode_step_cpu(const LayerDecodeDims& dm, const LayerDecodeInputs& in, void* bank) {
  if (dm.bf16) layer_decode_step_typed(dm, in, static_cast<bf16*>(bank), nullptr, nullptr);
  else layer_decode_step_typed(dm, in, static_cast<float*>(bank), nullptr, nullptr);
}

void layer_decode_rank_step_cpu(const LayerDecodeDims& dm, const ProductKeyDims& pk, const int32_t* table,
                                const LayerDecodeInputs& in, void* bank) {
  ProductKeyDims one = pk;
  one.rows = 1;
  if (dm.bf16) layer_decode_step_typed(dm, in, static_cast<bf16*>(bank), &one, table);
  else layer_decode_step_typed(dm, in, static_cast<float*>(bank), &one, table);
}

template void decode_step_cpu<float>(const DecodeDims&, const DecodeToken<float>&, float*);
template void decode_step_cpu<bf16>(const DecodeDims&, const DecodeToken<bf16>&, bf16*);

}  // namespace sdm
