// The CUDA chunk steps (kernels/chunk_steps/, rewritten for the host by transform.py) against the CPU ones
// (kernels/chunk_steps/cpu.cc), on small random problems wired as the FFI path wires them (jax_sdm/kernel_path.py):
// Phase 1 (CPU kernel) from random slot ids / weights / gates, Minv from the CPU solve, then
//   forward with residuals (y, delta, G, snapshot, links, final bank), forward without (y, final bank),
//   backward on the input bank and the CPU forward's residuals (every gradient, the gradient bank; the input bank
//   unchanged).
// Float outputs are compared to a tolerance for float32 summation order (the CUDA kernels sum some products in
// another order: the triangular products in 4-step tiles, the gathers in lane parts, warp trees for the dots, a
// fused multiply-add in the forward write), and a looser one where a bfloat16 rounding of a slightly different
// float32 can move a value by one bfloat16 step. NaN cells (outputs start as NaN) must match: a cell one side
// writes and the other does not fails. The links must equal the CPU's, and neither backward may change the input
// bank.
//
// Packed sequences (Case::segs > 0, kernels/chunk_steps.h StepSegments) are wired as kernel_path.py wires them: per stream
// a segment counter over the NC chunks' tokens (segments start at random tokens, a chunk's first token included;
// padding inside the sequence starts none and carries the counter on; in half the streams the last chunk's trailing
// pad tokens lie past the sequence's end instead, counter 0, as layout.to_units pads), per unit seg0 and local =
// counter - seg0 (segments.chunk_segments); Phase 1 runs on the virtual slots s + K * local (slot count
// K * (C + 1)), the steps on the real ids. The forward also compares the stamps and the stamp snapshot (bitwise;
// both start poisoned); the backward runs on the initial bank and the CPU forward's stamps, with the final bank's
// cotangent split into the working bank's share (rows stamped with the stream's last segment) and the initial
// bank's (dinitial), and also compares dinitial and the restored stamps (all zero). Neither pass may change the
// initial bank.
//
// A first argument `cpu-both` (run.sh plain steps cpu-both [...]) runs the CPU loops in place of the CUDA ones
// too: a check of this harness (every case must pass), not of the CUDA code. Then `snapshot=N` stores the snapshot
// as kernels/snapshot_codec.h's SnapshotDtype N says (0, the bank's dtype, by default; 1 bfloat16 is for float32
// banks): the forward's snapshots are compared decoded, and both backwards read the rows decoded.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <random>
#include <string>
#include <utility>

#include "cuda_emu.h"
#include "kernels/bf16.h"
#include "kernels/chunk_steps.h"
#include "kernels/phase1.h"
#include "kernels/solve.h"

using namespace sdm;

namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

struct Case {
  int64_t V, NC, P, C, W, R, K, D;
  bool bf16_bank, bf16_grad;
  double invalid;  // fraction of out-of-range ids
  int pad;         // trailing tokens of each unit with all ids -1
  double segs = 0;  // packed sequences: 0 none, else the mean segment starts per chunk past its first token
  int64_t shared_in = 0;  // the CUDA forward's input bank: 0 per stream, else that many blocks the streams share
};

bool cpu_both = false;  // run the CPU loops on the "CUDA" side too (a check of the harness)
SnapshotDtype snapshot_dtype = SnapshotDtype::kBank;  // how the forward stores the snapshot
constexpr int32_t kPoison = -12345;  // stamps and stamp snapshot cells before a pass writes them

// Largest errors over the cases, per output name.
struct Worst {
  std::string name;
  double abs = 0, rel = 0;
};
std::vector<Worst> worst;

void note_worst(const std::string& name, double a, double r) {
  for (auto& w : worst)
    if (w.name == name) {
      w.abs = std::max(w.abs, a);
      w.rel = std::max(w.rel, r);
      return;
    }
  worst.push_back({name, a, r});
}

template <typename T>
std::vector<float> as_float(const std::vector<T>& x) {
  std::vector<float> f(x.size());
  for (size_t i = 0; i < x.size(); ++i) f[i] = to_float(x[i]);
  return f;
}

// |got - ref| <= rtol * (|ref| + floor * scale) per cell, scale = the largest |ref| of the output: relative where
// values are not small next to the output's scale (sums that cancel have absolute errors on the scale of their
// terms). Reports the max abs error and the max relative error over cells with |ref| >= floor * scale.
int compare(const char* name, const std::vector<float>& got, const std::vector<float>& ref, bool bf16_path,
            bool verbose) {
  // Float32 reassociation; on a bfloat16 path (the value or its inputs went through a bfloat16 rounding of a
  // float32 that the two sides computed in another order: the forward write's fused multiply-add alone flips a
  // bank cell by one step now and then) a cell may also be off by about one bfloat16 step (2^-8 relative) of its
  // own value or, once such a flip has gone through later sums that cancel, of the output's scale.
  constexpr double rtol = 2e-4, floor = 1e-3, rtol_bf = 1.6e-2, floor_bf = 0.25;
  double scale = 0;
  for (float r : ref)
    if (std::isfinite(r)) scale = std::max(scale, double(std::fabs(r)));
  double max_abs = 0, max_rel = 0;
  size_t bad = 0, first_bad = 0, nan_bad = 0, first_nan = 0, loose = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const bool fg = std::isfinite(got[i]), fr = std::isfinite(ref[i]);
    if (!fg || !fr) {
      const bool same = (std::isnan(got[i]) && std::isnan(ref[i])) || got[i] == ref[i];
      if (!same && nan_bad++ == 0) first_nan = i;
      continue;
    }
    const double d = std::fabs(double(got[i]) - ref[i]), r = std::fabs(double(ref[i]));
    max_abs = std::max(max_abs, d);
    if (r >= floor * scale && r > 0) max_rel = std::max(max_rel, d / r);
    if (d <= rtol * (r + floor * scale)) continue;
    if (bf16_path && d <= rtol_bf * (r + floor_bf * scale)) {
      ++loose;
      continue;
    }
    if (bad++ == 0) first_bad = i;
  }
  note_worst(name, max_abs, max_rel);
  if (verbose)
    std::printf("    %-13s n=%-7zu scale=%-9.3g max_abs=%-9.3g max_rel=%-9.3g beyond float32 tolerance: %zu\n", name,
                ref.size(), scale, max_abs, max_rel, loose);
  else if (loose)
    std::printf("  note %s: %zu cells beyond the float32 tolerance, within one bfloat16 step\n", name, loose);
  // Such flips are rare (a handful of cells): a bfloat16 rounding that differs from round-to-nearest-even moves a
  // large share of the cells by one step, and fails here.
  const size_t loose_max = std::max<size_t>(4, ref.size() * 3 / 100);
  int fails = 0;
  if (loose > loose_max) {
    std::printf("  FAIL %s: %zu cells one bfloat16 step off, more than the %zu rounding flips allowed\n", name,
                loose, loose_max);
    ++fails;
  }
  if (bad) {
    std::printf("  FAIL %s: %zu cells past the tolerance (scale %g); first at %zu: %.9g vs %.9g\n", name, bad, scale,
                first_bad, got[first_bad], ref[first_bad]);
    ++fails;
  }
  if (nan_bad) {
    std::printf("  FAIL %s: %zu cells non-finite on one side only (unwritten?); first at %zu: %.9g vs %.9g\n", name,
                nan_bad, first_nan, got[first_nan], ref[first_nan]);
    ++fails;
  }
  return fails;
}

