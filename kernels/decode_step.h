// The fused decode step (`jax_sdm.sdm_step`): one token of the token recurrence (docs/MATH.md) for every stream,
// with the bank updated in place. Plain C++ / CUDA on raw pointers.
//
// Layout: S independent streams; the bank is [S, K, D] (stream s's rows at s*K), per-token arrays are [S, W]
// (writes), [S, R] (reads), [S, D] (v, y), [S] (beta) and the gates [S] (per token) or [S, W] (per write).
// Per stream, with `first[n]` the first valid lane writing lane n's slot and `cur[n]` (float32, n a first lane)
// the working value of that row:
//
//   cur[n] = exp(x_n) * S[s_n]                 for each first lane n (each distinct written slot decays once)
//   pred   = sum_n k_n cur[first[n]]           lanes n = 0, 1, ..., W-1 (after the decay, before the write)
//   d      = beta (v - pred)
//   cur[first[n]] += k_n d                     lanes in order
//   S[s_n] = cur[n]                            for each first lane n (rounded once to the bank's dtype)
//   y      = sum_m q_m (r_m written ? cur[first lane of r_m] : S[r_m])    lanes m in order (read after the write)
//
// Lanes whose slot id is outside [0, K) take no part (they read zeros and touch no row). Everything above is
// column by column: column j of a stream depends on column j only, so each column has one owner (a thread on
// the GPU, a loop iteration on the CPU) that runs the whole token in lane order. Only the W written rows are
// touched, so a step costs O((W + R) D) per stream, independent of K, and results are bitwise reproducible.
#ifndef JAX_SDM_KERNELS_DECODE_STEP_H_
#define JAX_SDM_KERNELS_DECODE_STEP_H_

#include <cmath>
#include <cstdint>

struct CUstream_st;  // cudaStream_t, declared so that this header needs no CUDA include

#include "kernels/bf16.h"
#include "kernels/host_device.h"
#include "kernels/product_key_topk.h"

