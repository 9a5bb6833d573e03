// Phase 1 and its backward on the CPU. See phase1.h and docs/DESIGN.md "Phase 1",
// "Phase-1 backward".
//
// Per unit:
//  1. Every valid write entry (t, n) and read entry (t, m) gets the 64-bit key
//     (slot << 32) | seq with seq = t * (W + R) + lane, where write lanes are 0..W-1
//     and read lanes W..W+R-1. The keys are unique, so std::sort orders the entries
//     exactly by (slot, token, write-before-read, lane): the stable order of SPEC 1.3.
//  2. A *group* is the run of sorted entries of one slot. In the group:
//     - a write entry whose predecessor is a write of the same token is a repeat
//       (same slot, same token, later lane): its gate is 0;
//     - log_k / log_q: inclusive prefix sum of the gates (reads add nothing);
//     - rex: exclusive suffix sum, computed by its own backward scan;
//     - cpe: exp of the group total (the last prefix value).
//  3. Pair sums. Inside a group, log_k is constant over the writes of one token
//     (only the first of them has a gate) and log_q over the reads of one token, so
//     the entries of one (token, kind) form a *run* with one gate (a write run's
//     head gate, 0 for a read run) and the sum of its weights. Each run meets the
//     earlier write runs of its group:
//       write run a, earlier write run b:  A[t_a, t_b]  += K_a K_b exp(X_ab)
//       read run r,  earlier write run b:  QK[t_r, t_b] += Q_r K_b exp(X_rb)
//     which is the entry-pair sum of the definition, factored per run. X_ab = L_a - L_b
//     is summed directly over the gates of the runs after b up to a, never taken as
//     the difference of two prefix sums: with a gate of -inf that difference is
//     -inf - -inf = NaN, and with gates of -1e30 it cancels every digit of the small
//     part. Cells are accumulated in (slot, run) order: fixed by the input.
//  4. The CSR group maps for writes and reads fall out of the same sorted walk.
//
// The backward redoes steps 1 and 3's run split with the same code and walks each
// group in sorted order:
//  - the pair walk of step 3 gives, per run, the gradient of each of its weights
//    (the same for every entry of the run) and of its log value;
//  - per entry: the chain rule through k_eff, w, q_w and cpe;
//  - the gate of a non-repeat write at sorted position p gets the suffix sum from p
//    of the log_k / log_q gradients (entries at or after its token), the prefix sum
//    before p of the rex gradients (writes of earlier tokens) and the gradient of
//    the group total: one backward and one forward scan.
// All arithmetic is float32, in a fixed order: the results are bitwise reproducible
// and independent of how units are split over threads.
#include "kernels/phase1.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

#include "kernels/parallel.h"