template <typename T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

// Integer outputs (stamps) must match exactly.
int compare_ints(const char* name, const std::vector<int32_t>& got, const std::vector<int32_t>& ref, bool verbose) {
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < ref.size(); ++i)
    if (got[i] != ref[i] && bad++ == 0) first = i;
  if (verbose) std::printf("    %-13s n=%-7zu cells that differ: %zu\n", name, ref.size(), bad);
  if (bad)
    std::printf("  FAIL %s: %zu cells differ; first at %zu: %d vs %d\n", name, bad, first, got[first], ref[first]);
  return bad != 0;
}

// Packed sequences of a case (kernels/chunk_steps.h StepSegments, as segments.chunk_segments gives them): per unit the segment
// running at the chunk's start (seg0) and each token's segment counted from it (local [C]); per stream the
// sequence's last segment (that of its last token).
struct Packing {
  std::vector<int32_t> local, seg0, last;
  int starts = 0, chunk_starts = 0, max_local = 0;  // segment starts, those on a chunk's first token; max of local
  int past_end = 0;  // streams whose last chunk's pad tokens lie past the sequence's end
};

Packing make_packing(const Case& c, const StepDims& dm, uint32_t seed) {
  std::mt19937 rng(seed ^ 0x5e9u);  // its own generator: the other inputs are drawn as without packing
  std::uniform_real_distribution<double> ud;
  const int64_t C = dm.C, T = dm.NC * C, pad = std::min<int64_t>(c.pad, C);
  Packing pk{std::vector<int32_t>(size_t(dm.units() * C)), std::vector<int32_t>(size_t(dm.units())),
             std::vector<int32_t>(size_t(dm.streams()))};
  std::vector<int32_t> seg(static_cast<size_t>(T));  // one stream's counter per token
  for (int64_t st = 0; st < dm.streams(); ++st) {
    // The last chunk's pad tokens: past the sequence's end (counter 0, local negative) in half the streams, padding
    // tokens inside the sequence in the others.
    const int64_t end = rng() % 2 ? T - pad : T;
    pk.past_end += end < T;
    int32_t counter = 0;
    for (int64_t i = 0; i < T; ++i) {
      const int64_t t = i % C;
      const double p_start = t == 0 ? 0.5 : c.segs / double(C);
      if (t < C - pad && ud(rng) < p_start) {  // padding starts no segment
        ++counter, ++pk.starts;
        pk.chunk_starts += t == 0;
      }
      seg[size_t(i)] = i < end ? counter : 0;
    }
    pk.last[size_t(st)] = end > 0 ? seg[size_t(end - 1)] : 0;
    for (int64_t ch = 0; ch < dm.NC; ++ch) {
      const int64_t u = dm.unit(st, ch);
      const int32_t seg0 = ch > 0 ? seg[size_t(ch * C - 1)] : 0;
      pk.seg0[size_t(u)] = seg0;
      for (int64_t t = 0; t < C; ++t) {
        pk.local[size_t(u * C + t)] = seg[size_t(ch * C + t)] - seg0;
        pk.max_local = std::max(pk.max_local, pk.local[size_t(u * C + t)]);
      }
    }
  }
  return pk;
}

// Phase 1's slot ids with packed sequences (segments.virtual_slots): s + K * local, out-of-range ids -1.
std::vector<int32_t> virtual_ids(const std::vector<int32_t>& idx, const std::vector<int32_t>& local, int64_t lanes,
                                 int64_t K) {
  std::vector<int32_t> out(idx.size());
  for (size_t i = 0; i < idx.size(); ++i)
    out[i] = idx[i] >= 0 && idx[i] < K ? int32_t(idx[i] + K * local[i / size_t(lanes)]) : -1;
  return out;
}

struct Phase1Out {
  std::vector<float> log_k, rex, cpe, k_eff, w, log_q, q_w, A, QK, minv;
  std::vector<int32_t> w_order, w_group, r_order, r_group, repeats;
};

struct ForwardOut {
  std::vector<float> y, delta, vg;  // y as float32 (from the bank's dtype) for the comparisons
  std::vector<float> bank;          // as float32 (bf16 banks widened) for the comparisons
  std::vector<float> snapshot;
  std::vector<int32_t> stamp, stamp_snapshot;  // packed sequences only
  std::vector<int32_t> link_k, link_q;         // with residuals
  bool initial_kept = true;                    // packed: the initial bank unchanged
};

