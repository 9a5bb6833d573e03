// CPU chunk steps (kernels/chunk_steps.h): the forward chunk step of docs/MATH.md "The forward chunk step" (gather,
// apply the inverse, write with snapshot) and the backward of docs/MATH.md "Backward of a chunk" (GWR, the readings'
// and the inverse's adjoints, Phase A, read side), one function per phase.
//
// Streams are independent through every chunk, so each thread takes whole streams and runs their chunks in
// order; every value is computed by one thread in a fixed order, whatever the split.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/bf16.h"
#include "kernels/chunk_steps.h"
#include "kernels/parallel.h"

namespace sdm {
namespace {

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

template <typename BankT>
inline float dot_row(const float* a, const BankT* row, int64_t n) {
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * to_float(row[i]);
  return s;
}

// out[t] = sum over lanes of weight * row_of(s, t), the row that token t reads for slot s (out-of-range ids and
// null rows are skipped).
template <typename RowOf>
void gather(RowOf row_of, const int32_t* idx, const float* weight, int64_t C, int64_t lanes, int64_t K, int64_t D,
            float* out) {
  std::fill(out, out + C * D, 0.f);
  for (int64_t t = 0; t < C; ++t) {
    float* o = out + t * D;
    for (int64_t n = 0; n < lanes; ++n) {
      const int32_t s = idx[t * lanes + n];
      if (s < 0 || s >= K) continue;
      const auto* row = row_of(s, t);
      if (!row) continue;
      const float wgt = weight[t * lanes + n];
      for (int64_t d = 0; d < D; ++d) o[d] += wgt * to_float(row[d]);
    }
  }
}

// out = L x for lower triangular L ([C, C], diagonal included), x [C, D].
void lower_times(const float* L, const float* x, int64_t C, int64_t D, float* out) {
  for (int64_t i = 0; i < C; ++i) {
    float* o = out + i * D;
    std::fill(o, o + D, 0.f);
    for (int64_t j = 0; j <= i; ++j) {
      const float l = L[i * C + j];
      if (l == 0.f) continue;
      for (int64_t d = 0; d < D; ++d) o[d] += l * x[j * D + d];
    }
  }
}

// out = L^T x for lower triangular L.
void lower_transpose_times(const float* L, const float* x, int64_t C, int64_t D, float* out) {
  for (int64_t j = 0; j < C; ++j) {
    float* o = out + j * D;
    std::fill(o, o + D, 0.f);
    for (int64_t i = j; i < C; ++i) {
      const float l = L[i * C + j];
      if (l == 0.f) continue;
      for (int64_t d = 0; d < D; ++d) o[d] += l * x[i * D + d];
    }
  }
}

// The write group g of a unit: its sorted entries [lo, hi) and its slot (-1 if empty or out of range).
inline int32_t group_slot(const int32_t* order, const int32_t* group, const int32_t* idx, int64_t g, int64_t K,
                          int32_t* lo, int32_t* hi) {
  *lo = group[g];
  *hi = group[g + 1];
  if (*lo >= *hi || order[*lo] < 0) return -1;
  const int32_t s = idx[order[*lo]];
  return (s >= 0 && s < K) ? s : -1;
}

// One unit's view of the packed sequences (kernels/chunk_steps.h, StepSegments): which bank a token reads a row
// from, and which write groups the chunk stores. Without segments every row is read from the working bank and every
// group is stored.
template <typename BankT>
struct UnitSegments {
  const int32_t* local = nullptr;  // null: no segments
  const BankT* initial = nullptr;
  int32_t* stamp = nullptr;
  int32_t* stamp_snapshot = nullptr;
  int32_t seg0 = 0;  // the segment running at the chunk's start
  int32_t last = 0;  // the chunk's last segment, counted from seg0