namespace sdm {
namespace {

struct Run {
  int32_t token;
  bool is_write;
  float sum;   // sum of the weights of the run's entries, in lane order
  float gate;  // the gate of its head (write run), 0 (read run)
  // Backward only: gradient of each weight of the run from the pair terms, and of
  // the run's log value (log_k or log_q, constant over the run).
  float dsum;
  float dlog;
};


struct Entry {
  int64_t t;
  bool is_write;
  int64_t id;  // t * W + n for a write, t * R + m for a read
};

inline Entry decode(uint64_t key, const Phase1Dims& d) {
  const int64_t seq = static_cast<int64_t>(key & 0xffffffffu);
  const int64_t t = seq / d.lanes(), lane = seq % d.lanes();
  if (lane < d.W) return Entry{t, true, t * d.W + lane};
  return Entry{t, false, t * d.R + (lane - d.W)};
}

// Step 1: the sorted keys of the unit's valid entries.
void sort_entries(const int32_t* ki, const int32_t* qi, const Phase1Dims& d,
                  std::vector<uint64_t>& keys) {
  const int64_t C = d.C, W = d.W, R = d.R, K = d.K, S = d.lanes();
  keys.clear();
  for (int64_t t = 0; t < C; ++t) {
    for (int64_t n = 0; n < W; ++n) {
      const int64_t slot = ki[t * W + n];
      if (slot >= 0 && slot < K) {
        keys.push_back((static_cast<uint64_t>(slot) << 32) |
                       static_cast<uint64_t>(t * S + n));
      }
    }
    for (int64_t m = 0; m < R; ++m) {
      const int64_t slot = qi[t * R + m];
      if (slot >= 0 && slot < K) {
        keys.push_back((static_cast<uint64_t>(slot) << 32) |
                       static_cast<uint64_t>(t * S + W + m));
      }
    }
  }
  std::sort(keys.begin(), keys.end());
}

// End (exclusive) of the group that starts at sorted position `begin`.
inline int64_t group_end(const std::vector<uint64_t>& keys, int64_t begin) {
  const int64_t E = static_cast<int64_t>(keys.size());
  const uint64_t slot = keys[begin] >> 32;
  int64_t end = begin + 1;
  while (end < E && (keys[end] >> 32) == slot) ++end;
  return end;
}

// Whether the write at sorted position p of the group starting at `begin` is a
// repeat: its predecessor in the group is a write of the same token.
inline bool is_repeat(const std::vector<uint64_t>& keys, int64_t begin, int64_t p,
                      const Phase1Dims& d) {
  if (p == begin) return false;
  const Entry prev = decode(keys[p - 1], d);
  return prev.is_write && prev.t == decode(keys[p], d).t;
}

// Step 3's runs: appends an entry (in sorted order) to the runs of its group.
// `gate` is the entry's gate (used when it starts a run: 0 for reads).
inline void add_to_runs(std::vector<Run>& runs, int64_t t, bool is_write, float weight,
                        float gate) {
  if (!runs.empty() && runs.back().token == t && runs.back().is_write == is_write) {
    runs.back().sum += weight;
  } else {
    runs.push_back(Run{static_cast<int32_t>(t), is_write, weight, gate, 0.0f, 0.0f});
  }
}

// Step 3's walk: f(a, b, x_ab) for every run a and every earlier write run b of the
// group, a ascending, then b descending, with x_ab = gate(a) + the gates of the runs
// strictly between b and a, summed from a down to b.
template <typename F>
inline void for_each_pair(std::vector<Run>& runs, F f) {
  const int64_t n_runs = static_cast<int64_t>(runs.size());
  for (int64_t ra = 0; ra < n_runs; ++ra) {
    float x = runs[ra].gate;
    for (int64_t rb = ra - 1; rb >= 0; --rb) {
      if (!runs[rb].is_write) continue;  // a read run's gate is 0
      f(runs[ra], runs[rb], x);
      x += runs[rb].gate;
    }
  }
}

// Units per thread: about 2^15 elementary steps per thread at least.
inline int64_t units_per_thread(const Phase1Dims& d) {
  return std::max<int64_t>(1, (int64_t{1} << 15) /
                                  std::max<int64_t>(1, d.C * (d.W + d.R + d.C)));
}

// ---------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------

struct Scratch {
  std::vector<uint64_t> keys;
  std::vector<float> xe;  // gate of each sorted entry (0 for reads and repeats)
  std::vector<Run> runs;

