// The CUDA decode step (kernels/decode_step_cuda.cu, rewritten for the host by transform.py) against the CPU one
// (kernels/decode_step_cpu.cc) on random tokens: float32 and bfloat16 banks, per-token and per-write gates,
// repeated and out-of-range slot ids, and widths D that leave a partial column tile; then the layer's step
// (run_layer). Both round every multiply and add separately (the CUDA kernel is built with -fmad=false), so the
// readings and the bank must agree bitwise.
#include "decode_emu.inc"

#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "candidate_table.h"
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

// n random values of the layer's dtype (float32, or bfloat16 bits), a third of them 0.5 with `ties` (equal scores:
// ties in the ranks).
std::vector<unsigned char> random_values(std::mt19937& rng, int64_t n, float scale, bool bf16, bool ties) {
  std::normal_distribution<float> normal;
  std::vector<unsigned char> out(n * (bf16 ? 2 : 4));
  for (int64_t i = 0; i < n; ++i) {
    const float x = ties && rng() % 3 == 0 ? 0.5f : scale * normal(rng);
    if (bf16) {
      const uint16_t b = bf16_bits_of(x);
      std::memcpy(out.data() + 2 * i, &b, 2);
    } else {
      std::memcpy(out.data() + 4 * i, &x, 4);
    }
  }
  return out;
}

// A layer step's random problem: the gate parameters [G, H, 2] (-exp(A_log), dt_bias), the readout norm's [G, 2, D],
// the projection rows (ties among them with `ties`), the bank (a copy for each side) and both sides' outputs.
struct LayerProblem {
  std::vector<float> gates, norm;
  std::vector<unsigned char> proj, bank_cpu, bank_cuda, out_cpu, out_cuda;

  LayerProblem(std::mt19937& rng, const LayerDecodeDims& dm, bool ties) {
    std::normal_distribution<float> normal;
    gates.resize(dm.G * dm.H * 2);
    for (int64_t i = 0; i < dm.G * dm.H; ++i) {
      gates[2 * i] = -std::exp(normal(rng));
      gates[2 * i + 1] = normal(rng);
    }
    norm.resize(dm.G * 2 * dm.D);
    for (auto& x : norm) x = 1.0f + 0.3f * normal(rng);
    proj = random_values(rng, dm.S * dm.width, 1.0f, dm.bf16, ties);
    bank_cpu = bank_cuda = random_values(rng, dm.S * dm.K * dm.D, 0.1f, dm.bf16, false);
    out_cpu.assign(dm.S * dm.D * (dm.bf16 ? 2 : 4), 0);  // poisoned apart: an output left unwritten differs
    out_cuda.assign(out_cpu.size(), 0xab);
  }
  LayerDecodeInputs inputs(const int32_t* ids, const float* scores, bool cuda) {
    return {ids, scores, proj.data(), gates.data(), norm.data(), cuda ? out_cuda.data() : out_cpu.data()};
  }
  bool same() const { return out_cpu == out_cuda && bank_cpu == bank_cuda; }
};

// The layer's step (layer_decode_step_cuda against layer_decode_step_cpu) on random top lists, projections and
// parameters: every activation and norm, with and without the output gate, per-token and per-write gates, one and
// two parameter groups, and widths D of several column batches.
bool run_layer(LayerDecodeDims dm, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int32_t> slot(-2, static_cast<int32_t>(dm.K) + 1);
  std::uniform_int_distribution<int32_t> in_range(0, static_cast<int32_t>(dm.K) - 1);
  const int64_t S = dm.S, K = dm.K, D = dm.D, k = dm.k;
  // The projection row: v, b, a, then the output gate's columns, after a few unused ones.
  dm.v_off = 3;
  dm.b_off = dm.v_off + D;
  dm.a_off = dm.b_off + 1;
  const int64_t og = dm.a_off + 1;
  dm.width = og + D;
  if (dm.og_off >= 0) dm.og_off = og;
  std::vector<int32_t> ids(S * 2 * k);
  for (int64_t s = 0; s < S; ++s) {
    int32_t* w = ids.data() + 2 * s * k;
    for (int64_t n = 0; n < k; ++n) w[n] = rng() % 5 == 0 ? slot(rng) : in_range(rng);
    for (int64_t m = 0; m < k; ++m) w[k + m] = rng() % 2 ? w[rng() % dm.W] : slot(rng);  // reads of written rows
  }
  std::vector<float> scores(S * 2 * k);
  for (auto& x : scores) x = 2.0f * normal(rng);
  LayerProblem p(rng, dm, false);
  layer_decode_step_cpu(dm, p.inputs(ids.data(), scores.data(), false), p.bank_cpu.data());
  const int rc = layer_decode_step_cuda(dm, p.inputs(ids.data(), scores.data(), true), p.bank_cuda.data(), nullptr);
  const bool ok = rc == 0 && p.same();
  std::printf("%s layer S%lld G%lld H%lld K%lld D%lld W%lld R%lld k%lld %s act %d/%d norm %d og %s gates=%s rc=%d\n",
              ok ? "ok  " : "FAIL", (long long)S, (long long)dm.G, (long long)dm.H, (long long)K, (long long)D,
              (long long)dm.W, (long long)dm.R, (long long)k, dm.bf16 ? "bf16" : "f32", dm.write_act, dm.read_act,
              dm.norm, dm.og_off >= 0 ? "yes" : "no", dm.per_write_gates ? "write" : "token", rc);
  return ok;
}