  UnitSegments(const StepSegments* sg, const StepDims& dm, int64_t stream, int64_t u) {
    if (!sg) return;
    local = sg->local + u * dm.C;
    initial = static_cast<const BankT*>(sg->initial) + stream * dm.K * dm.D;
    stamp = sg->stamp + stream * dm.K;
    stamp_snapshot = sg->stamp_snapshot ? sg->stamp_snapshot + u * dm.C * dm.W : nullptr;
    seg0 = sg->seg0[u];
    last = *std::max_element(local, local + dm.C);
  }
  // Whether token t reads slot s from the working bank: it continues the chunk's first segment and the row was
  // last written in that segment. Else the row is as at the segment's start: the initial bank's.
  bool current(int32_t s, int64_t t) const { return !local || (local[t] == 0 && stamp[s] == seg0); }
  // Whether token t's writes are stored: those of the chunk's last segment (the earlier ones are over).
  bool stored(int64_t t) const { return !local || local[t] == last; }
  // The row of slot s that token t reads, the working bank being `bank`.
  const BankT* row(const BankT* bank, int32_t s, int64_t t, int64_t D) const {
    return (current(s, t) ? bank : initial) + static_cast<int64_t>(s) * D;
  }
};

struct Scratch {
  std::vector<float> a, b, c, d, e;
  explicit Scratch(int64_t n) : a(n), b(n), c(n), d(n), e(n) {}
};

// The snapshot (MATH.md "The forward chunk step", "Snapshot storage"; ForwardIO::snapshot): per unit and write group g
// of a chunk before the last, the row of the group's slot after the chunk's write, entry StepDims::snapshot_entry(u, g)
// of the call, stored as snapshot_dtype says (kernels/snapshot_codec.h). The forward stores it (store); the backward
// reads the row as it was before a chunk through a link (load: the decoded row, rounded to the bank's dtype). This is
// the only code that knows its layout.
template <typename BankT>
struct Snapshot {
  SnapshotDtype type;
  uint8_t* rows;  // null: no residuals
  float* scale;
  int64_t row_bytes, D;

  Snapshot(const void* snapshot, const float* snapshot_scale, SnapshotDtype t, const StepDims& dm)
      : type(t),
        rows(static_cast<uint8_t*>(const_cast<void*>(snapshot))),
        scale(snapshot && snapshot_scaled(t) ? const_cast<float*>(snapshot_scale) : nullptr),
        row_bytes(snapshot_row_bytes(t, dm.D, sizeof(BankT))),
        D(dm.D) {}
  explicit operator bool() const { return rows != nullptr; }

  void store(int64_t entry, const BankT* row) const {
    uint8_t* out = rows + entry * row_bytes;
    if (type == SnapshotDtype::kBank) {
      std::memcpy(out, row, row_bytes);
      return;
    }
    float amax = 0.f;
    if (scale) {
      for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(to_float(row[d])));
      scale[entry] = snapshot_scale(type, amax);
    }
    const float inverse = scale ? snapshot_inverse(scale[entry]) : 0.f;
    const auto elem = [&](int64_t d) { return to_float(row[d]); };
    for (int64_t b = 0; b < row_bytes; ++b) out[b] = snapshot_byte(type, b, D, inverse, elem);
  }