  explicit Scratch(size_t entries) : xe(entries) {
    keys.reserve(entries);
    runs.reserve(entries);
  }
};

void phase1_unit(const Phase1Arrays& all, const Phase1Dims& d, int64_t u, Scratch& s) {
  const int64_t C = d.C, W = d.W, R = d.R;
  const int64_t CW = C * W, CR = C * R;
  const Phase1Arrays a = all.unit(u, C, W, R);

  // Values of invalid entries (and the starting point of everything else).
  std::fill(a.log_k, a.log_k + CW, 0.0f);
  std::fill(a.rex, a.rex + CW, 0.0f);
  std::fill(a.cpe, a.cpe + CW, 1.0f);
  std::fill(a.k_eff, a.k_eff + CW, 0.0f);
  std::fill(a.w, a.w + CW, 0.0f);
  std::fill(a.w_order, a.w_order + CW, int32_t{-1});
  std::fill(a.log_q, a.log_q + CR, 0.0f);
  std::fill(a.q_w, a.q_w + CR, 0.0f);
  std::fill(a.r_order, a.r_order + CR, int32_t{-1});
  std::fill(a.A, a.A + C * C, 0.0f);
  std::fill(a.QK, a.QK + C * C, 0.0f);

  // 1. Keys of the valid entries, sorted.
  std::vector<uint64_t>& keys = s.keys;
  sort_entries(a.k_idx, a.q_idx, d, keys);

  const int64_t E = static_cast<int64_t>(keys.size());
  float* xe = s.xe.data();
  std::vector<Run>& runs = s.runs;

  int32_t n_w = 0, n_r = 0;  // positions in w_order / r_order
  int64_t g_w = 0, g_r = 0;  // number of write / read groups so far
  int32_t n_repeats = 0;

  for (int64_t begin = 0, end = 0; begin < E; begin = end) {
    end = group_end(keys, begin);

    // 2a. Forward walk: repeats, inclusive prefix sums, CSR maps.
    bool group_has_write = false, group_has_read = false;
    float run = 0.0f;
    for (int64_t p = begin; p < end; ++p) {
      const Entry e = decode(keys[p], d);
      if (e.is_write) {
        const bool repeat = is_repeat(keys, begin, p, d);
        const float g = repeat ? 0.0f : a.x[e.id];
        n_repeats += repeat ? 1 : 0;
        xe[p] = g;
        run += g;
        a.log_k[e.id] = run;
        if (!group_has_write) {
          a.w_group[g_w++] = n_w;
          group_has_write = true;
        }
        a.w_order[n_w++] = static_cast<int32_t>(e.id);
      } else {
        xe[p] = 0.0f;
        a.log_q[e.id] = run;
        if (!group_has_read) {
          a.r_group[g_r++] = n_r;
          group_has_read = true;
        }
        a.r_order[n_r++] = static_cast<int32_t>(e.id);
      }
    }
    const float decay = std::exp(run);

    // 2b. Backward walk: exclusive suffix sums (rex).
    float suffix = 0.0f;
    for (int64_t p = end - 1; p >= begin; --p) {
      const Entry e = decode(keys[p], d);
      if (e.is_write) {
        a.rex[e.id] = suffix;
        suffix += xe[p];
      }
    }

    // 2c. Per-entry values and the runs of the group.
    runs.clear();
    for (int64_t p = begin; p < end; ++p) {
      const Entry e = decode(keys[p], d);
      float weight;
      if (e.is_write) {
        weight = a.k_val[e.id];
        a.cpe[e.id] = decay;
        a.k_eff[e.id] = weight * std::exp(a.log_k[e.id]);
        a.w[e.id] = weight * std::exp(a.rex[e.id]);
      } else {
        weight = a.q_val[e.id];
        a.q_w[e.id] = weight * std::exp(a.log_q[e.id]);
      }
      add_to_runs(runs, e.t, e.is_write, weight, xe[p]);
    }

    // 3. Pair sums: each run meets the earlier write runs of its group.
    for_each_pair(runs, [&](const Run& ar, const Run& br, float x) {
      float* row = (ar.is_write ? a.A : a.QK) + static_cast<int64_t>(ar.token) * C;
      row[br.token] += ar.sum * br.sum * std::exp(x);
    });
  }

  // 4. Close the CSR offsets: w_group[G] = n_valid and every later offset too.
  for (int64_t g = g_w; g <= CW; ++g) a.w_group[g] = n_w;
  for (int64_t g = g_r; g <= CR; ++g) a.r_group[g] = n_r;
  *a.repeats = n_repeats;
}

// ---------------------------------------------------------------------------
// Backward
// ---------------------------------------------------------------------------

struct BwdScratch {
  std::vector<uint64_t> keys;
  std::vector<Run> runs;
  std::vector<int32_t> run_of;  // run of each sorted entry (in its group)
  std::vector<float> dlog;      // d log_k / d log_q of each sorted entry, then its suffix sum
  std::vector<float> drex;      // d rex of each sorted entry (0 for reads)