// The layer's step that ranks its lists (layer_decode_rank_step_cuda against layer_decode_rank_step_cpu): the
// projection row holds the write and the read address rows (the factors' scores side by side), then v, b, a and
// the output gate's columns.
bool run_layer_rank(LayerDecodeDims dm, const std::vector<int64_t>& factors, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  const int64_t S = dm.S, K = dm.K, D = dm.D, k = dm.k;
  int64_t C = 0, aw = 0;
  for (int64_t n : factors) aw += n;
  const std::vector<int32_t> table = emu_check::candidate_table(factors, k, &C);
  const ProductKeyDims pk = product_key_dims(1, factors.data(), static_cast<int>(factors.size()), k, C);
  dm.rank_off[0] = 0;
  dm.rank_off[1] = aw;
  dm.v_off = 2 * aw;
  dm.b_off = dm.v_off + D;
  dm.a_off = dm.b_off + 1;
  dm.width = dm.a_off + 1 + D;
  if (dm.og_off >= 0) dm.og_off = dm.a_off + 1;
  LayerProblem p(rng, dm, true);
  layer_decode_rank_step_cpu(dm, pk, table.data(), p.inputs(nullptr, nullptr, false), p.bank_cpu.data());
  const int rc = layer_decode_rank_step_cuda(dm, pk, table.data(), p.inputs(nullptr, nullptr, true),
                                             p.bank_cuda.data(), nullptr);
  const bool ok = rc == 0 && p.same();
  std::printf("%s layer rank S%lld F%zu (%lld, ...) K%lld D%lld W%lld R%lld k%lld %s norm %d rc=%d\n",
              ok ? "ok  " : "FAIL", (long long)S, factors.size(), (long long)factors[0], (long long)K, (long long)D,
              (long long)dm.W, (long long)dm.R, (long long)k, dm.bf16 ? "bf16" : "f32", dm.norm, rc);
  return ok;
}

LayerDecodeDims layer_case(int64_t S, int64_t G, int64_t H, int64_t K, int64_t D, int64_t W, int64_t R, int64_t k,
                           int32_t write_act, int32_t read_act, int32_t norm, bool gate, bool per_write, bool bf16) {
  LayerDecodeDims dm{};
  dm.S = S, dm.K = K, dm.D = D, dm.W = W, dm.R = R, dm.G = G, dm.H = H, dm.k = k;
  dm.og_off = gate ? 0 : -1;
  dm.write_act = write_act, dm.read_act = read_act, dm.norm = norm;
  dm.write_scale = 0.7f, dm.read_scale = 1.3f, dm.eps = 1e-5f;
  dm.per_write_gates = per_write, dm.bf16 = bf16;
  return dm;
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
  // {S, G, H, K, D, W, R, k, activations, norm, output gate, per-write gates}
  for (int32_t act = 0; act < kNumLaneActivations; ++act) {
    const bool bf16 = act % 2;
    failing += !run_layer(layer_case(8, 1, 4, 64, 40, 4, 3, 5, act, (act + 4) % kNumLaneActivations, act % 3,
                                     act % 2 == 0, act % 3 == 1, bf16),
                          seed++);
  }
  failing += !run_layer(layer_case(12, 2, 3, 300, 300, 9, 16, 16, kSoftmax, kSoftmax, kRmsNorm, true, false, true),
                        seed++);
  failing += !run_layer(layer_case(4, 1, 2, 5, 16, 1, 1, 2, kSoftmax, kL2Normalize, kLayerNorm, true, true, false),
                        seed++);
  failing += !run_layer(layer_case(2, 2, 1, 1000, 130, 20, 12, 20, kGelu, kSoftmax, kNoNorm, false, true, true),
                        seed++);
  // {S, G, H, K, D, W, R, k, activations, norm, output gate, per-write gates}, the factors (product K)
  failing += !run_layer_rank(layer_case(16, 1, 4, 4096, 128, 16, 16, 16, kSoftmax, kSoftmax, kRmsNorm, true, false,
                                        true), {64, 64}, seed++);
  failing += !run_layer_rank(layer_case(6, 2, 3, 360, 40, 5, 9, 9, kGelu, kL2Normalize, kLayerNorm, false, true,
                                        false), {12, 30}, seed++);
  failing += !run_layer_rank(layer_case(4, 1, 2, 1 << 20, 16, 16, 16, 16, kSoftmax, kSigmoid, kNoNorm, true, false,
                                        true), {1024, 1024}, seed++);
  failing += !run_layer_rank(layer_case(3, 1, 3, 4 * 8 * 6 * 5, 130, 64, 33, 64, kSilu, kSoftmax, kRmsNorm, true,
                                        true, true), {4, 8, 6, 5}, seed++);
  // Factors above 256 entries, each ranked by two warps (rank_split): odd sizes and halves, lists of more than 32
  // (k 64, 33), float32's wide composites, and one factor whose halves exceed the keys a lane's registers hold.
  failing += !run_layer_rank(layer_case(3, 1, 3, 300 * 301, 40, 64, 40, 64, kSoftmax, kSoftmax, kLayerNorm, true,
                                        false, false), {300, 301}, seed++);
  failing += !run_layer_rank(layer_case(4, 2, 2, 520 * 600, 16, 20, 33, 33, kSigmoid, kSoftmax, kRmsNorm, false,
                                        true, false), {520, 600}, seed++);
  failing += !run_layer_rank(layer_case(2, 1, 2, 2000, 24, 16, 16, 16, kSoftmax, kSoftmax, kRmsNorm, true, false,
                                        true), {2000}, seed++);
  failing += !run_layer_rank(layer_case(2, 1, 1, 257 * 64, 128, 16, 16, 16, kSoftmax, kSoftmax, kRmsNorm, true,
                                        false, true), {257, 64}, seed++);
  std::printf("%d failing cases\n", failing);
  return failing != 0;
}