  // The row as stored, decoded to float32 and rounded to the bank's dtype, into s0.
  void load(int64_t entry, float* s0) const {
    const uint8_t* in = rows + entry * row_bytes;
    if (type == SnapshotDtype::kBank) {
      const BankT* row = reinterpret_cast<const BankT*>(in);
      for (int64_t d = 0; d < D; ++d) s0[d] = to_float(row[d]);
      return;
    }
    const float sc = scale ? scale[entry] : 0.f;
    for (int64_t d = 0; d < D; ++d) s0[d] = to_float(from_float<BankT>(snapshot_element(type, in, d, sc)));
  }
};

// The links of one unit's entries (ForwardIO::link_k, link_q): each entry's slot's latest stored write in an
// earlier chunk of the stream, as its snapshot entry, or -1 where there is none (the row is the input bank's).
// `last` is the stream's table of those entries by slot, as the chunk starts.
inline void record_links(const int32_t* idx, int64_t n, int64_t K, const int32_t* last, int32_t* links) {
  for (int64_t e = 0; e < n; ++e) links[e] = idx[e] >= 0 && idx[e] < K ? last[idx[e]] : -1;
}

// The backward's S0, the row of a slot as it was before a chunk: the snapshot entry `link`, or for -1 the input
// bank's row (`input`: the stream's block of it).
template <typename BankT>
struct S0Rows {
  Snapshot<BankT> snap;
  const BankT* input;
  void load(int32_t link, int32_t s, float* s0) const {
    if (link >= 0) return snap.load(link, s0);
    const BankT* row = input + static_cast<int64_t>(s) * snap.D;
    for (int64_t d = 0; d < snap.D; ++d) s0[d] = to_float(row[d]);
  }
};

// ---- The forward chunk step (MATH.md "The forward chunk step"): gather, apply the inverse, write.

// Apply the inverse: u = beta (v - G), delta = Minv u, y = Q0 + QK delta (v and y in the bank's dtype, the rest
// float32). G becomes v - G when `save_vg`; `uvec` holds u, then the readings before their rounding.
template <typename BankT>
void apply_inverse(const StepDims& dm, const StepPhase1& p1, const ForwardIO& io, int64_t u, float* G, bool save_vg,
                   const float* Q0, float* uvec, float* delta) {
  const int64_t C = dm.C, D = dm.D;
  const BankT* v = static_cast<const BankT*>(io.v) + u * C * D;
  const float* beta = io.beta + u * C;
  BankT* y = static_cast<BankT*>(io.y) + u * C * D;
  for (int64_t t = 0; t < C; ++t)
    for (int64_t d = 0; d < D; ++d) {
      const float vg = to_float(v[t * D + d]) - G[t * D + d];
      uvec[t * D + d] = beta[t] * vg;
      if (save_vg) G[t * D + d] = vg;
    }
  lower_times(p1.minv + u * C * C, uvec, C, D, delta);
  lower_times(p1.QK + u * C * C, delta, C, D, uvec);
  for (int64_t i = 0; i < C * D; ++i) y[i] = from_float<BankT>(uvec[i] + Q0[i]);
}

// The write: one writer per written row, its group summed in sorted order, then the written row stored in the
// snapshot and the slot's latest write (`last`, the stream's) moved to it.
template <typename BankT>
void write_rows(const StepDims& dm, const StepPhase1& p1, const ForwardIO& io, int64_t u, BankT* S,
                const UnitSegments<BankT>& sg, const float* delta, float* acc, int32_t* last) {
  const int64_t C = dm.C, W = dm.W, K = dm.K, D = dm.D;
  const int32_t* k_idx = p1.k_idx + u * C * W;
  const int32_t* order = p1.w_order + u * C * W;
  const int32_t* group = p1.w_group + u * (C * W + 1);
  const float* w = p1.w + u * C * W;
  const Snapshot<BankT> snap(io.snapshot, io.snapshot_scale, io.snapshot_dtype, dm);
  const bool store = snap && dm.stores_snapshot(u / dm.P % dm.NC);
  for (int64_t g = 0; g < C * W; ++g) {
    int32_t lo, hi;
    const int32_t s = group_slot(order, group, k_idx, g, K, &lo, &hi);
    if (s < 0) continue;
    const int64_t t0 = order[lo] / W;
    if (!sg.stored(t0)) continue;
    BankT* row = S + static_cast<int64_t>(s) * D;
    const BankT* old = sg.row(S, s, t0, D);  // the row as at the segment's start
    if (sg.stamp_snapshot) sg.stamp_snapshot[g] = sg.stamp[s];
    const float cpe = p1.cpe[u * C * W + order[lo]];
    for (int64_t d = 0; d < D; ++d) acc[d] = cpe * to_float(old[d]);
    for (int32_t i = lo; i < hi; ++i) {
      const int32_t e = order[i];
      const float* de = delta + (e / W) * D;
      for (int64_t d = 0; d < D; ++d) acc[d] += w[e] * de[d];
    }
    for (int64_t d = 0; d < D; ++d) row[d] = from_float<BankT>(acc[d]);
    if (sg.local) sg.stamp[s] = sg.seg0 + sg.last;
    if (store) {
      snap.store(dm.snapshot_entry(u, g), row);
      last[s] = static_cast<int32_t>(dm.snapshot_entry(u, g));
    }
  }
}

// `last`: the stream's latest stored write of each slot (record_links), kept only with residuals.
template <typename BankT>
void forward_unit(const StepDims& dm, const StepPhase1& p1, const ForwardIO& io, int64_t u, BankT* S,
                  const UnitSegments<BankT>& sg, Scratch& sc, int32_t* last) {
  const int64_t C = dm.C, W = dm.W, R = dm.R, K = dm.K, D = dm.D;
  float* G = io.vg ? io.vg + u * C * D : sc.a.data();  // the gathers, then (saving) v - G
  float* Q0 = sc.b.data();
  float* delta = io.delta ? io.delta + u * C * D : sc.d.data();
  if (io.link_k) {
    record_links(p1.k_idx + u * C * W, C * W, K, last, io.link_k + u * C * W);
    record_links(p1.q_idx + u * C * R, C * R, K, last, io.link_q + u * C * R);
  }
  const auto row_of = [&](int32_t s, int64_t t) { return sg.row(S, s, t, D); };
  gather(row_of, p1.k_idx + u * C * W, p1.k_eff + u * C * W, C, W, K, D, G);
  gather(row_of, p1.q_idx + u * C * R, p1.q_w + u * C * R, C, R, K, D, Q0);
  apply_inverse<BankT>(dm, p1, io, u, G, io.vg != nullptr, Q0, sc.c.data(), delta);
  write_rows(dm, p1, io, u, S, sg, delta, sc.c.data(), last);  // u's scratch is free again
}

// ---- The backward of a chunk (MATH.md "Backward of a chunk"): GWR, the readings' and the inverse's adjoints,
// Phase A, the read side. `dS` is the stream's gradient bank (dS1 on entry, dS0 on return), `dI` the initial
// bank's gradient with packed sequences.

// One unit's arrays of the backward and its scratch rows ([C, D] float32 each).
struct UnitBackward {
  const float* delta;  // the forward's residuals
  const float* vg;
  const float* beta;
  const float* dy;  // the readings' cotangent, as float32
  float* ddelta;    // the cotangent of delta
  float* du;        // the cotangent of u = beta (v - G)
  float* dG;        // the cotangent of the gathers G
  float* tmp;       // scratch
};

// GWR: ddelta = sum_n w[t, n] dS1[s_{t,n}] over the stored writes, and dw[e] = <delta[t_e], dS1[s_e]>.
template <typename BankT, typename GradT>
void gwr(const StepDims& dm, const StepPhase1& p1, const BackwardIO& io, int64_t u, const GradT* dS,
         const UnitSegments<BankT>& sg, const UnitBackward& b) {
  const int64_t C = dm.C, W = dm.W, K = dm.K, D = dm.D;
  const int32_t* k_idx = p1.k_idx + u * C * W;
  float* dw = io.dw + u * C * W;
  gather([&](int32_t s, int64_t t) { return sg.stored(t) ? dS + static_cast<int64_t>(s) * D : nullptr; }, k_idx,
         p1.w + u * C * W, C, W, K, D, b.ddelta);
  for (int64_t e = 0; e < C * W; ++e) {
    const int32_t s = k_idx[e];
    dw[e] = (s >= 0 && s < K && sg.stored(e / W)) ? dot_row(b.delta + (e / W) * D, dS + static_cast<int64_t>(s) * D, D)
                                                   : 0.f;
  }
}

// The readings Y = Q0 + QK delta: ddelta += QK^T dy, dQK = tril(dy delta^T).
void readings_adjoint(const StepDims& dm, const StepPhase1& p1, const BackwardIO& io, int64_t u,
                      const UnitBackward& b) {
  const int64_t C = dm.C, D = dm.D;
  float* dQK = io.dQK + u * C * C;
  lower_transpose_times(p1.QK + u * C * C, b.dy, C, D, b.tmp);
  for (int64_t i = 0; i < C * D; ++i) b.ddelta[i] += b.tmp[i];
  for (int64_t i = 0; i < C; ++i)
    for (int64_t j = 0; j < C; ++j) dQK[i * C + j] = j <= i ? dot(b.dy + i * D, b.delta + j * D, D) : 0.f;
}

// The inverse's adjoint (delta = Minv u, u = beta (v - G)): du = Minv^T ddelta, dA = strict_tril(-beta du delta^T),
// dbeta = <du, v - G - A delta>, dv = beta du (in the bank's dtype, v's), dG = -beta du.
template <typename BankT>
void inverse_adjoint(const StepDims& dm, const StepPhase1& p1, const BackwardIO& io, int64_t u,
                     const UnitBackward& b) {
  const int64_t C = dm.C, D = dm.D;
  float* dA = io.dA + u * C * C;
  float* dbeta = io.dbeta + u * C;
  BankT* dv = static_cast<BankT*>(io.dv) + u * C * D;
  lower_transpose_times(p1.minv + u * C * C, b.ddelta, C, D, b.du);
  lower_times(p1.A + u * C * C, b.delta, C, D, b.tmp);  // A is strictly lower: tmp = A delta
  for (int64_t i = 0; i < C; ++i) {
    for (int64_t j = 0; j < C; ++j)
      dA[i * C + j] = j < i ? -b.beta[i] * dot(b.du + i * D, b.delta + j * D, D) : 0.f;
    float db = 0.f;
    for (int64_t d = 0; d < D; ++d) {
      const int64_t k = i * D + d;
      db += b.du[k] * (b.vg[k] - b.tmp[k]);
      dv[k] = from_float<BankT>(b.beta[i] * b.du[k]);
      b.dG[k] = -b.beta[i] * b.du[k];
    }
    dbeta[i] = db;
  }
}

// Phase A: per written row, the gradient row and the dots on the row as at the segment's start (S0, through the
// group's link; with segments the stamp is restored first). A row read from the initial bank sends its gradient
// there. `stored_groups`: the groups the forward stored (all of them without segments); else, with segments, the
// groups of the chunk's earlier segments, which run after the stored ones and only add the gradient of their
// gathers.
template <typename BankT, typename GradT>
void phase_a(const StepDims& dm, const StepPhase1& p1, const BackwardIO& io, int64_t u, const S0Rows<BankT>& src,
             GradT* dS, const UnitSegments<BankT>& sg, GradT* dI, const UnitBackward& b, bool stored_groups) {
  const int64_t C = dm.C, W = dm.W, K = dm.K, D = dm.D;
  const int32_t* k_idx = p1.k_idx + u * C * W;
  const int32_t* order = p1.w_order + u * C * W;
  const int32_t* group = p1.w_group + u * (C * W + 1);
  const float* k_eff = p1.k_eff + u * C * W;
  const float* cpe = p1.cpe + u * C * W;
  const int32_t* link = io.link_k + u * C * W;
  float* dk_eff = io.dk_eff + u * C * W;
  float* dcpe = io.dcpe + u * C * W;
  float* acc = b.tmp;
  float* s0 = b.tmp + D;
  for (int64_t g = 0; g < C * W; ++g) {
    int32_t lo, hi;
    const int32_t s = group_slot(order, group, k_idx, g, K, &lo, &hi);
    if (s < 0) continue;
    const int32_t e0 = order[lo];
    if (sg.stored(e0 / W) != stored_groups) continue;
    if (sg.local && stored_groups) sg.stamp[s] = sg.stamp_snapshot[g];
    const bool current = sg.current(s, e0 / W);
    src.load(current ? link[e0] : -1, s, s0);  // a stale row is the initial bank's, the input's
    GradT* drow = dS + static_cast<int64_t>(s) * D;
    GradT* target = current ? drow : dI + static_cast<int64_t>(s) * D;
    if (stored_groups) {
      dcpe[e0] = dot_row(s0, drow, D);
      for (int64_t d = 0; d < D; ++d) acc[d] = cpe[e0] * to_float(drow[d]);
      if (!current) {  // the write overwrote a stale row: its gradient goes to the initial row's
        for (int64_t d = 0; d < D; ++d) acc[d] += to_float(target[d]);
        std::fill(drow, drow + D, from_float<GradT>(0.f));
      }
    } else {
      for (int64_t d = 0; d < D; ++d) acc[d] = to_float(target[d]);
    }
    for (int32_t i = lo; i < hi; ++i) {
      const int32_t e = order[i];
      const float* dg = b.dG + (e / W) * D;
      dk_eff[e] = dot(dg, s0, D);
      for (int64_t d = 0; d < D; ++d) acc[d] += k_eff[e] * dg[d];
    }
    for (int64_t d = 0; d < D; ++d) target[d] = from_float<GradT>(acc[d]);
  }
}

// The read side: dS0[s] += sum q_w dy and dq_w = <dy, S0[s]> (S0 through the group's link), one writer per read
// row (with segments, one per read group in turn).
template <typename BankT, typename GradT>
void read_side(const StepDims& dm, const StepPhase1& p1, const BackwardIO& io, int64_t u, const S0Rows<BankT>& src,
               GradT* dS, const UnitSegments<BankT>& sg, GradT* dI, const UnitBackward& b) {
  const int64_t C = dm.C, R = dm.R, K = dm.K, D = dm.D;
  const int32_t* q_idx = p1.q_idx + u * C * R;
  const int32_t* r_order = p1.r_order + u * C * R;
  const int32_t* r_group = p1.r_group + u * (C * R + 1);
  const int32_t* link = io.link_q + u * C * R;
  const float* q_w = p1.q_w + u * C * R;
  float* dq_w = io.dq_w + u * C * R;
  float* acc = b.tmp;
  float* s0 = b.tmp + D;
  std::fill(dq_w, dq_w + C * R, 0.f);
  for (int64_t g = 0; g < C * R; ++g) {
    int32_t lo, hi;
    const int32_t s = group_slot(r_order, r_group, q_idx, g, K, &lo, &hi);
    if (s < 0) continue;
    const int64_t t0 = r_order[lo] / R;
    const bool current = sg.current(s, t0);
    GradT* drow = (current ? dS : dI) + static_cast<int64_t>(s) * D;
    src.load(current ? link[r_order[lo]] : -1, s, s0);
    for (int64_t d = 0; d < D; ++d) acc[d] = to_float(drow[d]);
    for (int32_t i = lo; i < hi; ++i) {
      const int32_t r = r_order[i];
      const float* dyr = b.dy + (r / R) * D;
      dq_w[r] = dot(dyr, s0, D);
      for (int64_t d = 0; d < D; ++d) acc[d] += q_w[r] * dyr[d];
    }
    for (int64_t d = 0; d < D; ++d) drow[d] = from_float<GradT>(acc[d]);  // one rounding per row
  }
}

template <typename BankT, typename GradT>
void backward_unit(const StepDims& dm, const StepPhase1& p1, const BackwardIO& io, int64_t u,
                   const S0Rows<BankT>& src, GradT* dS, const UnitSegments<BankT>& sg, GradT* dI, Scratch& sc) {
  const int64_t C = dm.C, W = dm.W, D = dm.D;
  // dy comes in the bank's dtype: the unit's rows as float32, once.
  float* dy = sc.e.data();
  const BankT* dy_in = static_cast<const BankT*>(io.dy) + u * C * D;
  for (int64_t i = 0; i < C * D; ++i) dy[i] = to_float(dy_in[i]);
  const UnitBackward b{io.delta + u * C * D, io.vg + u * C * D, io.beta + u * C, dy,
                       sc.a.data(), sc.c.data(), sc.d.data(), sc.b.data()};
  gwr(dm, p1, io, u, dS, sg, b);
  readings_adjoint(dm, p1, io, u, b);
  inverse_adjoint<BankT>(dm, p1, io, u, b);
  std::fill(io.dk_eff + u * C * W, io.dk_eff + (u + 1) * C * W, 0.f);
  std::fill(io.dcpe + u * C * W, io.dcpe + (u + 1) * C * W, 0.f);
  phase_a(dm, p1, io, u, src, dS, sg, dI, b, true);
  if (sg.local) phase_a(dm, p1, io, u, src, dS, sg, dI, b, false);
  read_side(dm, p1, io, u, src, dS, sg, dI, b);
}

int64_t scratch_size(const StepDims& dm) { return std::max<int64_t>(dm.C * dm.D, 3 * dm.D); }

}  // namespace