  explicit BwdScratch(size_t entries) : run_of(entries), dlog(entries), drex(entries) {
    keys.reserve(entries);
    runs.reserve(entries);
  }
};

void phase1_bwd_unit(const Phase1GradArrays& all, const Phase1Dims& d, int64_t u, BwdScratch& s) {
  const int64_t C = d.C, W = d.W, R = d.R;
  const int64_t CW = C * W, CR = C * R;
  const Phase1GradArrays a = all.unit(u, C, W, R);

  // Invalid entries and repeat gates keep these zeros.
  std::fill(a.dk_val, a.dk_val + CW, 0.0f);
  std::fill(a.dx, a.dx + CW, 0.0f);
  std::fill(a.dq_val, a.dq_val + CR, 0.0f);

  std::vector<uint64_t>& keys = s.keys;
  sort_entries(a.k_idx, a.q_idx, d, keys);
  const int64_t E = static_cast<int64_t>(keys.size());
  std::vector<Run>& runs = s.runs;
  int32_t* run_of = s.run_of.data();
  float* dlog = s.dlog.data();
  float* drex = s.drex.data();

  for (int64_t begin = 0, end = 0; begin < E; begin = end) {
    end = group_end(keys, begin);

    // The runs of the group, as in the forward.
    runs.clear();
    for (int64_t p = begin; p < end; ++p) {
      const Entry e = decode(keys[p], d);
      if (e.is_write) {
        add_to_runs(runs, e.t, true, a.k_val[e.id], a.x[e.id]);  // a repeat's gate is not used
      } else {
        add_to_runs(runs, e.t, false, a.q_val[e.id], 0.0f);
      }
      run_of[p] = static_cast<int32_t>(runs.size() - 1);
    }

    // Pair terms: term = K_a K_b exp(X_ab) with cotangent c; X_ab = L_a - L_b, so
    // its gradient goes to L_a and, negated, to L_b (then to the gates by the suffix
    // sums below).
    for_each_pair(runs, [&](Run& ar, Run& br, float x) {
      const float c = (ar.is_write ? a.dA : a.dQK)[static_cast<int64_t>(ar.token) * C + br.token];
      const float ce = c * std::exp(x);
      ar.dsum += ce * br.sum;
      br.dsum += ce * ar.sum;
      const float dterm = ce * ar.sum * br.sum;
      ar.dlog += dterm;
      br.dlog -= dterm;
    });

    // Per entry: weights, and the gradients of each entry's log values; the
    // gradient of the group total.
    float dtotal = 0.0f;
    for (int64_t p = begin; p < end; ++p) {
      const Entry e = decode(keys[p], d);
      const Run& run = runs[run_of[p]];
      const bool run_head = p == begin || run_of[p - 1] != run_of[p];
      float dl;
      if (e.is_write) {
        const float el = std::exp(a.log_k[e.id]), er = std::exp(a.rex[e.id]);
        const float k = a.k_val[e.id];
        a.dk_val[e.id] = a.dk_eff[e.id] * el + a.dw[e.id] * er + run.dsum;
        dl = a.dk_eff[e.id] * (k * el);
        drex[p] = a.dw[e.id] * (k * er);
        dtotal += a.dcpe[e.id] * a.cpe[e.id];
      } else {
        const float el = std::exp(a.log_q[e.id]);
        a.dq_val[e.id] = a.dq_w[e.id] * el + run.dsum;
        dl = a.dq_w[e.id] * (a.q_val[e.id] * el);
        drex[p] = 0.0f;
      }
      dlog[p] = run_head ? dl + run.dlog : dl;
    }

    // Suffix sums of the log gradients (in place), from the group's end.
    float suffix = 0.0f;
    for (int64_t p = end - 1; p >= begin; --p) {
      suffix += dlog[p];
      dlog[p] = suffix;
    }

    // Gates of the non-repeat writes: suffix from p, rex gradients before p, total.
    float prefix = 0.0f;
    for (int64_t p = begin; p < end; ++p) {
      const Entry e = decode(keys[p], d);
      if (!e.is_write) continue;
      if (!is_repeat(keys, begin, p, d)) a.dx[e.id] = dlog[p] + prefix + dtotal;
      prefix += drex[p];
    }
  }
}

}  // namespace

void phase1_cpu(const Phase1Arrays& a, const Phase1Dims& d) {
  parallel_blocks(d.N, units_per_thread(d), [&](int64_t lo, int64_t hi) {
    Scratch scratch(static_cast<size_t>(d.entries()));
    for (int64_t u = lo; u < hi; ++u) phase1_unit(a, d, u, scratch);
  });
}

void phase1_bwd_cpu(const Phase1GradArrays& a, const Phase1Dims& d) {
  parallel_blocks(d.N, units_per_thread(d), [&](int64_t lo, int64_t hi) {
    BwdScratch scratch(static_cast<size_t>(d.entries()));
    for (int64_t u = lo; u < hi; ++u) phase1_bwd_unit(a, d, u, scratch);
  });
}

}  // namespace sdm