namespace sdm {

// The first write lane of a stream's token ([W] slot ids) that writes `slot`; -1 if none does or if `slot` is
// outside [0, K). For a write lane n, first_write_lane(.., k_idx[n]) is `first[n]` (n itself unless a repeat).
SDM_HOST_DEVICE inline int32_t first_write_lane(const int32_t* k_idx, int64_t W, int64_t K, int32_t slot) {
  if (slot < 0 || slot >= K) return -1;
  for (int64_t n = 0; n < W; ++n) {
    if (k_idx[n] == slot) return static_cast<int32_t>(n);
  }
  return -1;
}

struct DecodeDims {
  int64_t S, K, D, W, R;
  bool per_write_gates;  // x is [S, W] (else [S], one gate per token)
};

// The token, one per stream. ValT is the bank's type (float or sdm::bf16 / __nv_bfloat16).
template <typename ValT>
struct DecodeToken {
  const int32_t* k_idx;  // [S, W]
  const ValT* k_val;     // [S, W]
  const float* x;        // [S] or [S, W] log-gates
  const ValT* v;         // [S, D]
  const float* beta;     // [S]
  const int32_t* q_idx;  // [S, R]
  const ValT* q_val;     // [S, R]
  ValT* y;               // [S, D] out
};

// The bank ([S, K, D], in/out) goes one token forward. BankT is float or sdm::bf16.
template <typename BankT>
void decode_step_cpu(const DecodeDims& dims, const DecodeToken<BankT>& token, BankT* bank);

// The layer's decode step (jax_sdm.nn.SparseDeltaMemory.decode): the step above with its per-lane inputs made from
// the layer's address top-k and input projection, and its readings normed and gated, in one call (a decode step
// launches few kernels). Per stream s, of head h = s mod H in parameter group c (the streams are [G, S/G] with the
// heads last, the parameters [G, H, 2] and [G, 2, D]: G > 1 where a vmap maps the parameters too):
//
//   k_idx[n] = ids[s][0][n], k_val[n] = V(act_w(write_scale * scores[s][0][0..W)))[n]       n < W
//   q_idx[m] = ids[s][1][m], q_val[m] = V(act_r(read_scale * scores[s][1][0..R)))[m]        m < R
//   beta = sigmoid(b), g = gates[c][h][0] * softplus(a + gates[c][h][1])   (gates: -exp(A_log), dt_bias)
//   x = g (per token), or x[n] = g |k_val[n]| (per write)
//   v = proj[s][v_off .. v_off + D), b = proj[s][b_off], a = proj[s][a_off]
//   y = V(the step's reading); out = V(norm(y)) * V(sigmoid(proj[s][og_off + j])) (no factor when og_off < 0)
//
// V rounds to the values' type (float32 or bfloat16: the bank's). The norms, in float32 (sums: warp_order_sums):
// RMS `y rsqrt(mean(y^2) + eps) scale`, layer `(y - mean) rsqrt(max(mean(y^2) - mean^2, 0) + eps) scale + bias`
// (scale = norm[c][0], bias = norm[c][1]).
// The activations' sums (softmax, l2_normalize) run in lane order, so CPU and CUDA make the same weights.
enum LaneActivation : int32_t {
  kSoftmax = 0,
  kL2Normalize,
  kIdentity,
  kSigmoid,
  kTanh,
  kRelu,
  kGelu,
  kSilu,
  kSoftplus,
  kNumLaneActivations
};
enum ReadoutNorm : int32_t { kNoNorm = 0, kRmsNorm, kLayerNorm, kNumReadoutNorms };

struct LayerDecodeDims {
  int64_t S, K, D, W, R;
  int64_t G, H;  // parameter groups, heads
  int64_t k;                            // entries per top list (at least W and R)
  int64_t width;                        // columns of a stream's projection row
  int64_t v_off, b_off, a_off, og_off;  // og_off < 0: no output gate
  int64_t rank_off[2];                  // the write and read address rows (the steps that rank their lists)
  int32_t write_act, read_act, norm;
  float write_scale, read_scale, eps;
  bool per_write_gates;
  bool bf16;  // the values' type (bank, projection, out): bfloat16, else float32
};

struct LayerDecodeInputs {
  const int32_t* ids;    // [S, 2, k]: a stream's write list, then its read list, best first
  const float* scores;   // [S, 2, k]
  const void* proj;      // [S, width]
  const float* gates;    // [G, H, 2]: -exp(A_log), dt_bias
  const float* norm;     // [G, 2, D]: scale, bias (the bias for the layer norm only)
  void* out;             // [S, D]
};

SDM_HOST_DEVICE inline float value_at(const void* p, int64_t i, bool is_bf16) {
  return is_bf16 ? float_of_bf16_bits(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
}
SDM_HOST_DEVICE inline float rounded_value(float x, bool is_bf16) {
  return is_bf16 ? float_of_bf16_bits(bf16_bits_of(x)) : x;
}
SDM_HOST_DEVICE inline float sigmoid_of(float x) { return 1.0f / (1.0f + expf(-x)); }
SDM_HOST_DEVICE inline float softplus_of(float x) { return fmaxf(x, 0.0f) + log1pf(expf(-fabsf(x))); }

// A list's weights w[i] = V(act(scale * s[i])) (jax_sdm.nn ACTIVATIONS; gelu exact) in three phases, so that a
// warp can share the elementwise ones and keep the one sum in index order (the same bits as lane_weights):
//   1. lane_activation on every element; softmax then takes the maximum and lane_exp on every element;
//   2. lane_denominator, the one sum, in index order (softmax: of the exponentials; l2_normalize: of the squares);
//   3. lane_weight on every element: divided by the denominator (softmax, l2_normalize), rounded to the values' type.
SDM_HOST_DEVICE inline float lane_activation(int32_t act, float z) {
  switch (act) {
    case kSoftmax:
    case kL2Normalize:
    case kIdentity: return z;
    case kSigmoid: return sigmoid_of(z);
    case kTanh: return tanhf(z);
    case kRelu: return fmaxf(z, 0.0f);
    case kGelu: return z * (erff(z * 0.70710678118654752f) + 1.0f) * 0.5f;
    case kSilu: return z * sigmoid_of(z);
    default: return softplus_of(z);
  }
}
SDM_HOST_DEVICE inline float lane_exp(float z, float top) { return expf(z - top); }
SDM_HOST_DEVICE inline float lane_denominator(int32_t act, const float* w, int64_t n) {
  float total = 0.0f;
  if (act == kSoftmax) {
    for (int64_t i = 0; i < n; ++i) total += w[i];
    return total;
  }
  if (act == kL2Normalize) {
    for (int64_t i = 0; i < n; ++i) total += w[i] * w[i];
    return sqrtf(total) + 1e-12f;
  }
  return 1.0f;
}
SDM_HOST_DEVICE inline float lane_weight(int32_t act, float w, float denominator, bool is_bf16) {
  return rounded_value(act == kSoftmax || act == kL2Normalize ? w / denominator : w, is_bf16);
}

// The three phases on one thread; w may be s.
SDM_HOST_DEVICE inline void lane_weights(const float* s, int64_t n, int32_t act, float scale, bool is_bf16,
                                         float* w) {
  float top = -INFINITY;
  for (int64_t i = 0; i < n; ++i) {
    w[i] = lane_activation(act, scale * s[i]);
    top = fmaxf(top, w[i]);
  }
  if (act == kSoftmax) {
    for (int64_t i = 0; i < n; ++i) w[i] = lane_exp(w[i], top);
  }
  const float denominator = lane_denominator(act, w, n);
  for (int64_t i = 0; i < n; ++i) w[i] = lane_weight(act, w[i], denominator, is_bf16);
}

// Where stream s's inputs are: its write list (its read list follows, k further), its projection row, and its
// head's gate parameters (-exp(A_log), dt_bias).
SDM_HOST_DEVICE inline int64_t write_list(const LayerDecodeDims& dm, int64_t s) { return 2 * s * dm.k; }
SDM_HOST_DEVICE inline int64_t proj_row(const LayerDecodeDims& dm, int64_t s) { return s * dm.width; }
SDM_HOST_DEVICE inline int64_t gate_params(const LayerDecodeDims& dm, int64_t s) {
  return 2 * ((s / (dm.S / dm.G)) * dm.H + s % dm.H);
}

// The token's log-gate from its pre-gate column a and its head's gate parameters (-exp(A_log), dt_bias); with
// per-write gates, write lane n's is that times |k_val[n]| (key-weighted decay).
SDM_HOST_DEVICE inline float token_log_gate(const float* gates, float a) {
  return gates[0] * softplus_of(a + gates[1]);
}
SDM_HOST_DEVICE inline float write_log_gate(float g, float k_val) { return g * fabsf(k_val); }

// A stream's weights, log-gates (W with per-write gates, else one) and beta from its lists' scores (k_val and
// q_val hold the W and R scores on entry), its pre-gate columns b and a, and its head's gate parameters.
SDM_HOST_DEVICE inline void lane_values(const LayerDecodeDims& dm, const float* gates, float b, float a,
                                        float* k_val, float* q_val, float* x, float* beta) {
  lane_weights(k_val, dm.W, dm.write_act, dm.write_scale, dm.bf16, k_val);
  lane_weights(q_val, dm.R, dm.read_act, dm.read_scale, dm.bf16, q_val);
  *beta = sigmoid_of(b);
  const float g = token_log_gate(gates, a);
  if (dm.per_write_gates) {
    for (int64_t n = 0; n < dm.W; ++n) x[n] = write_log_gate(g, k_val[n]);
  } else {
    x[0] = g;
  }
}

// The sums of y[0..D) and of its squares in the order the CUDA kernel's warp adds them: lane l < 32 sums columns
// l, l + 32, l + 64, ... in order, then lanes combine in pairs, lane i with lane i ^ o for o = 16, 8, 4, 2, 1.
inline void warp_order_sums(const float* y, int64_t D, float* sum, float* sum_sq) {
  float p[32], q[32];
  for (int l = 0; l < 32; ++l) {
    p[l] = 0.0f;
    q[l] = 0.0f;
    for (int64_t j = l; j < D; j += 32) {
      p[l] += y[j];
      q[l] += y[j] * y[j];
    }
  }
  for (int o = 16; o > 0; o /= 2) {
    float p2[32], q2[32];
    for (int l = 0; l < 32; ++l) {
      p2[l] = p[l] + p[l ^ o];
      q2[l] = q[l] + q[l ^ o];
    }
    for (int l = 0; l < 32; ++l) {
      p[l] = p2[l];
      q[l] = q2[l];
    }
  }
  *sum = p[0];
  *sum_sq = q[0];
}

// The norm's statistics from the column sums of y and y^2: (shift, multiplier without the scale).
SDM_HOST_DEVICE inline void norm_stats(const LayerDecodeDims& dm, float sum, float sum_sq, float* shift,
                                       float* mul) {
  const float d = static_cast<float>(dm.D);
  if (dm.norm == kRmsNorm) {
    *shift = 0.0f;
    *mul = 1.0f / sqrtf(sum_sq / d + dm.eps);
  } else {
    const float mean = sum / d;
    *shift = mean;
    *mul = 1.0f / sqrtf(fmaxf(sum_sq / d - mean * mean, 0.0f) + dm.eps);
  }
}

// What column j of stream s's output needs besides its reading: the norm's scale and bias, and the output gate's
// pre-activation (each loaded only where the layer has it), so that a kernel can load them before the step.
struct OutColumn {
  float scale = 1.0f, bias = 0.0f, gate = 0.0f;
};
SDM_HOST_DEVICE inline OutColumn out_column(const LayerDecodeDims& dm, const LayerDecodeInputs& in, int64_t s,
                                            int64_t j) {
  OutColumn c;
  if (dm.norm != kNoNorm) {
    const float* norm = in.norm + 2 * (s / (dm.S / dm.G)) * dm.D;
    c.scale = norm[j];
    if (dm.norm == kLayerNorm) c.bias = norm[dm.D + j];
  }
  if (dm.og_off >= 0) c.gate = value_at(in.proj, s * dm.width + dm.og_off + j, dm.bf16);
  return c;
}

// An output from its column's rounded reading y, the column's OutColumn and the norm's statistics.
SDM_HOST_DEVICE inline float layer_out(const LayerDecodeDims& dm, const OutColumn& col, float y, float shift,
                                       float mul) {
  float o = y;
  if (dm.norm != kNoNorm) {
    o = (y - shift) * (mul * col.scale);
    if (dm.norm == kLayerNorm) o += col.bias;
    o = rounded_value(o, dm.bf16);
  }
  if (dm.og_off >= 0) {
    const float gate = rounded_value(sigmoid_of(col.gate), dm.bf16);
    o = rounded_value(o * gate, dm.bf16);
  }
  return o;
}

// The layer's step (the bank [S, K, D], in/out, of the values' type).
void layer_decode_step_cpu(const LayerDecodeDims& dims, const LayerDecodeInputs& in, void* bank);
int layer_decode_step_cuda(const LayerDecodeDims& dims, const LayerDecodeInputs& in, void* bank,
                           CUstream_st* stream);

// The same with the lists ranked in the call: the product-key top-k (kernels/product_key_topk.h; `pk` the dims of
// one row of the factors' scores, `table` its candidates [F, C], k = pk.k) of each stream's projection columns
// from rank_off[0] (the write row) and rank_off[1] (the read row); in.ids and in.scores are not read. The CUDA
// kernel ranks both rows in the block that runs the step (a warp per row and factor, two for long factors), for
// at most kLayerRankMaxFactors factors and k, W, R <= kLayerRankMaxK.
constexpr int kLayerRankMaxFactors = 4;
constexpr int64_t kLayerRankMaxK = 64;
void layer_decode_rank_step_cpu(const LayerDecodeDims& dims, const ProductKeyDims& pk, const int32_t* table,
                                const LayerDecodeInputs& in, void* bank);
int layer_decode_rank_step_cuda(const LayerDecodeDims& dims, const ProductKeyDims& pk, const int32_t* table,
                                const LayerDecodeInputs& in, void* bank, CUstream_st* stream);

// Largest W and R of the CUDA kernel (a warp's working rows fit the default shared memory).
constexpr int64_t kDecodeCudaMaxLanes = 256;

// The same on `stream`, one launch; no allocation, no synchronisation, launch configuration from the shapes only.
// BankT is float or __nv_bfloat16 (passed as sdm::bf16, same layout). Returns the cudaError_t of the launch.
template <typename BankT>
int decode_step_cuda(const DecodeDims& dims, const DecodeToken<BankT>& token, BankT* bank, CUstream_st* stream);

}  // namespace sdm

#endif  // JAX_SDM_KERNELS_DECODE_STEP_H_
