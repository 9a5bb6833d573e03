// Phase 1 on the CPU. See phase1.h and docs/DESIGN.md "Phase 1".
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
//     the entries of one (token, kind) form a *run* with one log value and the sum of
//     its weights. Each run meets the earlier write runs of its group:
//       write run a, earlier write run b:  A[t_a, t_b]  += K_a K_b exp(L_a - L_b)
//       read run r,  earlier write run b:  QK[t_r, t_b] += Q_r K_b exp(L_r - L_b)
//     which is the entry-pair sum of the definition, factored per run. Cells are
//     accumulated in (slot, run) order: fixed by the input.
//  4. The CSR group maps for writes and reads fall out of the same sorted walk.
// All arithmetic is float32, in a fixed order: the result is bitwise reproducible
// and independent of how units are split over threads.
#include "kernels/phase1.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <thread>
#include <vector>

namespace sdm {
namespace {

struct Run {
  int32_t token;
  bool is_write;
  float sum;  // sum of the weights of the run's entries, in lane order
  float log;  // log_k (write run) or log_q (read run), constant over the run
};

struct Scratch {
  std::vector<uint64_t> keys;
  std::vector<float> xe;  // gate of each sorted entry (0 for reads and repeats)
  std::vector<Run> runs;

  void reserve(size_t entries) {
    keys.reserve(entries);
    xe.resize(entries);
    runs.reserve(entries);
  }
};

struct Args {
  const int32_t* k_idx;
  const float* k_val;
  const float* x;
  const int32_t* q_idx;
  const float* q_val;
  int64_t C, W, R, K;
  float* log_k;
  float* rex;
  float* cpe;
  float* k_eff;
  float* w;
  float* log_q;
  float* q_w;
  float* A;
  float* QK;
  int32_t* w_order;
  int32_t* w_group;
  int32_t* r_order;
  int32_t* r_group;
  int32_t* repeats;
};

void phase1_unit(const Args& a, int64_t u, Scratch& s) {
  const int64_t C = a.C, W = a.W, R = a.R, K = a.K;
  const int64_t CW = C * W, CR = C * R, S = W + R;

  const int32_t* ki = a.k_idx + u * CW;
  const float* kv = a.k_val + u * CW;
  const float* xs = a.x + u * CW;
  const int32_t* qi = a.q_idx + u * CR;
  const float* qv = a.q_val + u * CR;

  float* log_k = a.log_k + u * CW;
  float* rex = a.rex + u * CW;
  float* cpe = a.cpe + u * CW;
  float* k_eff = a.k_eff + u * CW;
  float* wv = a.w + u * CW;
  float* log_q = a.log_q + u * CR;
  float* q_w = a.q_w + u * CR;
  float* A = a.A + u * C * C;
  float* QK = a.QK + u * C * C;
  int32_t* w_order = a.w_order + u * CW;
  int32_t* w_group = a.w_group + u * (CW + 1);
  int32_t* r_order = a.r_order + u * CR;
  int32_t* r_group = a.r_group + u * (CR + 1);

  // Values of invalid entries (and the starting point of everything else).
  std::fill(log_k, log_k + CW, 0.0f);
  std::fill(rex, rex + CW, 0.0f);
  std::fill(cpe, cpe + CW, 1.0f);
  std::fill(k_eff, k_eff + CW, 0.0f);
  std::fill(wv, wv + CW, 0.0f);
  std::fill(w_order, w_order + CW, int32_t{-1});
  std::fill(log_q, log_q + CR, 0.0f);
  std::fill(q_w, q_w + CR, 0.0f);
  std::fill(r_order, r_order + CR, int32_t{-1});
  std::fill(A, A + C * C, 0.0f);
  std::fill(QK, QK + C * C, 0.0f);

  // 1. Keys of the valid entries, sorted.
  std::vector<uint64_t>& keys = s.keys;
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

  const int64_t E = static_cast<int64_t>(keys.size());
  float* xe = s.xe.data();
  std::vector<Run>& runs = s.runs;

  int32_t n_w = 0, n_r = 0;  // positions in w_order / r_order
  int64_t g_w = 0, g_r = 0;  // number of write / read groups so far
  int32_t n_repeats = 0;

  int64_t begin = 0;
  while (begin < E) {
    const uint64_t slot = keys[begin] >> 32;
    int64_t end = begin + 1;
    while (end < E && (keys[end] >> 32) == slot) ++end;

    // 2a. Forward walk: repeats, inclusive prefix sums, CSR maps.
    bool group_has_write = false, group_has_read = false;
    float run = 0.0f;
    for (int64_t p = begin; p < end; ++p) {
      const int64_t seq = static_cast<int64_t>(keys[p] & 0xffffffffu);
      const int64_t t = seq / S, lane = seq % S;
      if (lane < W) {
        const int64_t id = t * W + lane;
        bool repeat = false;
        if (p > begin) {
          const int64_t prev = static_cast<int64_t>(keys[p - 1] & 0xffffffffu);
          repeat = (prev / S == t) && (prev % S < W);
        }
        const float g = repeat ? 0.0f : xs[id];
        n_repeats += repeat ? 1 : 0;
        xe[p] = g;
        run += g;
        log_k[id] = run;
        if (!group_has_write) {
          w_group[g_w++] = n_w;
          group_has_write = true;
        }
        w_order[n_w++] = static_cast<int32_t>(id);
      } else {
        const int64_t id = t * R + (lane - W);
        xe[p] = 0.0f;
        log_q[id] = run;
        if (!group_has_read) {
          r_group[g_r++] = n_r;
          group_has_read = true;
        }
        r_order[n_r++] = static_cast<int32_t>(id);
      }
    }
    const float decay = std::exp(run);

    // 2b. Backward walk: exclusive suffix sums (rex).
    float suffix = 0.0f;
    for (int64_t p = end - 1; p >= begin; --p) {
      const int64_t seq = static_cast<int64_t>(keys[p] & 0xffffffffu);
      const int64_t lane = seq % S;
      if (lane < W) {
        rex[(seq / S) * W + lane] = suffix;
        suffix += xe[p];
      }
    }

    // 2c. Per-entry values and the runs of the group.
    runs.clear();
    for (int64_t p = begin; p < end; ++p) {
      const int64_t seq = static_cast<int64_t>(keys[p] & 0xffffffffu);
      const int64_t t = seq / S, lane = seq % S;
      const bool is_write = lane < W;
      float weight, lg;
      if (is_write) {
        const int64_t id = t * W + lane;
        weight = kv[id];
        lg = log_k[id];
        cpe[id] = decay;
        k_eff[id] = weight * std::exp(lg);
        wv[id] = weight * std::exp(rex[id]);
      } else {
        const int64_t id = t * R + (lane - W);
        weight = qv[id];
        lg = log_q[id];
        q_w[id] = weight * std::exp(lg);
      }
      if (!runs.empty() && runs.back().token == t &&
          runs.back().is_write == is_write) {
        runs.back().sum += weight;
      } else {
        runs.push_back(Run{static_cast<int32_t>(t), is_write, weight, lg});
      }
    }

    // 3. Pair sums: each run meets the earlier write runs of its group.
    const int64_t n_runs = static_cast<int64_t>(runs.size());
    for (int64_t ra = 0; ra < n_runs; ++ra) {
      const Run& ar = runs[ra];
      float* row = (ar.is_write ? A : QK) + static_cast<int64_t>(ar.token) * C;
      for (int64_t rb = 0; rb < ra; ++rb) {
        const Run& br = runs[rb];
        if (!br.is_write) continue;
        row[br.token] += ar.sum * br.sum * std::exp(ar.log - br.log);
      }
    }

    begin = end;
  }

  // 4. Close the CSR offsets: w_group[G] = n_valid and every later offset too.
  for (int64_t g = g_w; g <= CW; ++g) w_group[g] = n_w;
  for (int64_t g = g_r; g <= CR; ++g) r_group[g] = n_r;
  a.repeats[u] = n_repeats;
}

}  // namespace

void phase1_cpu(const int32_t* k_idx, const float* k_val, const float* x,
                const int32_t* q_idx, const float* q_val, int64_t N, int64_t C,
                int64_t W, int64_t R, int64_t K, float* log_k, float* rex,
                float* cpe, float* k_eff, float* w, float* log_q, float* q_w,
                float* A, float* QK, int32_t* w_order, int32_t* w_group,
                int32_t* r_order, int32_t* r_group, int32_t* repeats,
                int num_threads) {
  if (N <= 0) return;
  const Args args{k_idx, k_val, x, q_idx, q_val, C, W, R, K,
                  log_k, rex, cpe, k_eff, w, log_q, q_w, A, QK,
                  w_order, w_group, r_order, r_group, repeats};
  const size_t entries = static_cast<size_t>(C * (W + R));

  // Thread count: from the work size unless given. The split only changes which
  // thread computes a unit, never how.
  int64_t nt = num_threads;
  if (nt <= 0) {
    const int64_t hw = std::max<int64_t>(1, std::thread::hardware_concurrency());
    const int64_t work = N * std::max<int64_t>(1, C * (W + R + C));
    nt = std::min<int64_t>(std::min<int64_t>(hw, 16), work / (1 << 15) + 1);
  }
  nt = std::max<int64_t>(1, std::min<int64_t>(nt, N));

  // All allocation happens here, in the calling thread; the workers only reuse
  // reserved capacity.
  std::vector<Scratch> scratch(static_cast<size_t>(nt));
  for (Scratch& s : scratch) s.reserve(entries);

  auto block = [&](int64_t b) {
    const int64_t lo = N * b / nt, hi = N * (b + 1) / nt;
    for (int64_t u = lo; u < hi; ++u) phase1_unit(args, u, scratch[b]);
  };

  std::vector<std::thread> workers;
  workers.reserve(static_cast<size_t>(nt - 1));
  for (int64_t b = 1; b < nt; ++b) {
    try {
      workers.emplace_back(block, b);
    } catch (...) {
      block(b);  // could not start a thread: do that block here
    }
  }
  block(0);
  for (std::thread& th : workers) th.join();
}

}  // namespace sdm