template <typename BankT>
void forward_cpu(const StepDims& dm, const StepPhase1& p1, const ForwardIO& io, BankT* bank,
                 const StepSegments* segments) {
  parallel_blocks(dm.streams(), 1, [&](int64_t lo, int64_t hi) {
    Scratch sc(scratch_size(dm));
    std::vector<int32_t> last(io.link_k ? dm.K : 0);
    for (int64_t s = lo; s < hi; ++s) {
      if (segments) std::fill(segments->stamp + s * dm.K, segments->stamp + (s + 1) * dm.K, 0);
      std::fill(last.begin(), last.end(), -1);
      for (int64_t c = 0; c < dm.NC; ++c) {
        const int64_t u = dm.unit(s, c);
        forward_unit(dm, p1, io, u, bank + s * dm.K * dm.D, UnitSegments<BankT>(segments, dm, s, u), sc,
                     last.data());
      }
    }
  });
}

template <typename BankT, typename GradT>
void backward_cpu(const StepDims& dm, const StepPhase1& p1, const BackwardIO& io, const BankT* bank_in,
                  GradT* dbank, const StepSegments* segments) {
  parallel_blocks(dm.streams(), 1, [&](int64_t lo, int64_t hi) {
    Scratch sc(scratch_size(dm));
    for (int64_t s = lo; s < hi; ++s) {
      GradT* dinitial = segments ? static_cast<GradT*>(segments->dinitial) + s * dm.K * dm.D : nullptr;
      const S0Rows<BankT> src{Snapshot<BankT>(io.snapshot, io.snapshot_scale, io.snapshot_dtype, dm),
                              bank_in + dm.input_stream(s) * dm.K * dm.D};
      for (int64_t c = dm.NC - 1; c >= 0; --c) {
        const int64_t u = dm.unit(s, c);
        backward_unit(dm, p1, io, u, src, dbank + s * dm.K * dm.D, UnitSegments<BankT>(segments, dm, s, u),
                      dinitial, sc);
      }
    }
  });
}

template void forward_cpu<float>(const StepDims&, const StepPhase1&, const ForwardIO&, float*, const StepSegments*);
template void forward_cpu<bf16>(const StepDims&, const StepPhase1&, const ForwardIO&, bf16*, const StepSegments*);
template void backward_cpu<float, float>(const StepDims&, const StepPhase1&, const BackwardIO&, const float*,
                                         float*, const StepSegments*);
template void backward_cpu<bf16, float>(const StepDims&, const StepPhase1&, const BackwardIO&, const bf16*, float*,
                                        const StepSegments*);
template void backward_cpu<bf16, bf16>(const StepDims&, const StepPhase1&, const BackwardIO&, const bf16*, bf16*,
                                       const StepSegments*);

}  // namespace sdm