struct BackwardOut {
  std::vector<float> dk_eff, dw, dcpe, dq_w, dA, dQK, dbeta, dv;
  std::vector<float> dbank;
  bool input_kept = false;  // the input bank unchanged
  std::vector<float> dinitial;  // packed sequences only
  bool stamps_zero = true, initial_kept = true;
};

template <typename BankT, typename GradT>
int run_typed(const Case& c, uint32_t seed, bool verbose) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  std::uniform_real_distribution<double> ud;
  const StepDims dm{c.V, c.NC, c.P, c.C, c.W, c.R, c.K, c.D};
  const int64_t N = dm.units(), C = c.C, W = c.W, R = c.R, K = c.K, D = c.D;
  // Phase 1's inputs, per unit [C, W] / [C, R], units in the steps' order (v, chunk, stream).
  auto ids = [&](int64_t L) {
    std::vector<int32_t> a(size_t(N * C * L));
    const int32_t bad[4] = {-1, int32_t(K), int32_t(K + 3), -7};
    for (int64_t u = 0; u < N; ++u)
      for (int64_t t = 0; t < C; ++t)
        for (int64_t l = 0; l < L; ++l) {
          int32_t v = K > 0 ? int32_t(rng() % uint64_t(K)) : -1;
          if (ud(rng) < c.invalid) v = bad[rng() % 4];
          if (t >= C - c.pad) v = -1;
          a[size_t((u * C + t) * L + l)] = v;
        }
    return a;
  };
  const std::vector<int32_t> k_idx = ids(W), q_idx = ids(R);
  std::vector<float> k_val(k_idx.size()), x(k_idx.size()), q_val(q_idx.size());
  for (auto& v : k_val) v = nd(rng);
  for (auto& v : q_val) v = nd(rng);
  for (auto& v : x) v = -std::log1p(std::exp(nd(rng)));
  std::vector<float> beta(size_t(N * C));
  std::vector<BankT> v(size_t(N * C * D));  // the values, in the bank's dtype as the op takes them
  std::vector<BankT> dy(v.size());          // the readings' cotangent, in the bank's dtype as the op passes it
  for (auto& b : beta) b = float(0.05 + 0.95 * ud(rng));
  for (auto& f : v) f = from_float<BankT>(nd(rng));
  for (auto& f : dy) f = from_float<BankT>(nd(rng));
  std::vector<BankT> bank0(size_t(dm.streams() * K * D));
  for (auto& b : bank0) b = from_float<BankT>(nd(rng));
  // A shared input (StepDims::input_streams): the streams' initial banks are its blocks, stream s block s % shared_in.
  StepDims dm_in = dm;
  dm_in.input_streams = c.shared_in;
  for (int64_t s = c.shared_in; s < (c.shared_in ? dm.streams() : 0); ++s)
    std::copy_n(bank0.begin() + (s % c.shared_in) * K * D, K * D, bank0.begin() + s * K * D);
  const std::vector<BankT> shared_input(bank0.begin(), bank0.begin() + c.shared_in * K * D);
  std::vector<GradT> dbank0(bank0.size());  // the cotangent of the final bank
  for (auto& b : dbank0) b = from_float<GradT>(nd(rng));

  const bool packed = c.segs > 0;
  const Packing pk = packed ? make_packing(c, dm, seed) : Packing{};
  const int64_t p1_slots = packed ? K * (C + 1) : K;  // segments.virtual_slot_count
  if (p1_slots >= (int64_t(1) << 31)) {
    std::printf("FAIL K * (C + 1) = %lld does not fit the int32 slot ids\n", (long long)p1_slots);
    return 1;
  }
  const std::vector<int32_t> p1_k_idx = packed ? virtual_ids(k_idx, pk.local, W, K) : k_idx;
  const std::vector<int32_t> p1_q_idx = packed ? virtual_ids(q_idx, pk.local, R, K) : q_idx;

  Phase1Out p;
  const size_t nw = k_idx.size(), nr = q_idx.size(), ncc = size_t(N * C * C);
  p.log_k.resize(nw), p.rex.resize(nw), p.cpe.resize(nw), p.k_eff.resize(nw), p.w.resize(nw);
  p.log_q.resize(nr), p.q_w.resize(nr), p.A.resize(ncc), p.QK.resize(ncc), p.minv.resize(ncc);
  p.w_order.resize(nw), p.w_group.resize(size_t(N * (C * W + 1))), p.r_order.resize(nr);
  p.r_group.resize(size_t(N * (C * R + 1))), p.repeats.resize(size_t(N));
  phase1_cpu({p1_k_idx.data(), k_val.data(), x.data(), p1_q_idx.data(), q_val.data(), p.log_k.data(), p.rex.data(),
              p.cpe.data(), p.k_eff.data(), p.w.data(), p.log_q.data(), p.q_w.data(), p.A.data(), p.QK.data(),
              p.w_order.data(), p.w_group.data(), p.r_order.data(), p.r_group.data(), p.repeats.data()},
             Phase1Dims{N, C, W, R, p1_slots});
  solve_cpu(p.A.data(), beta.data(), N, C, p.minv.data());
  // The steps get the real slot ids and Phase 1's groups of the (virtual) slots.
  const StepPhase1 p1{k_idx.data(), q_idx.data(), p.k_eff.data(), p.w.data(), p.cpe.data(), p.q_w.data(),
                      p.A.data(), p.QK.data(), p.w_order.data(), p.w_group.data(), p.r_order.data(),
                      p.r_group.data(), p.minv.data()};
  // Groups of the write map: the longest (the long-group path needs > kInlineEntries = 2).
  int32_t longest = 0;
  for (int64_t u = 0; u < N; ++u)
    for (int64_t g = 0; g < C * W; ++g) {
      const int32_t* grp = p.w_group.data() + u * (C * W + 1);
      longest = std::max(longest, grp[g + 1] - grp[g]);
    }

  const int64_t fwd_ws_floats = forward_workspace_floats(dm), bwd_ws_floats = backward_workspace_floats(dm);
  const size_t ncd = size_t(N * C * D), nstamp = size_t(dm.streams() * K);
  // The snapshot's rows: every chunk's write groups but the last's (StepDims::snapshot_entry).
  const int64_t snap_rows = dm.V * dm.snapshot_chunks() * dm.P * C * W;
  const size_t nsnap = size_t(snap_rows * snapshot_row_bytes(snapshot_dtype, D, sizeof(BankT)));
  const size_t nscale = snapshot_scaled(snapshot_dtype) ? size_t(snap_rows) : 0;
  // The snapshot decoded to float32 per element, [snap_rows, D].
  auto decoded = [&](const std::vector<uint8_t>& snap, const std::vector<float>& scale) {
    if (snapshot_dtype == SnapshotDtype::kBank) {
      std::vector<BankT> rows(snap.size() / sizeof(BankT));
      if (!snap.empty()) std::memcpy(rows.data(), snap.data(), snap.size());
      return as_float(rows);
    }
    const int64_t rows = snap.empty() ? 0 : snap_rows, bytes = snapshot_row_bytes(snapshot_dtype, D, 0);
    std::vector<float> out(size_t(rows * D));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t d = 0; d < D; ++d)
        out[size_t(r * D + d)] = snapshot_element(snapshot_dtype, snap.data() + r * bytes, d,
                                                  nscale ? scale[size_t(r)] : 0.f);
    return out;
  };
  // The packed sequences' arguments of one pass (null without packed sequences).
  auto segments_of = [&](StepSegments& sg, const std::vector<BankT>& initial, std::vector<int32_t>& stamp,
                         std::vector<int32_t>& stamp_snapshot, void* dinitial) -> const StepSegments* {
    sg = {pk.local.data(), pk.seg0.data(), initial.data(), stamp.data(),
          stamp_snapshot.empty() ? nullptr : stamp_snapshot.data(), dinitial};
    return packed ? &sg : nullptr;
  };
  // One forward; save: with residuals. cuda: the emulated CUDA kernels (the CPU ones under cpu-both), else the
  // CPU ones; the CUDA forward with residuals gets the result as a second buffer (filled with NaN: a fresh output
  // bank must write every row), the one without them the bank in place.
  std::vector<uint8_t> snap_cpu;
  std::vector<float> scale_cpu;
  auto forward = [&](bool cuda, bool save, int* rc) {
    std::vector<BankT> bank = bank0, initial = bank0, input = bank0;
    std::vector<uint8_t> snap(save ? nsnap : 0, 0xff);  // NaN in either float dtype
    std::vector<float> scale(save ? nscale : 0, kNaN);
    std::vector<BankT> y(ncd, from_float<BankT>(kNaN));
    ForwardOut o{{}, std::vector<float>(save ? ncd : 0, kNaN),
                 std::vector<float>(save ? ncd : 0, kNaN), {}, {}};
    o.stamp.assign(packed ? nstamp : 0, kPoison);
    o.stamp_snapshot.assign(packed && save ? nw : 0, kPoison);
    o.link_k.assign(save ? nw : 0, kPoison);
    o.link_q.assign(save ? nr : 0, kPoison);
    StepSegments sg;
    const StepSegments* segments = segments_of(sg, initial, o.stamp, o.stamp_snapshot, nullptr);
    const ForwardIO io{v.data(),
                       beta.data(),
                       y.data(),
                       save ? o.delta.data() : nullptr,
                       save ? o.vg.data() : nullptr,
                       save ? snap.data() : nullptr,
                       snapshot_dtype,
                       save && nscale ? scale.data() : nullptr,
                       save ? o.link_k.data() : nullptr,
                       save ? o.link_q.data() : nullptr};
    if (cuda && !cpu_both && c.shared_in) {  // the shared blocks as the input, a fresh result
      std::vector<float> ws(size_t(fwd_ws_floats), kNaN);
      std::fill(bank.begin(), bank.end(), from_float<BankT>(kNaN));
      *rc = forward_cuda<BankT>(dm_in, p1, io, shared_input.data(), bank.data(), ws.data(), nullptr, segments);
    } else if (cuda && !cpu_both) {
      std::vector<float> ws(size_t(fwd_ws_floats), kNaN);
      if (save) std::fill(bank.begin(), bank.end(), from_float<BankT>(kNaN));
      *rc = forward_cuda<BankT>(dm, p1, io, save ? input.data() : bank.data(), bank.data(), ws.data(), nullptr,
                                segments);
      if (save && !same_bits(input, bank0)) {
        std::printf("  FAIL forward_cuda changed its input bank\n");
        *rc = -1;
      }
    } else {
      forward_cpu<BankT>(dm, p1, io, bank.data(), segments);
    }
    if (!cuda && save) snap_cpu = snap, scale_cpu = scale;
    o.y = as_float(y);
    o.bank = as_float(bank);
    o.snapshot = decoded(snap, scale);
    o.initial_kept = same_bits(initial, bank0);
    return o;
  };
  // One backward on the input bank and the CPU forward's stamps and residuals (res); zero_cotangent: the final
  // bank's cotangent is zero (the CUDA loops get no buffer for it, the CPU loops zeros).
  auto backward = [&](bool cuda, const ForwardOut& res, int* rc, bool zero_cotangent = false) {
    std::vector<BankT> bank = bank0, initial = bank0;
    std::vector<GradT> dbank = dbank0, dinitial(packed ? dbank0.size() : 0, from_float<GradT>(0.f));
    if (zero_cotangent) std::fill(dbank.begin(), dbank.end(), from_float<GradT>(0.f));
    std::vector<int32_t> stamp = res.stamp, stamp_snapshot = res.stamp_snapshot;
    // kernel_path.py: the final bank's rows of the stream's last segment are the working bank's, the others the
    // initial bank's; the cotangent goes to the one the row came from.
    for (size_t row = 0; row < stamp.size(); ++row)
      if (stamp[row] != pk.last[row / size_t(K)])
        for (size_t d = 0; d < size_t(D); ++d) std::swap(dbank[row * D + d], dinitial[row * D + d]);
    StepSegments sg;
    const StepSegments* segments = segments_of(sg, initial, stamp, stamp_snapshot, dinitial.data());
    const size_t cw = nw, cr = nr;
    BackwardOut o{std::vector<float>(cw, kNaN),  std::vector<float>(cw, kNaN),        std::vector<float>(cw, kNaN),
                  std::vector<float>(cr, kNaN),  std::vector<float>(ncc, kNaN),       std::vector<float>(ncc, kNaN),
                  std::vector<float>(size_t(N * C), kNaN), {}, {}};
    std::vector<BankT> dv(ncd, from_float<BankT>(kNaN));  // v's cotangent, in v's dtype (the bank's)
    const BackwardIO io{beta.data(),     dy.data(),       res.delta.data(), res.vg.data(), snap_cpu.data(),
                        o.dk_eff.data(),  o.dw.data(),     o.dcpe.data(),    o.dq_w.data(),  o.dA.data(),
                        o.dQK.data(),     o.dbeta.data(),  dv.data(),        snapshot_dtype,
                        nscale ? scale_cpu.data() : nullptr, res.link_k.data(), res.link_q.data()};
    if (cuda && !cpu_both) {
      // Without packed sequences the gradient bank comes back in a second buffer (filled with NaN: every row must
      // be written), as kernel_path.py calls it; with them in place.
      std::vector<float> ws(size_t(bwd_ws_floats), kNaN);
      const std::vector<GradT> cotangent = dbank;
      if (!packed) std::fill(dbank.begin(), dbank.end(), from_float<GradT>(kNaN));
      const GradT* in = packed ? dbank.data() : zero_cotangent ? nullptr : cotangent.data();
      // With a shared input the backward reads the shared blocks too (its gradient banks stay per stream).
      *rc = c.shared_in ? backward_cuda<BankT, GradT>(dm_in, p1, io, shared_input.data(), in, dbank.data(), ws.data(),
                                                      nullptr, segments)
                        : backward_cuda<BankT, GradT>(dm, p1, io, bank.data(), in, dbank.data(), ws.data(), nullptr,
                                                      segments);
      if (!packed && !zero_cotangent && !same_bits(cotangent, dbank0)) {
        std::printf("  FAIL backward_cuda changed the cotangent\n");
        *rc = -1;
      }
    } else {
      backward_cpu<BankT, GradT>(dm, p1, io, bank.data(), dbank.data(), segments);
    }
    o.dbank = as_float(dbank);
    o.dv = as_float(dv);
    o.input_kept = same_bits(bank, bank0);
    o.dinitial = as_float(dinitial);
    o.stamps_zero = std::all_of(stamp.begin(), stamp.end(), [](int32_t s) { return s == 0; });
    o.initial_kept = same_bits(initial, bank0);
    return o;
  };

  int fails = 0, rc = 0;
  const bool bf = sizeof(BankT) == 2;
  // A pass that returned an error fails once; its outputs are not compared.
  auto ran = [&](const char* what) {
    if (rc) std::printf("  FAIL %s returned %d; its outputs not compared\n", what, rc);
    fails += rc != 0;
    return std::exchange(rc, 0) == 0;
  };
  auto expect = [&](bool ok, const char* what, const char* failure) {
    if (ok) return;
    std::printf("  FAIL %s %s\n", what, failure);
    ++fails;
  };
  auto kept_initial = [&](const char* what, bool kept) { expect(kept, what, "changed the initial bank"); };
  auto restored = [&](const char* what, const BackwardOut& o) {
    expect(o.input_kept, what, "changed the input bank");
    expect(o.stamps_zero, what, "did not restore the stamps to zero");
    kept_initial(what, o.initial_kept);
  };
  const ForwardOut fc = forward(false, true, &rc);
  kept_initial("forward_cpu", fc.initial_kept);
  if (verbose) std::printf("  forward (residuals saved)\n");
  const ForwardOut fg = forward(true, true, &rc);
  const bool fg_ran = ran("forward_cuda (residuals saved)");
  if (fg_ran) {
    fails += compare("y", fg.y, fc.y, bf, verbose);
    fails += compare("delta", fg.delta, fc.delta, bf, verbose);
    fails += compare("vg", fg.vg, fc.vg, bf, verbose);
    fails += compare("snapshot", fg.snapshot, fc.snapshot, bf, verbose);
    fails += compare("bank", fg.bank, fc.bank, bf, verbose);
    fails += compare_ints("stamp", fg.stamp, fc.stamp, verbose && packed);
    fails += compare_ints("stamp_snapshot", fg.stamp_snapshot, fc.stamp_snapshot, verbose && packed);
    fails += compare_ints("link_k", fg.link_k, fc.link_k, verbose);
    fails += compare_ints("link_q", fg.link_q, fc.link_q, verbose);
    kept_initial("forward_cuda", fg.initial_kept);
  }
  if (verbose) std::printf("  forward (no residuals)\n");
  const ForwardOut fn = forward(true, false, &rc);
  if (ran("forward_cuda (no residuals)")) {
    fails += compare("y (nograd)", fn.y, fc.y, bf, verbose);
    fails += compare("bank (nograd)", fn.bank, fc.bank, bf, verbose);
    fails += compare_ints("stamp (nograd)", fn.stamp, fc.stamp, verbose && packed);
    kept_initial("forward_cuda (no residuals)", fn.initial_kept);
    if (fg_ran && (!same_bits(fn.y, fg.y) || !same_bits(fn.bank, fg.bank) || !same_bits(fn.stamp, fg.stamp))) {
      std::printf("  FAIL the CUDA forward without residuals differs from the one with them\n");
      ++fails;
    }
  }
  // The no-grad forward in slabs of one chunk (SlabCarry, as kernel_path.py's no-grad forward calls it): every call
  // gets the input bank and the carried result (filled with NaN: the slabs must write or copy every row) and first
  // steps (garbage until the first slab fills them); the readings and the final bank must be the one-call forward's
  // bits. The chunks of one problem (V = 1) are contiguous: a slab's arrays are the whole arrays' from its chunk.
  if (!packed && dm.V == 1 && !cpu_both && fg_ran) {
    std::vector<BankT> bank(bank0.size(), from_float<BankT>(kNaN)), y(ncd, from_float<BankT>(kNaN));
    std::vector<uint32_t> first(size_t(dm.streams() * K), 0x5a5a5a5au);
    StepDims ds = c.shared_in ? dm_in : dm;
    ds.NC = 1;
    std::vector<float> ws(size_t(forward_workspace_floats(ds)), kNaN);
    const BankT* input = c.shared_in ? shared_input.data() : bank0.data();
    int slab_rc = 0;
    for (int64_t c0 = 0; c0 < dm.NC && !slab_rc; ++c0) {
      const int64_t u = c0 * dm.P;  // the slab's first unit
      const StepPhase1 ps{k_idx.data() + u * C * W, q_idx.data() + u * C * R, p.k_eff.data() + u * C * W,
                          p.w.data() + u * C * W, p.cpe.data() + u * C * W, p.q_w.data() + u * C * R,
                          p.A.data() + u * C * C, p.QK.data() + u * C * C, p.w_order.data() + u * C * W,
                          p.w_group.data() + u * (C * W + 1), p.r_order.data() + u * C * R,
                          p.r_group.data() + u * (C * R + 1), p.minv.data() + u * C * C};
      const ForwardIO io{v.data() + u * C * D, beta.data() + u * C, y.data() + u * C * D};
      const SlabCarry slab{first.data(), c0 == 0, c0 + 1 == dm.NC};
      slab_rc = forward_cuda<BankT>(ds, ps, io, input, bank.data(), ws.data(), nullptr, nullptr, &slab);
    }
    if (slab_rc) {
      std::printf("  FAIL forward_cuda in slabs returned %d\n", slab_rc);
      ++fails;
    } else if (!same_bits(as_float(y), fg.y) || !same_bits(as_float(bank), fg.bank)) {
      std::printf("  FAIL the CUDA forward in slabs of one chunk differs from the one-call forward\n");
      ++fails;
    }
  }
  // The backward reads the CPU forward's bank and residuals: a bfloat16 step can come from the gradient bank only.
  const bool gbf = sizeof(GradT) == 2;
  auto compare_backward = [&](const BackwardOut& bg, const BackwardOut& bc, const std::string& what) {
    fails += compare(("dk_eff" + what).c_str(), bg.dk_eff, bc.dk_eff, gbf, verbose);
    fails += compare(("dw" + what).c_str(), bg.dw, bc.dw, gbf, verbose);
    fails += compare(("dcpe" + what).c_str(), bg.dcpe, bc.dcpe, gbf, verbose);
    fails += compare(("dq_w" + what).c_str(), bg.dq_w, bc.dq_w, gbf, verbose);
    fails += compare(("dA" + what).c_str(), bg.dA, bc.dA, gbf, verbose);
    fails += compare(("dQK" + what).c_str(), bg.dQK, bc.dQK, false, verbose);
    fails += compare(("dbeta" + what).c_str(), bg.dbeta, bc.dbeta, gbf, verbose);
    fails += compare(("dv" + what).c_str(), bg.dv, bc.dv, gbf || sizeof(BankT) == 2, verbose);
    fails += compare(("dbank" + what).c_str(), bg.dbank, bc.dbank, gbf, verbose);
    if (packed) fails += compare(("dinitial" + what).c_str(), bg.dinitial, bc.dinitial, gbf, verbose);
    restored(("backward_cuda" + what).c_str(), bg);
  };
  if (verbose) std::printf("  backward (on the CPU forward's residuals)\n");
  const BackwardOut bc = backward(false, fc, &rc), bg = backward(true, fc, &rc);
  restored("backward_cpu", bc);
  if (ran("backward_cuda")) compare_backward(bg, bc, "");
  if (!packed) {  // a zero cotangent: no buffer on the CUDA side
    if (verbose) std::printf("  backward (zero cotangent)\n");
    const BackwardOut bc0 = backward(false, fc, &rc, true), bg0 = backward(true, fc, &rc, true);
    if (ran("backward_cuda (zero cotangent)")) compare_backward(bg0, bc0, " (zero cotangent)");
  }
  std::printf("%s V%lld NC%lld P%lld C%lld W%lld R%lld K%lld D%lld bank=%s grad=%s invalid=%.2f pad=%d "
              "longest_group=%d seed=%u",
              fails ? "FAIL" : "ok  ", (long long)c.V, (long long)c.NC, (long long)c.P, (long long)C, (long long)W,
              (long long)R, (long long)K, (long long)D, c.bf16_bank ? "bf16" : "f32", c.bf16_grad ? "bf16" : "f32",
              c.invalid, c.pad, longest, seed);
  if (packed)
    std::printf(" packed: segs=%.2f starts=%d (%d on a chunk's first token) max_local=%d past_end=%d", c.segs,
                pk.starts, pk.chunk_starts, pk.max_local, pk.past_end);
  std::printf("\n");
  std::fflush(stdout);
  return fails;
}

// The CUDA loops' launches, and those with programmatic dependent launch (kernels/chunk_steps.h kChunkStepsPdl).
void print_launches() {
  std::printf("launches: %ld, with programmatic dependent launch: %ld\n", emu::launches, emu::pdl_launches);
}

int run_case(const Case& c, uint32_t seed, bool verbose) {
  if (!c.bf16_bank) return run_typed<float, float>(c, seed, verbose);
  if (!c.bf16_grad) return run_typed<bf16, float>(c, seed, verbose);
  return run_typed<bf16, bf16>(c, seed, verbose);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "cpu-both") {
    cpu_both = true;
    --argc, ++argv;
    std::printf("cpu-both: the CPU loops on both sides (a check of this harness, not of the CUDA code)\n");
  }
  if (argc > 1 && std::string(argv[1]).rfind("snapshot=", 0) == 0) {
    snapshot_dtype = static_cast<SnapshotDtype>(std::atoi(argv[1] + 9));
    --argc, ++argv;
    std::printf("snapshot_dtype %d\n", static_cast<int>(snapshot_dtype));
  }
  // {V, NC, P, C, W, R, K, D, bf16 bank, bf16 grad, invalid, pad[, segs]}. D picks the column path (vec_of: D % 8 == 0
  // -> 8, D % 4 == 0 -> 4, else 1); small K against C * W gives long write groups (> 2 entries) and repeated reads.
  const std::vector<Case> cases = {
      {1, 3, 2, 8, 3, 2, 6, 16, false, false, 0.1, 1},    // VEC 8, long groups
      {2, 2, 1, 5, 2, 3, 40, 12, false, false, 0.1, 0},   // VEC 4, C % 4 != 0, V > 1, mostly short groups
      {1, 2, 2, 16, 4, 4, 5, 7, false, false, 0.1, 2},    // VEC 1, long groups
      {1, 3, 2, 8, 3, 2, 6, 16, true, false, 0.1, 1},     // bf16 bank, f32 gradient bank
      {1, 3, 2, 8, 3, 2, 6, 16, true, true, 0.1, 1},      // bf16 bank and gradient bank (16-byte rows)
      {2, 2, 1, 5, 2, 3, 7, 12, true, true, 0.1, 0},      // bf16, VEC 4 (8-byte rows)
      {1, 2, 2, 16, 4, 4, 5, 7, true, false, 0.1, 0},     // bf16, VEC 1
      {1, 2, 2, 16, 4, 4, 5, 7, true, true, 0.2, 0},      // bf16/bf16, VEC 1
      {1, 2, 1, 40, 1, 1, 100, 24, false, false, 0.05, 3},  // C > 32 (two row tiles of the dots), singletons
      {1, 2, 1, 5, 3, 3, 3, 264, false, false, 0.1, 0},   // several segments per lane (VEC 8), every group long
      {1, 2, 1, 5, 3, 3, 3, 264, true, true, 0.1, 0},
      {1, 2, 1, 4, 2, 2, 5, 2056, false, false, 0.0, 0},  // two column tiles of the gathers, 65 slices
      {1, 3, 3, 8, 1, 1, 1, 20, false, false, 0.0, 0},    // K = 1: every entry on one slot
      {1, 2, 2, 6, 2, 2, 4, 33, false, false, 0.5, 2},    // half the ids out of range
      {1, 1, 1, 516, 1, 1, 300, 8, false, false, 0.05, 0},  // more 4 x 4 tiles than solve threads (1032 > 1024)
      // Packed sequences (segs: mean segment starts per chunk past its first token; a chunk's first token starts
      // one half of the time). Small K for long groups within a segment.
      {1, 3, 2, 8, 3, 2, 6, 16, false, false, 0.1, 1, 2.0},   // 15: VEC 8, long groups, padding
      {2, 3, 2, 8, 3, 2, 6, 16, true, false, 0.1, 1, 2.0},    // bf16 bank, f32 gradient bank, V > 1
      {1, 3, 2, 8, 3, 2, 6, 16, true, true, 0.1, 1, 2.0},     // bf16 bank and gradient bank
      {1, 4, 2, 16, 4, 4, 3, 7, false, false, 0.2, 2, 4.0},   // VEC 1, many segments, K = 3
      {2, 2, 1, 5, 2, 3, 7, 12, true, true, 0.1, 0, 1.0},     // bf16, VEC 4
      {1, 3, 2, 6, 2, 2, 4, 33, false, false, 0.5, 2, 1.0},   // half the ids out of range
      {1, 2, 2, 6, 2, 2, 5, 8, false, false, 0.1, 0, 6.0},    // every token starts a segment (local up to C)
      {1, 2, 1, 40, 1, 1, 100, 24, false, false, 0.05, 3, 3.0},  // C > 32, singletons
      {1, 3, 3, 8, 1, 1, 1, 20, false, false, 0.0, 0, 1.0},   // K = 1
      {1, 2, 1, 5, 3, 3, 3, 264, true, true, 0.1, 0, 1.5},    // several segments per lane (VEC 8), bf16
      {1, 3, 2, 12, 3, 3, 4, 16, true, false, 0.1, 4, 0.5},   // few segments: long groups across chunks
      // 26-27, no packed sequences: 64 < C <= 128, the in-loop solves staged (the dy part not)
      {1, 2, 2, 100, 2, 2, 60, 16, true, true, 0.05, 2},
      {1, 2, 1, 128, 3, 2, 90, 12, false, false, 0.05, 0},
      // 28-29: the backward's group tables hold table_chunks (kernels/chunk_steps.h) of more chunks: NC 5 holds 2, the
      // batches {4}, {2, 3}, {0, 1}; NC 6 holds 2, three whole batches. V > 1 (the ring's streams of both problems).
      {2, 5, 2, 6, 3, 2, 8, 8, true, true, 0.1, 1},
      {2, 6, 2, 6, 3, 2, 8, 8, false, false, 0.1, 1, 1.5},  // packed sequences
      // 30-33: the forward's input bank shared by the streams (shared_in blocks; B*H streams of H heads)
      {2, 3, 4, 8, 3, 2, 6, 16, false, false, 0.1, 1, 0, 2},  // VEC 8, V > 1, two heads
      {1, 3, 6, 5, 2, 3, 40, 12, true, true, 0.1, 0, 0, 3},   // bf16, VEC 4, mostly untouched rows
      {1, 2, 4, 16, 4, 4, 5, 7, true, false, 0.2, 2, 0, 1},   // VEC 1, one block for every stream
      {2, 2, 3, 6, 2, 2, 50, 16, false, false, 0.0, 0, 0, 3}, // V > 1: each problem's streams read the one input
      // 34: C > 64 not a multiple of 4: the in-loop solves' four-row tiles, the last one's rows past C but its first
      {1, 2, 2, 101, 3, 2, 70, 40, true, false, 0.05, 3},
      // 35: bf16 rows of several of the forward write's batches (VEC 8: 1024 columns a batch), the last one partial
      {1, 3, 2, 4, 2, 2, 6, 2056, true, true, 0.1, 0},
      // 36-40: more write and read lanes than a block's warps (kOwnerWarps 8), so that a warp takes several groups in
      // turn: the forward write's batches in flight across groups (36: rows of several batches; 37: float32 VEC 8,
      // 32-byte segments). A token's lanes split over blocks (owner_split: 2 from 32 lanes, 4 from 64): 38 over
      // four; 39 more lanes than a round of the token's warps' table rows (32 x 32), the next round loaded mid-walk;
      // 40 over two and three (W 40, R 48) with long groups whose entries lie in other blocks of the token.
      {1, 3, 2, 6, 20, 20, 1000, 2056, true, true, 0.1, 0},
      {1, 2, 2, 4, 20, 18, 50, 24, false, false, 0.1, 1},
      {1, 2, 1, 3, 300, 270, 2000, 8, true, false, 0.05, 0},
      {1, 2, 1, 2, 1030, 1030, 8192, 8, true, true, 0.6, 0},
      {1, 3, 2, 6, 40, 48, 90, 16, true, true, 0.1, 1},
      // 41-42: the forward's products on tensor cores (C a multiple of 16) over two slices, the second partial: 41
      // an odd count of 16-row tiles (mma_tri_product's middle one alone), float32 rows with D % 4 != 0; 42 bfloat16.
      {1, 2, 2, 48, 3, 2, 200, 41, false, false, 0.05, 0},
      {1, 2, 1, 64, 2, 2, 150, 36, true, false, 0.05, 1},
  };
  if (argc > 1 && std::string(argv[1]) == "shape") {  // shape V NC P C W R K D BANK GRAD INVALID PAD [SEED [SEGS]]
    if (argc < 14) {
      std::fprintf(stderr, "shape V NC P C W R K D f32|bf16 f32|bf16 INVALID PAD [SEED [SEGS]]\n");
      return 2;
    }
    auto i = [&](int k) { return int64_t(std::atoll(argv[k])); };
    const Case c{i(2),  i(3),  i(4),  i(5), i(6), i(7), i(8), i(9), std::string(argv[10]) == "bf16",
                 std::string(argv[11]) == "bf16", std::atof(argv[12]), int(i(13)), argc > 15 ? std::atof(argv[15]) : 0};
    return run_case(c, argc > 14 ? uint32_t(i(14)) : 1u, true) != 0;
  }
  if (argc > 1 && std::string(argv[1]) == "random") {
    const uint32_t seed = argc > 2 ? std::atoi(argv[2]) : 1;
    std::mt19937 r(seed), r_packed(seed ^ 0x5e9u);  // packed or not on its own: the shapes are drawn as before
    const int count = argc > 3 ? std::atoi(argv[3]) : 10;
    const int64_t Ds[] = {1, 3, 4, 7, 8, 12, 16, 20, 33, 40, 64};
    int fails = 0;
    for (int i = 0; i < count; ++i) {
      Case c{int64_t(1 + r() % 2), int64_t(1 + r() % 3), int64_t(1 + r() % 2), int64_t(1 + r() % 20),
             int64_t(1 + r() % 4), int64_t(1 + r() % 4), int64_t(1 + r() % 30), Ds[r() % 11], r() % 2 == 0,
             r() % 2 == 0, (r() % 3) * 0.1, 0};
      c.bf16_grad = c.bf16_grad && c.bf16_bank;
      c.pad = int(r() % 3 == 0 ? r() % c.C : 0);
      if (r_packed() % 3 == 0) c.segs = 0.5 * (1 + r_packed() % 6);  // a third packed, 0.5 to 3 starts per chunk
      fails += run_case(c, r(), false) ? 1 : 0;
    }
    std::printf("%d failing cases\n", fails);
    for (auto& w : worst) std::printf("  max over cases: %-14s abs %-10.3g rel %.3g\n", w.name.c_str(), w.abs, w.rel);
    print_launches();
    return fails != 0;
  }
  // CASE: an index or a comma-separated list of them (all cases by default); one case prints its errors per output.
  std::vector<int> only;
  if (argc > 1)
    for (const char* p = argv[1]; *p; ++p) {
      only.push_back(std::atoi(p));
      while (*p && *p != ',') ++p;
      if (!*p) break;
    }
  for (int i : only)
    if (i < 0 || i >= int(cases.size())) {
      std::fprintf(stderr, "no case %d (0..%zu)\n", i, cases.size() - 1);
      return 2;
    }
  const uint32_t seed = argc > 2 ? std::atoi(argv[2]) : 4321;
  int fails = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    if (!only.empty() && std::find(only.begin(), only.end(), int(i)) == only.end()) continue;
    fails += run_case(cases[i], seed + uint32_t(i), only.size() == 1) ? 1 : 0;
  }
  std::printf("%d failing cases\n", fails);
  for (auto& w : worst) std::printf("  max over cases: %-14s abs %-10.3g rel %.3g\n", w.name.c_str(), w.abs, w.rel);
  print_launches();
  return fails != 0;
}
